"""The elastic policy's mechanisms for queued workloads, each against the
policy with that mechanism off: shortest remaining work first (grows and
admission), the makespan's critical path, and a rebalance that must pay for
its joins (urgency.py, policy.py)."""

from __future__ import annotations

import dataclasses

import pytest

from megascale_omni.scheduler.model import (
    BARE_METAL,
    Action,
    CostModel,
    JobView,
    PoolView,
    ReplicaView,
    Snapshot,
    ThroughputCurve,
)
from megascale_omni.scheduler.policy import ElasticPolicy, Knobs
from megascale_omni.scheduler.urgency import critical_jobs, rank_by_remaining_work, work_bound_s

pytestmark = pytest.mark.timeout(60)
LINEAR = ThroughputCurve(((1, 100.0), (20, 2000.0)))  # 100 samples/s per 8-GPU group


def _job(name, groups=2, remaining=None, lo=2, hi=4, admitted=True, priority=1.0):
    replicas = tuple(ReplicaView(f"{name}-r{i + 1}", "bm", "running") for i in range(groups if admitted else 0))
    return JobView(name, priority, 8, lo, hi, LINEAR, 8.0 * hi, 0.0, admitted, replicas, remaining)


def _snap(t, jobs, nodes):
    used = sum(len(j.active) for j in jobs)
    return Snapshot(float(t), (PoolView("bm", BARE_METAL, 8, nodes, used),), tuple(jobs))


def _grows(knobs, jobs, nodes=7, minutes=5):
    """Feed the same snapshot each minute until the policy grows; returns {job: groups}."""
    policy = ElasticPolicy(knobs)
    for t in range(minutes):
        decisions = policy.decide(_snap(t, jobs, nodes))
        if decisions:
            assert all(d.action is Action.GROW for d in decisions)
            return {d.job: d.count for d in decisions}
    return {}


# A (listed first) has ten times B's remaining work; 3 free nodes for 4 wanted groups.
LONG, SHORT = 1e6, 1e5


def test_shortest_remaining_work_grows_first():
    jobs = [_job("A", remaining=LONG), _job("B", remaining=SHORT)]
    assert _grows(Knobs(critical_path=0), jobs) == {"B": 2, "A": 1}
    # Without the remaining-work weight the tie goes to the job listed first.
    assert _grows(Knobs(critical_path=0, remaining_work_exponent=0), jobs) == {"A": 2, "B": 1}


def test_the_job_that_sets_the_makespan_is_served_first():
    # The cluster needs (1e6 + 1e5) / 100 x 8 GPU-s / 56 GPUs = 1571 s for all the work; A alone
    # needs 1e6 / 400 = 2500 s at its largest size: A is critical, whatever its remaining work.
    jobs = [_job("A", remaining=LONG), _job("B", remaining=SHORT)]
    assert work_bound_s(jobs, 56) == pytest.approx(1571.43, rel=1e-4)
    assert critical_jobs(jobs, 56) == {"A"}
    assert _grows(Knobs(critical_path=1000), [jobs[1], jobs[0]]) == {"A": 2, "B": 1}
    assert _grows(Knobs(critical_path=0), [jobs[1], jobs[0]]) == {"B": 2, "A": 1}
    # With three times A's work left in B, B sets the makespan and A does not.
    assert critical_jobs([jobs[0], dataclasses.replace(jobs[1], remaining_samples=3e6)], 56) == {"B"}


def test_unknown_remaining_work_keeps_the_priorities():
    snap = _snap(0, [_job("A"), _job("B", priority=2.0)], 7)
    assert rank_by_remaining_work(snap) == snap


def test_admission_starts_the_shortest_waiting_job_first():
    holder = _job("X", groups=4, lo=4, hi=4, remaining=5e6)
    first = _job("A", admitted=False, remaining=LONG)
    second = _job("B", admitted=False, remaining=SHORT)
    knobs = Knobs(critical_path=0)
    for exponent, admitted in ((1.0, "B"), (0.0, "A")):
        decisions = ElasticPolicy(dataclasses.replace(knobs, remaining_work_exponent=exponent)).decide(
            _snap(0, [holder, first, second], nodes=6))
        assert [(d.job, d.action, d.count) for d in decisions] == [(admitted, Action.GROW, 2)]


def test_a_rebalance_acts_only_when_its_gain_pays_for_its_joins():
    low = _job("X", groups=8, lo=2, hi=8, priority=1.0)  # 8 groups on 12 nodes, load 1.0
    high = _job("Y", groups=4, lo=2, hi=8, priority=3.0)  # wants 8
    costs = CostModel().costs()  # 164 s cold join, survivors lose 14 s per join

    def first_rebalance(policy, at):
        policy.decide(_snap(0, [low, high], 12))
        return [(d.job, d.action, d.count) for d in policy.decide(_snap(at, [low, high], 12))]

    moved = [("X", Action.DRAIN, 4), ("Y", Action.GROW, 4)]
    # +800 weighted samples/s for 1 minute (48,000) does not pay for 4 joins: Y's new groups idle for
    # 164 s (1200 x 164) and its 4 running groups lose 14 s per join (1200 x 14 x 4), 263,779 in all.
    assert first_rebalance(ElasticPolicy(Knobs(rebalance_min=1), costs), 1) == []
    assert first_rebalance(ElasticPolicy(Knobs(rebalance_min=1)), 1) == moved  # joins not charged
    # Held for 30 minutes the same gain (1,440,000) pays.
    assert first_rebalance(ElasticPolicy(Knobs(rebalance_min=30), costs), 30) == moved
