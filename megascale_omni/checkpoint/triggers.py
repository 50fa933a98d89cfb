"""When to save: signals, timers and requests, agreed by every rank.

Triggers arrive on one rank at a time (a signal, the control-socket thread,
a wall clock), but a save is collective. Each rank turns its local view into
a few flags; one small MAX all-reduce per step on a dedicated gloo group makes
the decision identical everywhere, at the same step boundary.

SIGUSR1 bursts. A scheduler signals every worker of a job, and the workers
see it at different step boundaries when one boundary's vote falls between
two deliveries. The vote tells each rank whether *some* rank had a SIGUSR1;
a rank that had none of its own at that vote is owed one: its next SIGUSR1,
if this rank received it (handler time, local monotonic clock) within
``signal_coalesce_s`` seconds after that vote completed, belongs to the same
burst and is consumed without a vote flag. So one burst saves once,
whatever step each rank sees it at. A rank owes at most one signal, and a
rank whose own SIGUSR1 was counted owes none, so a second burst (or a
second ``kill`` to the same worker) saves again.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Flag slots of the per-step agreement vector.
_BUSY, _SIGTERM, _SIGUSR1, _REQUEST, _TIMER = range(5)

#: Combines every rank's flags into their element-wise maximum (a collective).
Vote = Callable[[list[int]], list[int]]


@dataclass(frozen=True)
class Decision:
    """What every rank does at this step boundary."""

    #: Some rank's writer is still writing the in-flight save.
    writer_busy: bool
    #: Save now for this reason ("" = no save).
    save_reason: str
    #: Stop training after the save (SIGTERM).
    stop: bool


class Triggers:
    """Local trigger state of one rank plus the collective that agrees on it.

    ``vote`` defaults to a MAX all-reduce on ``group``; tests pass their own
    to drive several ranks in one process. ``clock`` (seconds, monotonic)
    times the wall-clock interval and the SIGUSR1 burst window.
    """

    def __init__(
        self,
        interval_steps: int,
        interval_minutes: float,
        group: Optional[dist.ProcessGroup],
        signal_coalesce_s: float = 60.0,
        vote: Optional[Vote] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.interval_steps = interval_steps
        self.interval_s = interval_minutes * 60.0
        self.signal_coalesce_s = signal_coalesce_s
        self.group = group
        self._vote = vote if vote is not None else self._all_reduce_max
        self._clock = clock
        self._lock = threading.Lock()
        self._sigterm = False
        # The handler only increments the count (no read-modify-write shared
        # with agree(), which may be interrupted by the handler itself).
        self._sigusr1_count = 0
        self._sigusr1_seen = 0
        self._sigusr1_at = 0.0
        #: Another rank's SIGUSR1 saved at this step; ours, if it arrives by
        #: ``_owed_until`` (clock), is part of that burst.
        self._owed_step: Optional[int] = None
        self._owed_until = 0.0
        self._requested: str = ""
        #: The request taken by local_flags(), named by decide().
        self._pending_reason = ""
        self._last_save = clock()
        self._previous_handlers: dict[int, object] = {}

    # ------------------------------------------------------------ local side
    def install_signal_handlers(self) -> None:
        """SIGTERM: save, then stop. SIGUSR1: save, keep training (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in ((signal.SIGTERM, self._on_sigterm), (signal.SIGUSR1, self._on_sigusr1)):
            self._previous_handlers[sig] = signal.signal(sig, handler)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    def _on_sigusr1(self, signum, frame) -> None:
        self._sigusr1_at = self._clock()
        self._sigusr1_count += 1

    def request(self, reason: str = "api") -> None:
        """Ask for a save at the next step boundary (thread-safe; any rank)."""
        with self._lock:
            self._requested = reason or "api"

    def saved(self) -> None:
        self._last_save = self._clock()

    # ------------------------------------------------------------ collective
    def agree(self, step: int, writer_busy: bool) -> Decision:
        """Combine every rank's flags (every rank, once per step boundary)."""
        local = self.local_flags(step, writer_busy)
        return self.decide(step, local, self._vote(local))

    def local_flags(self, step: int, writer_busy: bool) -> list[int]:
        """This rank's vote at ``step``; consumes its pending requests and signals."""
        with self._lock:
            requested, self._requested = self._requested, ""
        self._pending_reason = requested
        count = self._sigusr1_count
        sigusr1 = count != self._sigusr1_seen
        self._sigusr1_seen = count
        if sigusr1 and self._owed_step is not None:
            if self._sigusr1_at <= self._owed_until:
                logger.info("SIGUSR1 at step %d belongs to the burst saved at step %d; not saving again",
                            step, self._owed_step)
                sigusr1 = False
            self._owed_step = None
        timer_due = self.interval_s > 0 and self._clock() - self._last_save >= self.interval_s
        return [int(writer_busy), int(self._sigterm), int(sigusr1), int(bool(requested)), int(timer_due)]

    def decide(self, step: int, local: list[int], voted: list[int]) -> Decision:
        """The decision at ``step`` from this rank's ``local`` flags and the
        element-wise maximum over every rank (``voted``); same on every rank."""
        f = [bool(x) for x in voted]
        if f[_SIGUSR1] and not local[_SIGUSR1] and self.signal_coalesce_s > 0:
            self._owed_step = step
            self._owed_until = self._clock() + self.signal_coalesce_s
        elif local[_SIGUSR1]:
            self._owed_step = None
        requested = self._pending_reason
        self._pending_reason = ""
        if f[_SIGTERM]:
            reason = "sigterm"
        elif f[_REQUEST]:
            reason = requested or "api"
        elif f[_SIGUSR1]:
            reason = "sigusr1"
        elif self.interval_steps and step % self.interval_steps == 0:
            reason = "interval"
        elif f[_TIMER]:
            reason = "timer"
        else:
            reason = ""
        return Decision(writer_busy=f[_BUSY], save_reason=reason, stop=f[_SIGTERM])

    def _all_reduce_max(self, local: list[int]) -> list[int]:
        flags = torch.tensor(local, dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [int(x) for x in flags.tolist()]
