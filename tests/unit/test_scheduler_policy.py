"""The elastic policy on small hand-built snapshots: hysteresis, confirmation,
cooldown, reclaims drained before their deadline (never killed), straggler
moves, the periodic rebalance, admission; and the simulator's kill at a
missed deadline."""

from __future__ import annotations

import pytest

from megascale_omni.config.errors import ConfigError
from megascale_omni.scheduler.model import (
    BARE_METAL,
    VM,
    Action,
    JobView,
    PoolView,
    Reclaim,
    ReplicaView,
    Snapshot,
    ThroughputCurve,
)
from megascale_omni.scheduler.planning import goodput_targets
from megascale_omni.scheduler.policy import ElasticPolicy, Knobs
from megascale_omni.scheduler.simulator import simulate
from megascale_omni.scheduler.trace import parse_trace

pytestmark = pytest.mark.timeout(60)
LINEAR = ThroughputCurve(((1, 100.0), (20, 2000.0)))  # 100 samples/s per group


def _job(name, bm=2, vm=0, demand=32.0, lo=2, hi=16, priority=1.0, straggler=None, admitted=True):
    """``bm`` groups on bare metal then ``vm`` on the VM pool; 8-GPU groups = one node each."""
    pools = ["bm"] * bm + ["vm"] * vm
    replicas = tuple(ReplicaView(f"{name}-r{i + 1}", pool, "running",
                                 straggler[1] if straggler and straggler[0] == i + 1 else None)
                     for i, pool in enumerate(pools))
    return JobView(name, priority, 8, lo, hi, LINEAR, demand, 0.0, admitted, replicas)


def _snap(t, jobs, bm_nodes=10, vm_nodes=10, reclaims=()):
    used = {"bm": 0, "vm": 0}
    for j in jobs:
        for r in j.active:
            used[r.pool] += 1
    reclaiming = sum(r.nodes for r in reclaims)
    pools = (PoolView("bm", BARE_METAL, 8, bm_nodes, used["bm"]),
             PoolView("vm", VM, 8, vm_nodes, used["vm"], reclaiming))
    return Snapshot(float(t), pools, tuple(jobs), tuple(reclaims))


def _run(policy, demands, start_groups, first_t=0):
    """Feed ``policy`` one snapshot per minute; apply its grows/drains to the
    job's size. Returns [(t, decision)]."""
    bm, vm = 2, start_groups - 2
    out = []
    for k, demand in enumerate(demands):
        t = first_t + k
        for d in policy.decide(_snap(t, [_job("A", bm=bm, vm=vm, demand=demand)])):
            out.append((t, d))
            vm += d.count if d.action is Action.GROW else -d.count
    return out


def test_load_inside_the_band_never_resizes():
    # 8 groups = 64 GPUs; demand 56..66 GPUs keeps the load in [0.875, 1.03]: inside (0.85, 1.05)
    demands = [56, 66, 60, 64, 58, 66, 56, 62] * 8
    assert _run(ElasticPolicy(Knobs(rebalance_min=1e9)), demands, 8) == []


def test_grow_waits_for_confirmation_then_sizes_to_demand():
    decided = _run(ElasticPolicy(), [64.0] * 6, 5)  # load 64 / 40 = 1.6
    assert [(t, d.action, d.count, d.pool) for t, d in decided] == [(3, Action.GROW, 3, "vm")]
    assert decided[0][1].reason == "load 1.60 > 1.05 for 3 min: 5 -> 8 groups"


def test_a_blip_shorter_than_the_confirmation_is_ignored():
    # Two minutes at 3x demand, then back: the smoothed load is high for less than confirm_min.
    assert _run(ElasticPolicy(Knobs(window_min=1, rebalance_min=1e9)), [40, 120, 120, 40, 40, 40, 40], 5) == []


