"""Straggler detection inside a replica group.

Wall-clock step time cannot find a straggler in synchronous training: every
rank waits for the slowest in the next collective, so every rank's step
takes as long. What differs is *busy* time: a rank's own data wait plus its
compute, with pipeline, gradient-sync and cross-replica waits taken out
(the step breakdown measures them). A rank whose busy time exceeds
``factor`` times the median of the other ranks' (and the median by at
least ``min_excess_s``, so microsecond noise on tiny steps never counts) for
``patience`` consecutive steps is flagged; it is unflagged after one normal
step.

Each step starts one all-gather of one float per rank on a dedicated gloo
group of the replica group, in the background: it is collected at the next
step, so the straggler fields of a record describe the step before it, and
no rank waits for the gather.
"""

from __future__ import annotations

import logging
import statistics
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class StragglerDetector:
    """Per-step busy times of the replica group's ranks and the flagged ones
    (every rank calls :meth:`observe` once per committed step)."""

    def __init__(self, factor: float, patience: int, min_excess_s: float, announce: bool):
        self.factor = factor
        self.patience = patience
        self.min_excess_s = min_excess_s
        self.announce = announce
        self.world = dist.get_world_size()
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self._slow_steps = [0] * self.world
        self.flagged: list[int] = []
        self._last: dict = {}
        #: The gather in flight: (work, buffers, step).
        self._pending: Optional[tuple] = None

    def observe(self, busy_s: float, step: int) -> dict:
        """Start gathering this rank's ``busy_s`` of ``step`` and evaluate the
        previous step's gather (every rank, once per committed step).
        Returns ``busy_s`` (this rank, this step) and, from the previous
        step, ``busy_s_median``, ``busy_s_max``, ``slowest_rank``,
        ``stragglers`` and ``straggler_count``."""
        self.finish()
        if self.group is None:
            self._evaluate([busy_s], step)
        else:
            buffers = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
            work = dist.all_gather(buffers, torch.tensor([busy_s], dtype=torch.float64), group=self.group,
                                   async_op=True)
            self._pending = (work, buffers, step)
        return {"busy_s": busy_s, **self._last}

    def finish(self) -> None:
        """Wait for the gather in flight and evaluate it (every rank; also
        before the process group goes away)."""
        if self._pending is None:
            return
        work, buffers, step = self._pending
        self._pending = None
        work.wait()
        self._evaluate([float(t.item()) for t in buffers], step)

    def _evaluate(self, busy: list[float], step: int) -> None:
        before = set(self.flagged)
        for rank, t in enumerate(busy):
            others = busy[:rank] + busy[rank + 1:]
            reference = statistics.median(others) if others else t
            slow = t > self.factor * reference and t - reference > self.min_excess_s
            self._slow_steps[rank] = self._slow_steps[rank] + 1 if slow else 0
        self.flagged = [r for r, n in enumerate(self._slow_steps) if n >= self.patience]
        slowest = max(range(len(busy)), key=busy.__getitem__)
        median = statistics.median(busy)
        if self.announce:
            for rank in sorted(set(self.flagged) - before):
                logger.warning("straggler: rank %d was busy %.3f s at step %d against a median of %.3f s, slower "
                               "than %.1fx for %d steps in a row", rank, busy[rank], step, median, self.factor,
                               self.patience)
            for rank in sorted(before - set(self.flagged)):
                logger.info("straggler: rank %d is back to normal at step %d", rank, step)
        self._last = {"busy_s_median": median, "busy_s_max": busy[slowest], "slowest_rank": slowest,
                      "stragglers": list(self.flagged), "straggler_count": len(self.flagged)}

    def describe(self) -> Optional[dict]:
        """The last observation, for the control socket's ``status`` (None before the first step)."""
        return dict(self._last) if self._last else None
