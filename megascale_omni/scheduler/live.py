"""Read a running job's state through its control socket, the way the live
scheduler will: ``status`` and the last ``metrics`` record, retried with
exponential backoff. A job that cannot be reached is reported as a value
(:class:`Observation` with ``reachable=False``), never raised, so one dead
socket cannot stop the scheduler's loop.

Called by ``omni-sched probe`` and by the live actuator once per tick per
replica group; one thread, blocking for at most the sum of the backoffs
plus ``attempts`` x ``timeout_s``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megascale_omni.control.client import Address, ControlClient, ControlError
from megascale_omni.control.protocol import ProtocolError
from megascale_omni.metrics.schema import STEP_FIELDS

log = logging.getLogger(__name__)

#: Step-record fields the policy reads, by their schema names.
METRIC_FIELDS = ("step", "samples_per_s", "step_s", "data_s", "busy_s", "straggler_count", "stragglers",
                 "participants", "data_s_max", "pipeline_wait_s", "pipeline_wait_s_max", "bubble_analytic",
                 "microbatches", "mem_peak_gib", "mem_peak_gib_max", "samples", "images", "tokens",
                 "vision_tokens", "samples_video", "vision_token_cost")
if not set(METRIC_FIELDS) <= set(STEP_FIELDS):  # a renamed field fails here, not as a metric gone quiet
    raise ImportError(f"scheduler reads step-record fields the schema lacks: {set(METRIC_FIELDS) - set(STEP_FIELDS)}")


@dataclass
class Observation:
    """One job's state as read now. ``metrics`` holds the :data:`METRIC_FIELDS`
    the last step record has (absent fields stay absent); ``error`` is the
    last failure when ``reachable`` is false."""

    job: str
    reachable: bool
    attempts: int
    waited_s: float = 0.0
    state: Optional[str] = None
    step: Optional[int] = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def data_wait_fraction(self) -> Optional[float]:
        """Share of the step spent waiting for data (a sign of surplus groups), or None."""
        step_s, data_s = self.metrics.get("step_s"), self.metrics.get("data_s")
        return data_s / step_s if step_s and data_s is not None else None

    def describe(self) -> str:
        if not self.reachable:
            return (f"{self.job}: unreachable after {self.attempts} attempt(s) over {self.waited_s:.1f} s: "
                    f"{self.error}")
        shown = " ".join(f"{k}={self.metrics[k]}" for k in METRIC_FIELDS if k in self.metrics and k != "step")
        return f"{self.job}: {self.state} at step {self.step} {shown}".rstrip()


def observe(job: str, address: Address, *, attempts: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
            timeout_s: float = 5.0, token: Optional[str] = None, sleep: Callable[[float], None] = time.sleep,
            connect: Callable[..., ControlClient] = ControlClient, quiet: bool = False) -> Observation:
    """Ask ``address`` for ``status`` and ``metrics``; on a connection,
    protocol or refusal error wait ``backoff_s`` x 2^k (capped at
    ``max_backoff_s``) and try again, ``attempts`` times in all. ``quiet``:
    failures are logged at debug level (a group still starting up is
    expected not to answer)."""
    warn = log.debug if quiet else log.warning
    waited = 0.0
    error = ""
    for attempt in range(1, attempts + 1):
        try:
            with connect(address, token=token, timeout_s=timeout_s) as client:
                status = client.call("status")
                records = client.call("metrics", last=1).get("records") or []
            last = records[-1] if records else {}
            return Observation(job, True, attempt, waited, status.get("state"), status.get("step"),
                               {k: last[k] for k in METRIC_FIELDS if k in last})
        except (OSError, ConnectionError, ProtocolError, ControlError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
            if attempt == attempts:
                break
            delay = min(max_backoff_s, backoff_s * 2 ** (attempt - 1))
            warn("%s: attempt %d/%d failed (%s); retrying in %.1f s", job, attempt, attempts, error, delay)
            sleep(delay)
            waited += delay
    (log.debug if quiet else log.error)("%s: unreachable after %d attempt(s): %s", job, attempts, error)
    return Observation(job, False, attempts, waited, error=error)