@pytest.mark.parametrize("cooldown, first_shrink", [(15.0, 18), (0.0, 9)])
def test_cooldown_delays_the_reversal(cooldown, first_shrink):
    # Grow at t=3 (5 -> 8 groups); demand falls to 40 GPUs at t=4: the 5-minute mean drops
    # below 0.85 x 64 at t=6, the confirmation ends at t=9, the cooldown at t=3 + cooldown.
    policy = ElasticPolicy(Knobs(cooldown_min=cooldown, rebalance_min=1e9))
    decided = _run(policy, [64.0] * 4 + [40.0] * 20, 5)
    assert [(t, d.action, d.count) for t, d in decided] == [(3, Action.GROW, 3), (first_shrink, Action.DRAIN, 3)]
    assert decided[1][1].replica_ids == ("A-r8", "A-r7", "A-r6")  # VM groups, newest first


def test_reclaim_is_drained_as_late_as_is_safe_never_killed():
    # Called every minute: with a 1-minute margin the drain goes out 2 minutes before the deadline.
    policy = ElasticPolicy(Knobs(rebalance_min=1e9))
    job = _job("A", bm=2, vm=6, demand=64.0)
    assert policy.decide(_snap(49, [job], vm_nodes=6)) == []
    seen = {t: policy.decide(_snap(t, [job], vm_nodes=6, reclaims=(Reclaim("vm", 4, 60.0),))) for t in range(50, 59)}
    assert all(seen[t] == [] for t in range(50, 58))
    assert [(d.action, d.count) for d in seen[58]] == [(Action.DRAIN, 4)]
    assert seen[58][0].replica_ids == ("A-r8", "A-r7", "A-r6", "A-r5")
    assert seen[58][0].reason == "reclaim: 4 node(s) of vm leave at t=60 min (2 min left); drain before the deadline"
    # A first call knows no interval to its next one: it drains at once.
    first = ElasticPolicy(Knobs(rebalance_min=1e9)).decide(
        _snap(50, [job], vm_nodes=6, reclaims=(Reclaim("vm", 4, 60.0),)))
    assert [(d.action, d.count) for d in first] == [(Action.DRAIN, 4)]


def test_overdue_reclaim_kills_what_is_still_there_draining_groups_first():
    # Live: a drain hung past the deadline and the nodes are not taken yet.
    job = _job("A", bm=2, vm=4, demand=64.0)
    job = JobView(job.name, job.priority, job.replica_gpus, job.min_replicas, job.max_replicas, job.curve,
                  job.demand_gpus, 0.0, True, job.replicas[:5] + (ReplicaView("A-r6", "vm", "draining"),))
    snap = _snap(60, [job], vm_nodes=4, reclaims=(Reclaim("vm", 2, 60.0),))
    decisions = ElasticPolicy(Knobs(rebalance_min=1e9)).decide(snap)
    assert [(d.action, d.replica_ids) for d in decisions] == [(Action.KILL, ("A-r6", "A-r5"))]
    assert decisions[0].reason == "reclaim deadline t=60 min on vm passed with the group(s) still there: kill"


def test_reclaim_drains_the_straggler_and_the_lower_gain_job_first():
    rich = _job("A", bm=2, vm=3, demand=24.0, straggler=(4, 40.0))  # groups beyond 3 add nothing
    poor = _job("B", bm=2, vm=3, demand=40.0)
    snap = _snap(50, [rich, poor], vm_nodes=6, reclaims=(Reclaim("vm", 3, 55.0),))
    decisions = ElasticPolicy(Knobs(straggler_patience_min=1e9, rebalance_min=1e9)).decide(snap)
    assert [(d.job, d.action, d.replica_ids) for d in decisions] == [(
        "A", Action.DRAIN, ("A-r4", "A-r5", "A-r3"))]


def test_straggler_moved_after_its_patience():
    policy = ElasticPolicy(Knobs(rebalance_min=1e9))
    job = _job("A", bm=2, vm=2, demand=32.0, straggler=(3, 10.0))
    assert policy.decide(_snap(14, [job])) == []
    decisions = policy.decide(_snap(15, [job]))
    assert [(d.action, d.replica_ids, d.pool) for d in decisions] == [(Action.MOVE, ("A-r3",), "vm")]
    assert "straggler since t=10 min" in decisions[0].reason


