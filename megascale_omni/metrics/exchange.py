"""The metrics' own collective per step boundary: the loss rank's record and every rank's row.

Every rank of the replica group contributes one float64 vector to a SUM
all-reduce of a gloo group of its own. The loss rank (last pipeline stage,
TP 0, DP 0) fills the record slots, every rank fills its own row of
:data:`~megascale_omni.metrics.schema.RANK_FIELDS` (busy time, waits,
memory), everyone else sends zeros there. Adding zeros is exact, so after the
all-reduce every rank holds the loss rank's step record (rank 0 serves it on
the control socket, even when it owns no loss under PP > 1) and every rank's
row (the replica group's aggregate and straggler detection,
:mod:`megascale_omni.metrics.replica_group`). Control commands travel on
their own all-reduce (:mod:`megascale_omni.control.exchange`).

Layout: two slots per field of :data:`METRIC_FIELDS`: a type tag (0 absent,
1 float, 2 int, 3 bool) and the value. The tag brings every field back with
the type the loss rank logged (ints exact up to 2**53, NaN and inf as they
were), and an absent (or None) field comes back absent, never as 0. Then the
step the rank rows describe (rank 0 writes it; 0: no rows) and one row of
``len(RANK_FIELDS)`` slots per rank: :data:`SIZE` + 1 + 7 * world_size
float64 slots (about 150 + 7 per rank; 29 KiB for 512 ranks).

Pipelined: the all-reduce started at boundary *s* runs in the background
(``async_op``) during step *s+1* and is read at boundary *s+1* at the latest,
so it is not a synchronisation point of its own (see BENCHMARKS.md, "Control
plane"). :meth:`MetricsExchange.rank_rows` finishes it earlier, when the next
step's record is built, so the straggler fields are one step old, not two;
:meth:`MetricsExchange.settle` finishes it while the control plane holds the
job (pause), so the socket reports the step it holds at. With one rank
nothing is in flight and there is no lag.
"""

from __future__ import annotations

import datetime
import logging
import math
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from megascale_omni.metrics.schema import RANK_FIELDS, STEP_FIELDS
from megascale_omni.metrics.values import scalar_value

logger = logging.getLogger(__name__)

#: Step-record fields that are not one number (never carried).
NON_SCALAR_FIELDS = frozenset({"stragglers"})
#: Step-record fields carried to rank 0 for ``status`` and ``metrics``: every
#: scalar field of the schema, so the control socket reports what the JSONL,
#: TensorBoard and Prometheus exporters do.
METRIC_FIELDS: tuple[str, ...] = tuple(name for name in STEP_FIELDS if name not in NON_SCALAR_FIELDS)
_ABSENT, _FLOAT, _INT, _BOOL = 0, 1, 2, 3
#: Slots before the rank rows (independent of the world size).
SIZE = 2 * len(METRIC_FIELDS)
_ROWS_STEP_AT = SIZE
_ROWS_AT = SIZE + 1


def vector_size(world_size: int) -> int:
    """float64 slots of the metrics vector of a replica group of ``world_size`` ranks."""
    return _ROWS_AT + world_size * len(RANK_FIELDS)


class RankRows(NamedTuple):
    """Every rank's :data:`RANK_FIELDS` of one step (NaN where a rank had none)."""

    step: int
    #: ``rows[rank][i]`` is rank ``rank``'s value of ``RANK_FIELDS[i]``.
    rows: list[list[float]]


