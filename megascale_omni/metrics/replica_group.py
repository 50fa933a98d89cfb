"""The replica group's view of a step: every rank's numbers, aggregated, and stragglers.

Every rank contributes its :data:`~megascale_omni.metrics.schema.RANK_FIELDS`
to the metrics exchange (:mod:`megascale_omni.metrics.exchange`, one
pipelined all-reduce per step that also brings the loss rank's record to
rank 0), so every rank holds every rank's row. The exchange completes during
the next step; the fields this module adds to a record
therefore describe ``group_step``, the step before it.

Wall-clock step time cannot find a straggler in synchronous training: every
rank waits for the slowest in the next collective, so every rank's step
takes as long. What differs is *busy* time: a rank's own data wait plus its
compute, with pipeline, gradient-sync and cross-replica waits taken out
(the step breakdown measures them). A rank whose busy time exceeds
``factor`` times the median of the other ranks' (and the median by at
least ``min_excess_s``, so microsecond noise on tiny steps never counts) for
``patience`` consecutive steps is flagged; it is unflagged after one normal
step.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Hashable, Mapping, Optional, Sequence

from megascale_omni.metrics.schema import RANK_FIELDS

logger = logging.getLogger(__name__)

#: Rank fields whose maximum over the group is reported as ``<name>_max``.
MAX_FIELDS = ("data_s", "compute_s", "pipeline_wait_s", "grad_sync_s", "mem_peak_gib", "rss_gib")
_BUSY = RANK_FIELDS.index("busy_s")


def rank_row(record: dict) -> list[float]:
    """This rank's :data:`RANK_FIELDS` from its own step record, NaN where absent.
    ``busy_s`` is computed here: ``data_s + compute_s``."""
    values = {**record, "busy_s": record["data_s"] + record["compute_s"]}
    return [float(values[name]) if isinstance(values.get(name), (int, float)) else math.nan for name in RANK_FIELDS]


class SlowTracker:
    """Flags members (ranks, replica groups) whose busy time exceeds
    ``factor`` times the median of the others' and that median by
    ``min_excess_s`` for ``patience`` consecutive observations."""

    def __init__(self, factor: float, patience: int, min_excess_s: float):
        self.factor = factor
        self.patience = patience
        self.min_excess_s = min_excess_s
        self._slow_steps: dict[Hashable, int] = {}

    def update(self, busy: Mapping[Hashable, float]) -> list:
        """One observation of every member's busy time (seconds); returns the
        flagged members in ``busy``'s order. A member missing from an
        observation starts counting again when it reappears."""
        keys = list(busy)
        counts = {}
        for i, key in enumerate(keys):
            others = [busy[k] for j, k in enumerate(keys) if j != i]
            reference = statistics.median(others) if others else busy[key]
            slow = busy[key] > self.factor * reference and busy[key] - reference > self.min_excess_s
            counts[key] = self._slow_steps.get(key, 0) + 1 if slow else 0
        self._slow_steps = counts
        return [k for k in keys if counts[k] >= self.patience]


class ReplicaGroupMetrics:
    """Aggregates the group's rank rows and flags stragglers (every rank
    calls :meth:`observe` with the same rows; the loss rank announces)."""

    def __init__(self, factor: float, patience: int, min_excess_s: float, announce: bool):
        self.factor = factor
        self.patience = patience
        self.announce = announce
        self._tracker = SlowTracker(factor, patience, min_excess_s)
        self.flagged: list[int] = []
        self._last: dict = {}

    def observe(self, step: int, rows: Optional[Sequence[Sequence[float]]]) -> dict:
        """Evaluate every rank's row of ``step`` (None: nothing new; the last
        evaluation is returned again). Returns the replica-group fields of
        the schema (``group_step``, ``busy_s_median``, ``busy_s_max``,
        ``slowest_rank``, ``<field>_max``, ``stragglers``, ``straggler_count``)."""
        if rows is not None:
            self._evaluate(step, rows)
        return dict(self._last)

    def _evaluate(self, step: int, rows: Sequence[Sequence[float]]) -> None:
        busy = [row[_BUSY] for row in rows]
        before = set(self.flagged)
        self.flagged = self._tracker.update(dict(enumerate(busy)))
        slowest = max(range(len(busy)), key=busy.__getitem__)
        median = statistics.median(busy)
        if self.announce:
            for rank in sorted(set(self.flagged) - before):
                logger.warning("straggler: rank %d was busy %.3f s at step %d against a median of %.3f s, slower "
                               "than %.1fx for %d steps in a row", rank, busy[rank], step, median, self.factor,
                               self.patience)
            for rank in sorted(before - set(self.flagged)):
                logger.info("straggler: rank %d is back to normal at step %d", rank, step)
        last = {"group_step": step, "busy_s_median": median, "busy_s_max": busy[slowest], "slowest_rank": slowest}
        for name in MAX_FIELDS:
            column = [row[RANK_FIELDS.index(name)] for row in rows]
            present = [v for v in column if not math.isnan(v)]
            if present:
                last[f"{name}_max"] = max(present)
        last.update(stragglers=list(self.flagged), straggler_count=len(self.flagged))
        self._last = last

    def describe(self) -> Optional[dict]:
        """The last evaluation, for the control socket's ``status`` (None before the first)."""
        return dict(self._last) if self._last else None