def test_a_core_groups_replacement_goes_to_bare_metal_first():
    # A runs on its core only (2 groups on bare metal); r2 straggles. Its replacement must not go to
    # a VM, where a reclaim could take it and leave A below its minimum (issue 34).
    policy = ElasticPolicy(Knobs(rebalance_min=1e9))
    job = _job("A", bm=2, vm=0, demand=16.0, straggler=(2, 10.0))
    decisions = policy.decide(_snap(15, [job], bm_nodes=4, vm_nodes=4))
    assert [(d.action, d.replica_ids, d.pool) for d in decisions] == [(Action.MOVE, ("A-r2",), "bm")]
    # An elastic group's replacement still goes to a VM first (bare metal stays free for cores).
    job = _job("A", bm=2, vm=1, demand=24.0, straggler=(3, 10.0))
    decisions = ElasticPolicy(Knobs(rebalance_min=1e9)).decide(_snap(15, [job], bm_nodes=4, vm_nodes=4))
    assert [(d.action, d.replica_ids, d.pool) for d in decisions] == [(Action.MOVE, ("A-r3",), "vm")]


def test_a_reclaim_re_places_a_core_group_instead_of_draining_it():
    # A's core (min 2) has one group on a VM whose node is reclaimed: it moves to free bare metal.
    job = _job("A", bm=1, vm=1, demand=16.0)
    snap = _snap(58, [job], bm_nodes=3, vm_nodes=1, reclaims=(Reclaim("vm", 1, 60.0),))
    decisions = ElasticPolicy(Knobs(rebalance_min=1e9)).decide(snap)
    assert [(d.action, d.replica_ids, d.pool) for d in decisions] == [(Action.MOVE, ("A-r2",), "bm")]
    assert decisions[0].reason == "reclaim at t=60 min would leave A below its core of 2: re-place on bm"
    # With no bare metal free the deadline still wins: drained, never killed.
    full = _snap(58, [job, _job("B", bm=2, vm=0, demand=16.0)], bm_nodes=3, vm_nodes=1,
                 reclaims=(Reclaim("vm", 1, 60.0),))
    decisions = ElasticPolicy(Knobs(rebalance_min=1e9)).decide(full)
    assert [(d.job, d.action, d.replica_ids) for d in decisions] == [("A", Action.DRAIN, ("A-r2",))]


def test_a_group_is_never_drained_twice_in_one_round():
    # At t=30 X's load (32 / 64 GPUs) triggers a shrink to 4 groups and the periodic rebalance then
    # gives high-priority Y more: the rebalance must pick other groups of X, and the nodes Y grows
    # onto must exist (free nodes not counted twice).
    x = _job("X", bm=2, vm=6, demand=32.0)
    y = _job("Y", bm=2, vm=0, demand=64.0, priority=3.0)
    decisions = ElasticPolicy(Knobs(confirm_min=0)).decide(_snap(30, [x, y], bm_nodes=4, vm_nodes=6))
    drained = [rid for d in decisions if d.action is Action.DRAIN for rid in d.replica_ids]
    assert drained == ["X-r8", "X-r7", "X-r6", "X-r5", "X-r4", "X-r3"]  # shrink 8 -> 4, rebalance 4 -> 2
    assert sum(d.count for d in decisions if d.action is Action.GROW) == len(drained)  # nothing else is free


def test_rebalance_moves_groups_to_the_higher_priority_job():
    low = _job("X", bm=4, vm=4, demand=64.0, priority=1.0)  # 8 groups, load 1.0
    high = _job("Y", bm=2, vm=2, demand=64.0, priority=3.0)  # 4 groups, load 2.0, nothing free
    policy = ElasticPolicy(Knobs(rebalance_min=1))
    assert policy.decide(_snap(0, [low, high], bm_nodes=6, vm_nodes=6)) == []
    decisions = policy.decide(_snap(1, [low, high], bm_nodes=6, vm_nodes=6))
    assert [(d.job, d.action, d.count) for d in decisions] == [("X", Action.DRAIN, 4), ("Y", Action.GROW, 4)]
    assert decisions[0].reason == "rebalance: weighted goodput 2000 -> 2800 samples/s"
    assert decisions[0].replica_ids == ("X-r8", "X-r7", "X-r6", "X-r5")  # VM first


