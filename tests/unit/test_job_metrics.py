"""Per-job aggregation of the replica groups' step records (metrics/job.py)."""

from __future__ import annotations

import pytest

from megascale_omni.metrics.job import JOB_FIELDS, aggregate_job


def _record(step: int, step_s: float, cross: float, **extra) -> dict:
    return {"step": step, "loss": 2.0, "step_s": step_s, "cross_replica_s": cross, "tokens": 600, "samples": 12,
            **extra}


def test_job_step_is_the_slowest_group_and_tokens_are_counted_once():
    groups = {
        "r0": [_record(1, 0.30, 0.10, participants=2), _record(2, 0.25, 0.05, participants=2)],
        "r1": [_record(1, 0.31, 0.01, participants=2, straggler_count=1)],
    }
    job = aggregate_job(groups)
    assert [j["step"] for j in job] == [1, 2]
    first = job[0]
    assert set(first) == set(JOB_FIELDS)
    assert first["replica_groups"] == 2 and first["participants"] == 2 and first["loss"] == 2.0
    assert first["step_s"] == 0.31 and first["tokens_per_s"] == pytest.approx(600 / 0.31)
    assert first["samples_per_s"] == pytest.approx(12 / 0.31)
    # r1 worked 0.30 s before waiting, r0 0.20 s.
    assert first["slowest_replica"] == "r1" and first["replica_busy_s_max"] == pytest.approx(0.30)
    assert first["replica_busy_s_median"] == pytest.approx(0.25)
    assert first["rank_stragglers"] == ["r1"] and first["straggling_replicas"] == []
    # Step 2: only r0 recorded it (r1 left the quorum).
    assert job[1]["replica_groups"] == 1 and job[1]["slowest_replica"] == "r0"


def test_a_slow_replica_group_is_flagged_after_patience_steps():
    steps = range(1, 8)
    groups = {
        "r0": [_record(s, 1.0, 0.8) for s in steps],
        "r1": [_record(s, 1.0, 0.8) for s in steps],
        # From step 3 on r2 works 0.9 s while the others work 0.2 s (they wait for it).
        "r2": [_record(s, 1.0, 0.8 if s < 3 else 0.1) for s in steps],
    }
    job = aggregate_job(groups, factor=2.0, patience=3)
    assert [j["straggling_replicas"] for j in job] == [[], [], [], [], ["r2"], ["r2"], ["r2"]]
    assert all(j["slowest_replica"] == "r2" for j in job[2:])
