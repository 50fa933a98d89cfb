"""The one collective per step boundary: commands out of rank 0, metrics into it.

Every rank of the replica group contributes one float64 vector to a SUM
all-reduce. Rank 0 (the socket server) fills the command slots, the loss rank
(last pipeline stage, TP 0, DP 0) fills the metric slots, everyone else sends
zeros. Adding zeros is exact, so after the all-reduce every rank holds rank
0's ops bit for bit (and applies them identically), and rank 0 holds the
loss rank's step record even when it owns no loss (PP > 1).

It also gives every rank every rank's own numbers (:data:`RANK_FIELDS`:
busy time, waits, memory), for the replica group's aggregate and straggler
detection (:mod:`megascale_omni.metrics.replica_group`): each rank writes
its row, the others send zeros there. Riding on this all-reduce instead of a
collective of their own halves the per-step collectives of the metrics.

Layout: the op count, 3 slots per op (:data:`MAX_OPS`), then two slots per
field of :data:`METRIC_FIELDS`: a type tag (0 absent, 1 float, 2 int, 3
bool) and the value. The tag brings every field back with the type the loss
rank logged (ints exact up to 2**53, NaN and inf as they were), and an absent
(or None) field comes back absent, never as 0. Then the step the rank rows
describe (rank 0 writes it; 0: no rows, e.g. a pause poll) and one row of
``len(RANK_FIELDS)`` slots per rank. :data:`SIZE` + 1 + 7 * world_size
float64 slots: about 100 + 7 per rank (29 KiB for 512 ranks).

Pipelined: the all-reduce started at boundary *s* runs in the background
(``async_op``) during step *s+1* and is read at boundary *s+1*, so the
boundary is not a synchronisation point of its own (on a busy host a
blocking one cost milliseconds of scheduling per step, see BENCHMARKS.md).
Commands therefore apply one boundary after rank 0 took them: still at the
same step on every rank. With one rank nothing is in flight and there is no lag.
:meth:`BoundaryExchange.complete` may finish the all-reduce earlier (when
the next step's record is built, so its straggler fields are one step old,
not two); the next call then returns what it received.
"""

from __future__ import annotations

import datetime
import math
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from megascale_omni.control.commands import MUTABLE_FIELD_NAMES, Op
from megascale_omni.metrics.schema import RANK_FIELDS, STEP_FIELDS
from megascale_omni.metrics.values import scalar_value

#: Ops carried per boundary; more wait for the next boundary (or pause poll).
MAX_OPS = 8
#: Index + 1 is the op's code on the wire (append only).
OP_KINDS: tuple[str, ...] = ("pause", "resume", "drain", "checkpoint", "config_set", "join")
#: Step-record fields that are not one number (never carried).
NON_SCALAR_FIELDS = frozenset({"stragglers"})
#: Step-record fields carried to rank 0 for ``status`` and ``metrics``: every
#: scalar field of the schema, so the control socket reports what the JSONL,
#: TensorBoard and Prometheus exporters do.
METRIC_FIELDS: tuple[str, ...] = tuple(name for name in STEP_FIELDS if name not in NON_SCALAR_FIELDS)
_ABSENT, _FLOAT, _INT, _BOOL = 0, 1, 2, 3
_OPS_AT = 1
_METRICS_AT = _OPS_AT + 3 * MAX_OPS
#: Slots before the rank rows (independent of the world size).
SIZE = _METRICS_AT + 2 * len(METRIC_FIELDS)
_ROWS_STEP_AT = SIZE
_ROWS_AT = SIZE + 1


def vector_size(world_size: int) -> int:
    """float64 slots of the boundary vector of a replica group of ``world_size`` ranks."""
    return _ROWS_AT + world_size * len(RANK_FIELDS)


class RankRows(NamedTuple):
    """Every rank's :data:`RANK_FIELDS` of one step (NaN where a rank had none)."""

    step: int
    #: ``rows[rank][i]`` is rank ``rank``'s value of ``RANK_FIELDS[i]``.
    rows: list[list[float]]


class Received(NamedTuple):
    """What one boundary brings back: rank 0's ops, the loss rank's record
    (None if none was sent) and every rank's row (None if none were sent)."""

    ops: list[Op]
    record: Optional[dict]
    rank_rows: Optional[RankRows]


_NOTHING = Received([], None, None)


