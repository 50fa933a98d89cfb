"""The metrics exchange: record and rank-row encoding, and its pipelining (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

import megascale_omni.metrics.exchange as exchange
from megascale_omni.metrics.exchange import (
    METRIC_FIELDS,
    SIZE,
    MetricsExchange,
    decode_rank_rows,
    decode_record,
    encode_rank_row,
    encode_record,
    vector_size,
)
from megascale_omni.metrics.schema import RANK_FIELDS, STEP_FIELDS


def test_record_round_trip_is_exact():
    record = {"step": 12, "loss": 2.3456789012345678, "lr": 3e-4, "grad_norm": None, "skipped": True,
              "tokens": 256, "tokens_per_s": float("inf"), "extra": "ignored"}
    values = [0.0] * SIZE
    encode_record(values, record)
    out = decode_record(values)
    assert out["step"] == 12 and type(out["step"]) is int
    assert out["loss"] == record["loss"] and out["skipped"] is True
    # None and absent fields come back absent (as in metrics.jsonl), never as 0.
    assert "grad_norm" not in out and "mfu" not in out
    assert out["tokens_per_s"] == float("inf") and "extra" not in out
    assert decode_record([0.0] * SIZE) is None


def test_vector_carries_every_scalar_schema_field_with_its_type():
    assert METRIC_FIELDS == tuple(f for f in STEP_FIELDS if f != "stragglers")
    # A full record as the loss rank logs it: ints, floats, bools, NaN, a list.
    record = {name: 0.1 * (i + 1) for i, name in enumerate(STEP_FIELDS)}
    record.update(step=7, tokens=2**40 + 1, slowest_rank=3, skipped=False, healed=True, loss=float("nan"),
                  stragglers=[1, 3])
    values = [0.0] * SIZE
    encode_record(values, record)
    out = decode_record(values)
    assert list(out) == list(METRIC_FIELDS)
    for name in METRIC_FIELDS:
        if name == "loss":
            assert math.isnan(out[name])
            continue
        assert out[name] == record[name] and type(out[name]) is type(record[name]), name


def test_rank_rows_sum_into_every_ranks_row():
    """Each of 3 ranks writes its row, the SUM all-reduce is emulated by adding
    the vectors: every row comes back exactly, NaN (absent) included."""
    world, n = 3, len(RANK_FIELDS)
    rows = [[r + 0.1 * i for i in range(n)] for r in range(world)]
    rows[2][-1] = math.nan
    total = [0.0] * vector_size(world)
    for rank, row in enumerate(rows):
        values = [0.0] * vector_size(world)
        encode_rank_row(values, rank, 41, row)
        total = [a + b for a, b in zip(total, values)]
    assert vector_size(world) == SIZE + 1 + world * n
    out = decode_rank_rows(total, world)
    assert out.step == 41
    assert out.rows[:2] == rows[:2] and out.rows[2][:-1] == rows[2][:-1] and math.isnan(out.rows[2][-1])
    assert decode_rank_rows([0.0] * vector_size(world), world) is None  # a vector without rows


class _Peer:
    """Stands in for rank 1 of 2 in the SUM all-reduce: its row is added on wait."""

    def __init__(self, monkeypatch):
        self.started = 0
        monkeypatch.setattr(exchange.dist, "all_reduce", self._all_reduce)

    def _all_reduce(self, buf, op, group, async_op):
        assert async_op, "the metrics exchange never blocks at the boundary"
        self.started += 1
        peer = [0.0] * vector_size(2)
        encode_rank_row(peer, 1, 0, [2.0] * len(RANK_FIELDS))

        class Work:
            def wait(self, timeout=None):
                buf.add_(torch.tensor(peer, dtype=torch.float64))

        return Work()


def test_pipelined_exchange_returns_each_record_one_boundary_later(monkeypatch):
    peer = _Peer(monkeypatch)
    ex = MetricsExchange(group=None, world_size=2, rank=0, sends_record=True)
    row = [1.0] * len(RANK_FIELDS)
    assert ex(1, {"step": 1, "loss": 1.5}, row) is None  # nothing has come back yet
    assert ex(2, {"step": 2, "loss": 1.25}, row) == {"step": 1, "loss": 1.5}
    # rank_rows finishes the all-reduce of boundary 2 early: rows of step 2, once.
    rows = ex.rank_rows()
    assert rows.step == 2 and rows.rows == [row, [2.0] * len(RANK_FIELDS)]
    assert ex.rank_rows() is None
    # ...and its record comes back from the next call.
    assert ex(3, {"step": 3, "loss": 1.0}, row) == {"step": 2, "loss": 1.25}
    # settle (the control plane holding the job) brings boundary 3's record now, once.
    assert ex.settle() == {"step": 3, "loss": 1.0}
    assert ex.settle() is None and ex(4, None, row) is None
    ex.close()
    assert peer.started == 4 and ex.rank_rows().step == 4


def test_only_the_loss_rank_sends_its_record(monkeypatch):
    _Peer(monkeypatch)
    ex = MetricsExchange(group=None, world_size=2, rank=0, sends_record=False)
    ex(1, {"step": 1, "loss": 1.5}, [1.0] * len(RANK_FIELDS))
    assert ex.settle() is None and ex.rank_rows().step == 1


def test_one_rank_has_no_lag_and_no_collective(monkeypatch):
    monkeypatch.setattr(exchange.dist, "all_reduce", lambda *a, **k: pytest.fail("no collective with one rank"))
    ex = MetricsExchange.for_replica_group(sends_record=True)
    assert (ex.world_size, ex.lag) == (1, 0)
    assert ex(1, {"step": 1, "loss": 0.5}, [3.0] * len(RANK_FIELDS)) == {"step": 1, "loss": 0.5}
    assert ex.rank_rows() == (1, [[3.0] * len(RANK_FIELDS)])