def test_goodput_targets_follow_weighted_marginal_gain():
    a = _job("A", demand=80.0, priority=1.0, hi=12)
    b = _job("B", demand=40.0, priority=2.0, hi=12)
    # 120 GPUs: cores 2 + 2; B fills to its demand (5 groups) first, A takes the rest up to 10.
    assert goodput_targets([a, b], 120, {"A": 80.0, "B": 40.0}) == {"A": 10, "B": 5}
    assert goodput_targets([a, b], 56, {"A": 80.0, "B": 40.0}) == {"A": 2, "B": 5}


def test_admission_drains_elastic_groups_off_bare_metal_for_a_core():
    holder = _job("X", bm=8, vm=0, demand=64.0)
    waiting = JobView("Z", 1.0, 8, 3, 6, LINEAR, 24.0, 0.0, False)
    decisions = ElasticPolicy().decide(_snap(0, [holder, waiting], bm_nodes=10, vm_nodes=0))
    assert [(d.job, d.action, d.count, d.pool) for d in decisions] == [
        ("X", Action.DRAIN, 1, ""), ("Z", Action.GROW, 3, "bm")]
    assert decisions[0].reason == "make room on bare metal for the core of Z"


def test_knobs_validation_names_the_knob():
    with pytest.raises(ConfigError) as e:
        Knobs.from_dict({"shrink_below": 1.2})
    assert e.value.field == "policy.shrink_below" and "hysteresis band" in e.value.hint
    with pytest.raises(ConfigError) as e:
        Knobs.from_dict({"cooldown": 5})
    assert e.value.field == "policy.cooldown" and "cooldown_min" in e.value.hint


RECLAIM_TRACE = {
    "horizon_min": 120,
    "pools": [{"name": "bm", "kind": "bare_metal", "gpus_per_node": 8, "nodes": 2},
              {"name": "vm", "kind": "vm", "gpus_per_node": 8, "nodes": 6, "reclaim_notice_min": 10,
               "availability": [{"at_min": 0, "nodes": 6}, {"at_min": 30, "nodes": 2}]}],
    "jobs": [{"name": "A", "replica_gpus": 8, "replicas": {"min": 2, "max": 8}, "work_samples": 1e9,
              "throughput": [[1, 100], [8, 800]], "demand": {"phases": [{"at_min": 0, "gpus": 64}]}}],
}


class _IgnoresReclaims(ElasticPolicy):
    """The elastic policy minus its reclaim handling: the simulator must kill at the deadline."""

    def decide(self, snap):
        return super().decide(Snapshot(snap.time_min, tuple(
            PoolView(p.name, p.kind, p.gpus_per_node, p.nodes, p.used) for p in snap.pools), snap.jobs))


def test_simulator_drains_on_notice_and_kills_only_past_the_deadline():
    trace = parse_trace(RECLAIM_TRACE)
    ok = simulate(trace, ElasticPolicy())
    assert (ok.reclaim_events, ok.reclaims_met, ok.groups_killed) == (1, 1, 0)
    drains = [(t, text) for t, text in ok.decisions if " drain " in text]
    assert drains == [(28.0, "A drain A-r8,A-r7,A-r6,A-r5: reclaim: 4 node(s) of vm leave at t=30 min "
                              "(2 min left); drain before the deadline")]
    bad = simulate(trace, _IgnoresReclaims())
    assert (bad.reclaim_events, bad.reclaims_met, bad.groups_killed) == (1, 0, 4)
    # Draining at the notice instead of just in time idles 4 groups for 8 more minutes.
    early = simulate(trace, ElasticPolicy(Knobs(reclaim_margin_min=9)))
    assert [t for t, text in early.decisions if " drain " in text] == [20.0]
    assert early.jobs[0].samples == pytest.approx(ok.jobs[0].samples - 4 * 100 * 8 * 60, rel=1e-3)