class BoundaryExchange:
    """Encodes, all-reduces and decodes the boundary vector (every rank calls it,
    the same number of times).

    ``group`` is a gloo process group spanning the replica group, used for
    nothing else; with ``world_size == 1`` no collective runs at all.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], world_size: int, rank: int, sends_ops: bool,
                 sends_metrics: bool):
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.sends_ops = sends_ops
        self.sends_metrics = sends_metrics
        #: Calls between sending ops and getting them back (0 or 1).
        self.lag = 0 if world_size == 1 else 1
        self._inflight: Optional[tuple[Any, torch.Tensor]] = None
        #: What an early :meth:`complete` received, returned by the next call.
        self._completed: Received = _NOTHING

    def __call__(self, ops: Sequence[Op], record: Optional[dict], step: int = 0,
                 rank_row: Optional[Sequence[float]] = None) -> Received:
        """Send ``ops`` (rank 0), ``record`` (loss rank) and this rank's
        ``rank_row`` of ``step`` (every rank, or none of them); return what
        was sent ``lag`` calls ago."""
        values = [0.0] * vector_size(self.world_size)
        if self.sends_ops:
            encode_ops(values, ops)
        if self.sends_metrics and record is not None:
            encode_record(values, record)
        if rank_row is not None:
            encode_rank_row(values, self.rank, step, rank_row)
        if self.world_size == 1:
            return decode(values, self.world_size)
        buf = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.complete()
        received, self._completed = self._completed, _NOTHING
        self._inflight = (work, buf)
        return received

    def complete(self, timeout_s: Optional[float] = None) -> Optional[RankRows]:
        """Wait for the all-reduce in flight, if any (every rank, at the same
        point); its contents come back from the next call. Returns its rank
        rows (None when nothing was in flight or it carried none)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        work, buf = inflight
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        self._completed = decode(buf.tolist(), self.world_size)
        return self._completed.rank_rows

    def flush(self, timeout_s: float) -> Received:
        """Wait for the all-reduce still in flight (every rank, once, at the
        end) and return what has not been returned yet."""
        self.complete(timeout_s)
        received, self._completed = self._completed, _NOTHING
        return received


def decode(values: Sequence[float], world_size: int) -> Received:
    return Received(decode_ops(values), decode_record(values), decode_rank_rows(values, world_size))


def encode_ops(values: list[float], ops: Sequence[Op]) -> None:
    assert len(ops) <= MAX_OPS, f"at most {MAX_OPS} ops per boundary"
    values[0] = float(len(ops))
    for i, op in enumerate(ops):
        at = _OPS_AT + 3 * i
        values[at] = float(OP_KINDS.index(op.kind) + 1)
        if op.kind == "config_set":
            values[at + 1] = float(MUTABLE_FIELD_NAMES.index(op.field) + 1)
            values[at + 2] = float(op.value)


def decode_ops(values: Sequence[float]) -> list[Op]:
    ops = []
    for i in range(int(values[0])):
        at = _OPS_AT + 3 * i
        kind = OP_KINDS[int(values[at]) - 1]
        if kind != "config_set":
            ops.append(Op(kind))
            continue
        name = MUTABLE_FIELD_NAMES[int(values[at + 1]) - 1]
        ops.append(Op(kind, name, values[at + 2]))
    return ops


def encode_record(values: list[float], record: dict) -> None:
    """Write ``record``'s :data:`METRIC_FIELDS` into ``values`` (the loss rank).
    Absent fields and values that are not one number (None, lists) stay
    absent, as in every other exporter; other keys are ignored."""
    for i, name in enumerate(METRIC_FIELDS):
        value = scalar_value(record.get(name))
        if value is None:
            continue
        at = _METRICS_AT + 2 * i
        values[at] = float(_BOOL if isinstance(value, bool) else _INT if isinstance(value, int) else _FLOAT)
        values[at + 1] = float(value)


def decode_record(values: Sequence[float]) -> Optional[dict]:
    """The record :func:`encode_record` wrote (present fields only, in schema
    order, each with its original type), or None when no record was sent."""
    record: dict[str, Any] = {}
    for i, name in enumerate(METRIC_FIELDS):
        at = _METRICS_AT + 2 * i
        tag = int(values[at])
        if tag == _ABSENT:
            continue
        value = values[at + 1]
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
