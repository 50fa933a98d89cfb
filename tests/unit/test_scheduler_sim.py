"""The simulator on the shipped traces: the numbers issue 19 asks for, the
elastic policy against the static and greedy baselines (the plots are
checked through the CLI in test_scheduler_cli.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from megascale_omni.scheduler.baselines import GreedyGoodputPolicy, StaticPolicy
from megascale_omni.scheduler.model import Costs
from megascale_omni.scheduler.policy import ElasticPolicy
from megascale_omni.scheduler.report import table
from megascale_omni.scheduler.simulator import decision_log, simulate
from megascale_omni.scheduler.trace import load_trace, parse_trace

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
TWO_JOBS = REPO / "examples/scheduler/two_jobs.yaml"
DIURNAL = REPO / "examples/scheduler/diurnal_vm.yaml"


@pytest.fixture(scope="module")
def two_jobs():
    trace = load_trace(TWO_JOBS)
    return {
        "trace": trace,
        "elastic": simulate(trace, ElasticPolicy()),
        "static": simulate(trace, StaticPolicy()),
        "elastic_noisy": simulate(trace, ElasticPolicy(), noise=0.2, seed=1),
        "greedy_noisy": simulate(trace, GreedyGoodputPolicy(), noise=0.2, seed=1),
    }


@pytest.fixture(scope="module")
def diurnal():
    trace = load_trace(DIURNAL)
    return {"elastic": simulate(trace, ElasticPolicy()), "static": simulate(trace, StaticPolicy())}


def test_seed_example_is_the_seed_setup(two_jobs):
    trace = two_jobs["trace"]
    gpus = {j.name: (j.min_replicas * j.replica_gpus, j.max_replicas * j.replica_gpus) for j in trace.jobs}
    assert gpus == {"A": (120, 200), "B": (80, 120)}
    assert sum(p.nodes * p.gpus_per_node for p in trace.pools) == 320


def test_elastic_utilisation_at_least_90_percent_static_below(two_jobs):
    elastic, static = two_jobs["elastic"], two_jobs["static"]
    assert elastic.utilisation >= 0.90
    assert static.utilisation < 0.80  # peak allocation idles the surplus of every text-heavy phase
    assert two_jobs["elastic_noisy"].utilisation >= 0.90


def test_both_jobs_finish_close_to_static_on_fewer_gpu_hours(two_jobs):
    elastic, static = two_jobs["elastic"], two_jobs["static"]
    e = {j.name: j for j in elastic.jobs}
    s = {j.name: j for j in static.jobs}
    for name in ("A", "B"):
        assert e[name].completion_min is not None and s[name].completion_min is not None
        # Static always holds the peak, so it is the fastest possible here; elastic is within 2%.
        assert s[name].completion_min <= e[name].completion_min <= 1.02 * s[name].completion_min
    held_e = sum(j.gpu_hours for j in elastic.jobs)
    held_s = sum(j.gpu_hours for j in static.jobs)
    assert held_e < 0.8 * held_s


def test_noise_moves_per_hour_at_most_a_third_of_greedy(two_jobs):
    elastic, greedy = two_jobs["elastic_noisy"], two_jobs["greedy_noisy"]
    assert greedy.moves_per_hour > 50  # greedy follows every draw of the noise
    assert elastic.moves_per_hour <= greedy.moves_per_hour / 3


def test_noise_draws_are_the_same_for_every_policy(two_jobs):
    a, b = two_jobs["elastic_noisy"], two_jobs["greedy_noisy"]
    n = min(len(a.times), len(b.times))
    assert a.demand["A"][:n] == b.demand["A"][:n]
    assert len(set(a.demand["A"][:60])) > 30  # and it is noise


def test_diurnal_reclaims_met_by_their_deadline(diurnal):
    elastic = diurnal["elastic"]
    assert elastic.reclaim_events >= 10
    assert elastic.reclaims_met_fraction >= 0.99
    assert elastic.groups_killed == 0
    assert elastic.utilisation >= 0.90 > diurnal["static"].utilisation
    assert all(j.completion_min is not None for j in elastic.jobs)


def test_diurnal_straggler_is_moved_and_priority_job_starts_at_arrival(diurnal):
    log = [text for _, text in diurnal["elastic"].decisions]
    moves = [line for line in log if line.startswith("A move ")]
    assert len(moves) == 1 and "straggler since t=3000" in moves[0]
    c_admit = [t for t, text in diurnal["elastic"].decisions if text.startswith("C grow") and "admit" in text]
    assert c_admit == [1500]
    c_elastic = next(j for j in diurnal["elastic"].jobs if j.name == "C")
    c_static = next(j for j in diurnal["static"].jobs if j.name == "C")
    assert c_elastic.completion_min < 0.8 * c_static.completion_min


def test_static_restarts_and_elastic_does_not(diurnal):
    assert sum(j.restarts for j in diurnal["static"].jobs) > 0
    assert sum(j.restarts for j in diurnal["elastic"].jobs) == 0


def test_slower_joins_cost_throughput(two_jobs):
    trace = load_trace(TWO_JOBS)
    fast = two_jobs["elastic"]
    trace.costs = Costs(cold_join_s=600.0, standby_join_s=600.0)
    slow = simulate(trace, ElasticPolicy())
    assert slow.jobs[0].completion_min > fast.jobs[0].completion_min
    assert slow.utilisation < fast.utilisation


def test_decision_log_has_one_line_per_decision_with_its_reason(two_jobs):
    lines = decision_log(two_jobs["elastic"])
    assert len(lines) == len(two_jobs["elastic"].decisions)
    assert lines[0] == "t=0 A grow 15 on bare-metal: admit: core of 15 group(s) on bare metal"
    assert all(": " in line.split(" ", 3)[3] for line in lines)


def test_table_has_one_row_per_policy(two_jobs):
    text = table([two_jobs["elastic"], two_jobs["static"]])
    rows = text.splitlines()
    assert rows[0] == ("| policy | cluster util. | held util. | GPU-hours held | mean JCT (h) | p95 JCT (h) | "
                       "mean queue (h) | p95 queue (h) | below min (min) | A completion (h) | B completion (h) | "
                       "moves/hour | reclaim deadlines met | groups killed |")
    assert [r.split(" | ")[0] for r in rows[2:]] == ["| elastic", "| static"]
    e = two_jobs["elastic"]
    assert rows[2].startswith(f"| elastic | {e.cluster_utilisation:.3f} | {e.utilisation:.3f} | {e.gpu_hours:.0f} |")


def _flat_trace(policy=None):
    """One job whose demand says 8 groups but whose throughput is flat past 4, on 10 nodes."""
    return parse_trace({
        "horizon_min": 1200, "policy": policy or {},
        "pools": [{"name": "bm", "kind": "bare_metal", "gpus_per_node": 8, "nodes": 10}],
        "jobs": [{"name": "A", "replica_gpus": 8, "replicas": {"min": 2, "max": 8}, "work_samples": 1.0e+7,
                  "throughput": [[4, 400], [8, 400]], "demand": {"phases": [{"at_min": 0, "gpus": 64}]}}],
    })


def test_groups_past_the_throughput_curve_are_not_useful_and_not_bought():
    trace = _flat_trace()
    static, elastic, greedy = (simulate(trace, p) for p in (StaticPolicy(), ElasticPolicy(), GreedyGoodputPolicy()))
    # Static holds 8 groups, 4 of which add nothing: held utilisation about 1/2, not 1.
    assert static.utilisation == pytest.approx(0.5, abs=0.01)
    for r in (static, elastic, greedy):
        useful = sum(j.useful_gpu_hours for j in r.jobs)
        assert r.cluster_utilisation == pytest.approx(useful / r.cluster_gpu_hours, rel=1e-9)
        assert r.cluster_utilisation <= 0.4 + 1e-9  # at most 4 useful groups of 10 nodes
    # The elastic policy sizes the job from its curve's marginal gain: it stops at 4 groups.
    assert max(elastic.alloc["A"]) == 32
    assert elastic.gpu_hours < 0.55 * static.gpu_hours
    assert elastic.jobs[0].completion_min <= static.jobs[0].completion_min * 1.02
    # With the floor at 0 it still stops where the curve is flat.
    assert max(simulate(_flat_trace({"min_marginal_gain": 0}), ElasticPolicy()).alloc["A"]) == 32


def test_straggler_slowdown_is_not_useful_work(diurnal):
    static = diurnal["static"]
    a = next(j for j in static.jobs if j.name == "A")
    assert a.useful_gpu_hours < a.gpu_hours


CORE_STRAGGLER = {
    "horizon_min": 90,
    "pools": [{"name": "bm", "kind": "bare_metal", "gpus_per_node": 8, "nodes": 3},
              {"name": "vm", "kind": "vm", "gpus_per_node": 8, "nodes": 2, "reclaim_notice_min": 10,
               "availability": [{"at_min": 0, "nodes": 2}, {"at_min": 40, "nodes": 0}]}],
    "jobs": [{"name": "A", "replica_gpus": 8, "replicas": {"min": 2, "max": 2}, "work_samples": 1.0e+9,
              "throughput": [[2, 200]], "demand": {"phases": [{"at_min": 0, "gpus": 16}]}}],
    "stragglers": [{"job": "A", "at_min": 10, "until_min": 90, "slowdown": 0.5}],
}


@pytest.mark.parametrize("bm_nodes", [3, 2])
def test_a_job_never_runs_below_its_core(bm_nodes):
    # A runs on its core (2 groups); a core group straggles at t=10 and is replaced at t=15; the VM
    # pool is reclaimed at t=40. Before issue 34's fix the replacement went to a VM and the reclaim
    # drained it: A ran on 1 group from t=38 until a grow brought it back.
    doc = copy.deepcopy(CORE_STRAGGLER)
    doc["pools"][0]["nodes"] = bm_nodes
    result = simulate(parse_trace(doc), ElasticPolicy())
    assert result.jobs[0].below_min_minutes == 0
    assert (result.reclaims_met, result.groups_killed) == (1, 0)
    moves = [(t, text.split(":")[0]) for t, text in result.decisions if " move " in text]
    if bm_nodes == 3:  # a bare-metal node is free: the replacement goes there
        assert moves == [(15.0, "A move A-r1 -> bm")]
    else:  # bare metal is full: the replacement goes to a VM, and the reclaim moves it back to bare metal
        assert moves == [(15.0, "A move A-r1 -> vm"), (38.0, "A move A-r3 -> bm")]
