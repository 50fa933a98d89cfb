"""Where a step's time goes: timed phases inside megatron's schedule, and memory.

The training step is timed from outside (data, forward/backward, optimizer,
boundary work); what happens *inside* megatron's forward/backward is timed
by :data:`PHASES`, which the seams below feed:

- ``pipeline_wait``: megatron's ``P2PCommunicator._communicate`` (every
  pipeline send/receive, blocking until the peer is ready: the measured
  bubble plus transfer), wrapped once by :func:`install_pipeline_timer`;
- ``grad_sync``: megatron's ``finalize_model_grads`` (DP all-reduce of the
  grad buffers, tied-embedding sync, token-count scaling; elastic: also the
  wait for the per-bucket cross-replica gradient sums), timed by the
  ``finalize_model_grads_func`` we install;
- ``cross_replica``: the elastic quorum wait, token-count and loss sums and
  the commit.

The step subtracts these from its forward/backward time to get pure
compute. The clock is per process and used by the training thread only.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Iterator

import torch

PHASE_NAMES = ("pipeline_wait", "grad_sync", "cross_replica")


class PhaseClock:
    """Accumulated seconds per phase since the last :meth:`reset` (training thread)."""

    def __init__(self) -> None:
        self._totals = dict.fromkeys(PHASE_NAMES, 0.0)
        self._depth = 0

    def reset(self) -> None:
        self._totals = dict.fromkeys(PHASE_NAMES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name``. Nested phases count once, in the
        outermost (a cross-replica reduction inside grad sync is grad sync
        unless timed separately outside it)."""
        if self._depth:
            yield
            return
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] += time.perf_counter() - t0
            self._depth -= 1

    def read(self) -> dict[str, float]:
        return dict(self._totals)


#: The process's clock.
PHASES = PhaseClock()


def timed(name: str, fn: Callable) -> Callable:
    """``fn`` with every call timed as phase ``name``."""

    def wrapper(*args, **kwargs):
        with PHASES.phase(name):
            return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def install_pipeline_timer() -> None:
    """Time every pipeline p2p call as ``pipeline_wait`` (idempotent; every
    rank, after the platform patches)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    current = P2PCommunicator._communicate
    if getattr(current, "__wrapped__", None) is not None:
        return
    P2PCommunicator._communicate = timed("pipeline_wait", current)


def analytic_bubble(pp: int, vpp: int, microbatches: int) -> float:
    """Idle share of a 1F1B (interleaved: ``vpp`` chunks) pipeline with
    ``microbatches`` per step: ``(pp - 1) / (vpp * m + pp - 1)``; 0 without PP."""
    if pp <= 1 or microbatches <= 0:
        return 0.0
    return (pp - 1) / (max(vpp, 1) * microbatches + pp - 1)


@functools.lru_cache(maxsize=1)
def _this_process():
    import psutil

    return psutil.Process()


def memory_stats(device: torch.device) -> dict[str, float]:
    """This rank's memory at the end of a step, GiB. On CUDA: allocated,
    reserved, the step's peak (the peak counter is reset for the next step)
    and fragmentation ``1 - allocated / reserved``; always: process RSS."""
    gib = float(1 << 30)
    stats = {"rss_gib": _this_process().memory_info().rss / gib}
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        stats.update(
            mem_allocated_gib=allocated / gib,
            mem_reserved_gib=reserved / gib,
            mem_peak_gib=torch.cuda.max_memory_allocated(device) / gib,
            mem_fragmentation=1.0 - allocated / reserved if reserved else 0.0,
        )
        torch.cuda.reset_peak_memory_stats(device)
    return stats
