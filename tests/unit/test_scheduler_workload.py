"""Generated many-job workloads (Philly statistics as Pollux used them), the
move-cost model, the Pollux-like baseline, and the four policies side by
side on a queued workload: JCT, queueing, moves, cores kept."""

from __future__ import annotations

import math

import pytest
import yaml

from megascale_omni.scheduler.baselines import PolluxLikePolicy, make_policy
from megascale_omni.scheduler.cli import cli
from megascale_omni.scheduler.model import CostModel, Costs
from megascale_omni.scheduler.policy import Knobs
from megascale_omni.scheduler.simulator import simulate
from megascale_omni.scheduler.trace import load_trace
from megascale_omni.scheduler.workload import (
    PHILLY_CLASSES,
    PHILLY_HOURLY_ARRIVALS,
    WorkloadSpec,
    generate,
    generate_trace,
)

pytestmark = pytest.mark.timeout(120)
QUEUED = WorkloadSpec(jobs=40, gpus=8, window_min=60.0)  # an hour of Philly arrivals on 8 GPUs: queues


def test_generated_jobs_follow_the_philly_figures():
    doc = generate(WorkloadSpec(jobs=4000, gpus=128), seed=7)
    jobs = doc["jobs"]
    for cls in PHILLY_CLASSES:
        mine = [j for j in jobs if j["name"].endswith("-" + cls.name)]
        assert len(mine) / len(jobs) == pytest.approx(cls.share, abs=0.03)  # binomial sd <= 0.007
        sizes = {g for g, _ in cls.gpus}
        hours = []
        for j in mine:
            request = j["replicas"]["max"]
            assert request in sizes and j["replicas"]["min"] == max(1, math.ceil(request / 4))
            rate = j["throughput"][-1][1]
            hours.append(j["work_samples"] / rate / 3600 * request)
            assert cls.gpu_hours[0] * 0.999 <= hours[-1] <= cls.gpu_hours[-1] * 1.001
        if len(mine) > 300:  # each decile splits the draws as it split the trace's jobs (sd <= 0.03)
            for k in (2, 5, 8):
                assert sum(h < cls.gpu_hours[k] for h in hours) / len(hours) == pytest.approx(k / 10, abs=0.08)
    small = [j for j in jobs if j["name"].endswith("-small")]
    assert sum(j["replicas"]["max"] == 1 for j in small) / len(small) == pytest.approx(24063 / 24498, abs=0.02)
    # Arrivals follow the trace's hourly counts over the 8-hour window (07:00, the 6th hour, peaks).
    per_hour = [sum(60 * h <= j["arrive_min"] < 60 * (h + 1) for j in jobs) for h in range(8)]
    total = sum(PHILLY_HOURLY_ARRIVALS)
    for n, weight in zip(per_hour, PHILLY_HOURLY_ARRIVALS):
        assert n / len(jobs) == pytest.approx(weight / total, abs=0.025)
    assert max(range(8), key=per_hour.__getitem__) == 5
    # Every group adds less than the one before (sublinear data-parallel scaling).
    curve = max(jobs, key=lambda j: j["replicas"]["max"])["throughput"]
    per = [y / x for x, y in curve]
    assert all(a > b for a, b in zip(per, per[1:]))


def test_a_request_above_the_cluster_is_capped():
    jobs = generate(WorkloadSpec(jobs=400, gpus=8), seed=2)["jobs"]
    assert max(j["replicas"]["max"] for j in jobs) == 8


def test_generation_is_deterministic_per_seed():
    assert generate(QUEUED, 3) == generate(QUEUED, 3)
    assert generate(QUEUED, 3)["jobs"] != generate(QUEUED, 4)["jobs"]


def test_cost_model_gives_gpu_like_costs():
    c = CostModel().costs()  # 112 GB of state at 12.5 GB/s: 8.96 s to heal
    assert c == Costs(standby_join_s=pytest.approx(13.96), cold_join_s=pytest.approx(163.96), drain_s=5.0,
                      restart_s=pytest.approx(211.0), join_disruption_s=pytest.approx(13.96))
    assert generate_trace(QUEUED, 1).costs == c
    slower = CostModel(state_gb=224.0, heal_gb_per_s=6.25, startup_s=300.0).costs()
    assert slower.cold_join_s == pytest.approx(300 + 35.84 + 5)