class MetricsExchange:
    """Encodes, all-reduces and decodes the metrics vector (every rank calls
    :meth:`__call__`, :meth:`rank_rows`, :meth:`settle` and :meth:`close` at
    the same points).

    ``group`` is a gloo process group spanning the replica group, used for
    nothing else; with ``world_size == 1`` no collective runs at all.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], world_size: int, rank: int, sends_record: bool):
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.sends_record = sends_record
        #: Calls between sending a record and getting it back (0 or 1).
        self.lag = 0 if world_size == 1 else 1
        self._inflight: Optional[tuple[Any, torch.Tensor]] = None
        #: Received and not yet handed out (by :meth:`__call__`/:meth:`settle`, :meth:`rank_rows`).
        self._record: Optional[dict] = None
        self._rows: Optional[RankRows] = None

    @classmethod
    def for_replica_group(cls, sends_record: bool) -> MetricsExchange:
        """The exchange over the whole default group (every rank; a collective:
        creates the gloo group). ``sends_record``: this rank owns the loss."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        # gloo: CPU tensors work on NCCL jobs too, and this background
        # all-reduce never shares a queue with training's collectives.
        group = dist.new_group(backend="gloo") if world_size > 1 else None
        return cls(group, world_size, rank, sends_record)

    def __call__(self, step: int, record: Optional[dict], rank_row: Optional[Sequence[float]] = None) -> Optional[dict]:
        """Send ``record`` (loss rank; ignored elsewhere) and this rank's
        ``rank_row`` of ``step`` (every rank, or none of them). Returns the
        loss rank's newest record received and not yet returned (the one sent
        ``lag`` calls ago; None if none)."""
        values = [0.0] * vector_size(self.world_size)
        if self.sends_record and record is not None:
            encode_record(values, record)
        if rank_row is not None:
            encode_rank_row(values, self.rank, step, rank_row)
        if self.world_size == 1:
            self._keep(values)
        else:
            buf = torch.tensor(values, dtype=torch.float64)
            work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._wait()
            self._inflight = (work, buf)
        return self._take_record()

    def rank_rows(self) -> Optional[RankRows]:
        """Every rank's row of the newest step whose all-reduce has completed,
        once (None when no new one): finishes the all-reduce in flight first."""
        self._wait()
        rows, self._rows = self._rows, None
        return rows

    def settle(self, timeout_s: Optional[float] = None) -> Optional[dict]:
        """Finish the all-reduce in flight (waiting at most ``timeout_s``;
        RuntimeError past it) and return the loss rank's record it brought,
        if not yet returned."""
        self._wait(timeout_s)
        return self._take_record()

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the all-reduce still in flight so no collective outlives the
        process groups (every rank, once, at the end; a dead peer is waited
        for ``timeout_s`` at most, then logged)."""
        try:
            self._wait(timeout_s)
        except RuntimeError as e:  # a peer died; we are shutting down anyway
            logger.warning("metrics: last exchange did not complete: %s", e)

    def _wait(self, timeout_s: Optional[float] = None) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        work, buf = inflight
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        self._keep(buf.tolist())

    def _keep(self, values: Sequence[float]) -> None:
        record, rows = decode_record(values), decode_rank_rows(values, self.world_size)
        if record is not None:
            self._record = record
        if rows is not None:
            self._rows = rows

    def _take_record(self) -> Optional[dict]:
        record, self._record = self._record, None
        return record


def encode_record(values: list[float], record: dict) -> None:
    """Write ``record``'s :data:`METRIC_FIELDS` into ``values`` (the loss rank).
    Absent fields and values that are not one number (None, lists) stay
    absent, as in every other exporter; other keys are ignored."""
    for i, name in enumerate(METRIC_FIELDS):
        value = scalar_value(record.get(name))
        if value is None:
            continue
        at = 2 * i
        values[at] = float(_BOOL if isinstance(value, bool) else _INT if isinstance(value, int) else _FLOAT)
        values[at + 1] = float(value)


def decode_record(values: Sequence[float]) -> Optional[dict]:
    """The record :func:`encode_record` wrote (present fields only, in schema
    order, each with its original type), or None when no record was sent."""
    record: dict[str, Any] = {}
    for i, name in enumerate(METRIC_FIELDS):
        tag = int(values[2 * i])
        if tag == _ABSENT:
            continue
        value = values[2 * i + 1]
        if tag == _BOOL:
            record[name] = bool(value)
        elif tag == _INT and math.isfinite(value):
            record[name] = int(value)
        else:
            record[name] = value
    return record or None


def encode_rank_row(values: list[float], rank: int, step: int, row: Sequence[float]) -> None:
    """Write ``rank``'s row of ``step`` (one float per :data:`RANK_FIELDS`; NaN = absent)."""
    assert len(row) == len(RANK_FIELDS), f"a rank row has {len(RANK_FIELDS)} values"
    if rank == 0:
        values[_ROWS_STEP_AT] = float(step)
    at = _ROWS_AT + rank * len(RANK_FIELDS)
    values[at:at + len(row)] = [float(v) for v in row]


def decode_rank_rows(values: Sequence[float], world_size: int) -> Optional[RankRows]:
    """Every rank's row, or None when the vector carries none (step slot 0)."""
    step = int(values[_ROWS_STEP_AT])
    if step <= 0:
        return None
    n = len(RANK_FIELDS)
    rows = [list(values[_ROWS_AT + r * n:_ROWS_AT + (r + 1) * n]) for r in range(world_size)]
    return RankRows(step, rows)
