"""The analytic bubble, memory fields and the replica group's aggregate of
the step record (model FLOPs and MFU: test_model_flops.py; the phase clock:
test_phase_clock.py)."""

from __future__ import annotations

import math

import pytest
import torch

from megascale_omni.metrics.breakdown import analytic_bubble, memory_stats
from megascale_omni.metrics.replica_group import ReplicaGroupMetrics, rank_row
from megascale_omni.metrics.schema import RANK_FIELDS


@pytest.mark.parametrize("pp,vpp,m,expected", [(1, 1, 8, 0.0), (2, 1, 4, 1 / 5), (4, 1, 8, 3 / 11), (4, 2, 8, 3 / 19)])
def test_analytic_bubble(pp, vpp, m, expected):
    assert analytic_bubble(pp, vpp, m) == pytest.approx(expected)


def test_memory_fields_on_cpu():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"rss_gib"} and 0.01 < stats["rss_gib"] < 64


def _rows(busy: list[float], data: float = 0.01) -> list[list[float]]:
    """Rank rows (RANK_FIELDS order) with ``busy`` split as data + compute."""
    return [[b, data, b - data, 0.0, 0.0, math.nan, 1.0 + r] for r, b in enumerate(busy)]


def test_replica_group_aggregates_and_flags_after_patience():
    assert RANK_FIELDS == ("busy_s", "data_s", "compute_s", "pipeline_wait_s", "grad_sync_s", "mem_peak_gib",
                           "rss_gib")
    group = ReplicaGroupMetrics(factor=2.0, patience=3, min_excess_s=0.01, announce=False)
    assert group.observe(0, None) == {} and group.describe() is None
    normal = group.observe(1, _rows([0.10, 0.11, 0.12, 0.10]))
    assert normal == {"group_step": 1, "busy_s_median": pytest.approx(0.105), "busy_s_max": 0.12, "slowest_rank": 2,
                      "data_s_max": 0.01, "compute_s_max": pytest.approx(0.11), "pipeline_wait_s_max": 0.0,
                      "grad_sync_s_max": 0.0, "rss_gib_max": 4.0, "stragglers": [], "straggler_count": 0}
    # Rank 3 is 3x the others' median: flagged on its third slow step, not before.
    for step in (2, 3):
        assert group.observe(step, _rows([0.10, 0.10, 0.10, 0.30]))["stragglers"] == []
    flagged = group.observe(4, _rows([0.10, 0.10, 0.10, 0.30]))
    assert flagged["stragglers"] == [3] and flagged["straggler_count"] == 1 and flagged["slowest_rank"] == 3
    assert group.observe(5, None) == flagged  # nothing new: the last evaluation again
    assert group.describe() == flagged
    # One normal step unflags it.
    assert group.observe(6, _rows([0.10, 0.10, 0.10, 0.11]))["stragglers"] == []


def test_replica_group_ignores_tiny_absolute_differences():
    # 10x slower, but by 0.9 ms: below min_excess_s, never a straggler.
    group = ReplicaGroupMetrics(factor=2.0, patience=1, min_excess_s=0.001, announce=False)
    assert group.observe(1, _rows([0.0001, 0.0001, 0.001], data=0.0))["stragglers"] == []
    assert group.observe(2, _rows([0.0001, 0.0001, 0.0012], data=0.0))["stragglers"] == [2]


def test_rank_row_of_a_record():
    record = {"data_s": 0.25, "compute_s": 0.5, "pipeline_wait_s": 0.125, "grad_sync_s": 0.0, "rss_gib": 2.0}
    row = rank_row(record)
    assert row[:5] == [0.75, 0.25, 0.5, 0.125, 0.0] and math.isnan(row[5]) and row[6] == 2.0