def test_pollux_reallocation_factor():
    policy = PolluxLikePolicy(realloc_s=120.0)  # d = 2 min
    policy._admitted["A"] = 0.0
    assert policy.factor("A", 2.0) <= 0  # younger than one reallocation: never worth it
    assert policy.factor("A", 62.0) == pytest.approx((62 - 2) / 64)
    policy._reallocs["A"] = 9
    assert policy.factor("A", 62.0) == pytest.approx((62 - 20) / 64)  # charged for its history


@pytest.fixture(scope="module")
def queued():
    trace = generate_trace(QUEUED, 5)  # 5 of its 40 jobs are elastic (request > 1 GPU)
    return {name: simulate(trace, make_policy(name, trace, Knobs()), noise=0.2, seed=1)
            for name in ("elastic", "static", "greedy", "pollux")}


def test_elastic_cuts_jct_and_queueing_against_static_peak(queued):
    e, s = queued["elastic"], queued["static"]
    assert all(r.unfinished == 0 for r in queued.values())
    mean = {k: sum(r.jct_min()) / len(r.jobs) for k, r in queued.items()}
    queue = {k: sum(r.queue_min()) / len(r.jobs) for k, r in queued.items()}
    assert mean["elastic"] < 0.95 * mean["static"]  # measured 1.67 h vs 2.13 h
    assert queue["elastic"] < 0.5 * queue["static"]  # a core starts before a full peak fits (0.51 h vs 1.17 h)
    # The item 2 goal on this workload: below every baseline's mean JCT (greedy 1.87 h, Pollux-like 1.85 h),
    # cluster utilisation not below any (measured 0.723 vs 0.534, 0.691, 0.721).
    assert all(mean["elastic"] < mean[k] for k in ("static", "greedy", "pollux"))
    assert all(e.cluster_utilisation >= r.cluster_utilisation for r in queued.values())
    assert e.gpu_hours < s.gpu_hours
    for r in queued.values():
        assert r.cluster_utilisation <= r.utilisation <= 1.0
        assert all(j.below_min_minutes == 0 for j in r.jobs)


def test_charging_for_moves_keeps_pollux_and_elastic_off_the_noise(queued):
    greedy = queued["greedy"].moves_per_hour
    assert greedy > 10  # it follows every draw of the +-20% demand noise (measured 17.7/hour)
    assert queued["pollux"].moves_per_hour < greedy / 2
    assert queued["elastic"].moves_per_hour < greedy / 2


def test_generate_command_writes_a_valid_trace(tmp_path, capsys):
    out = tmp_path / "w.yaml"
    with pytest.raises(SystemExit) as e:
        cli(["generate", "--jobs", "12", "--gpus", "16", "--seed", "7", "--out", str(out)])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"wrote {out}: 12 jobs over 480 min on 16 GPUs, seed 7\n"
    trace = load_trace(out)
    assert len(trace.jobs) == 12 and trace.pools[0].nodes == 16
    assert yaml.safe_load(out.read_text())["cost_model"]["state_gb"] == 112.0
    runs = tmp_path / "runs"
    with pytest.raises(SystemExit) as e:
        cli(["simulate", "--trace", str(out), "--policy", "elastic", "--out", str(runs)])
    assert e.value.code == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert "completion (h)" not in header  # 12 jobs: no per-job columns
    plot = (runs / trace.name / "elastic" / "allocation.png").read_bytes()  # one panel: all jobs summed
    assert plot[:8] == b"\x89PNG\r\n\x1a\n" and 5000 < len(plot) < 200_000
    with pytest.raises(SystemExit) as e:
        cli(["generate", "--gpus", "0", "--out", str(out)])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("omni-sched: config error: --gpus=0: must be >= 1 (a larger request is "
                                       "capped at the cluster)\n")
