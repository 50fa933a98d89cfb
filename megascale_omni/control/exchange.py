"""The control plane's collective per step boundary: rank 0's commands to every rank.

Every rank of the replica group contributes one float64 vector to a SUM
all-reduce. Rank 0 (the socket server) fills the command slots, everyone
else sends zeros. Adding zeros is exact, so after the all-reduce every rank
holds rank 0's ops bit for bit and applies them identically. It carries
commands only: step records and every rank's metrics row travel on the
metrics' own exchange (:mod:`megascale_omni.metrics.exchange`).

Layout: the op count, then 3 slots per op (:data:`MAX_OPS`): the kind, the
field (``config_set``) and the value. :data:`SIZE` float64 slots, whatever
the world size.

Pipelined: the all-reduce started at boundary *s* runs in the background
(``async_op``) during step *s+1* and is read at boundary *s+1*, so the
boundary is not a synchronisation point of its own (on a busy host a
blocking one cost milliseconds of scheduling per step, see BENCHMARKS.md).
Commands therefore apply one boundary after rank 0 took them: still at the
same step on every rank. With one rank nothing is in flight and there is no lag.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megascale_omni.control.commands import MUTABLE_FIELD_NAMES, Op

#: Ops carried per boundary; more wait for the next boundary (or pause poll).
MAX_OPS = 8
#: Index + 1 is the op's code on the wire (append only).
OP_KINDS: tuple[str, ...] = ("pause", "resume", "drain", "checkpoint", "config_set", "join")
_OPS_AT = 1
#: float64 slots of the command vector.
SIZE = _OPS_AT + 3 * MAX_OPS


class BoundaryExchange:
    """Encodes, all-reduces and decodes the command vector (every rank calls it,
    the same number of times).

    ``group`` is a gloo process group spanning the replica group, used for
    nothing else; with ``world_size == 1`` no collective runs at all.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], world_size: int, sends_ops: bool):
        self.group = group
        self.world_size = world_size
        self.sends_ops = sends_ops
        #: Calls between sending ops and getting them back (0 or 1).
        self.lag = 0 if world_size == 1 else 1
        self._inflight: Optional[tuple[Any, torch.Tensor]] = None

    def __call__(self, ops: Sequence[Op]) -> list[Op]:
        """Send ``ops`` (rank 0; ignored elsewhere); return what rank 0 sent ``lag`` calls ago."""
        values = [0.0] * SIZE
        if self.sends_ops:
            encode_ops(values, ops)
        if self.world_size == 1:
            return decode_ops(values)
        buf = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        received = self._wait()
        self._inflight = (work, buf)
        return received

    def flush(self, timeout_s: float) -> list[Op]:
        """Wait for the all-reduce still in flight (every rank, once, at the
        end) and return its ops."""
        return self._wait(timeout_s)

    def _wait(self, timeout_s: Optional[float] = None) -> list[Op]:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        work, buf = inflight
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        return decode_ops(buf.tolist())


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
