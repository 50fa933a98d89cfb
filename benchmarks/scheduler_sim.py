"""Elastic scheduling policy vs static peak allocation, greedy goodput and a Pollux-like policy.

    .venv/bin/python benchmarks/scheduler_sim.py [--seeds 5] [--workload-seeds 5] [--gpus 32 16] [--quick]

Part 1, the shipped traces (``examples/scheduler/two_jobs.yaml`` and
``diurnal_vm.yaml``) with each policy: without noise, with +-20% noise on
every job's demand for ``--seeds`` seeds (the same draws for every policy),
and once more under GPU-like move costs (``CostModel()``: 112 GB of state
per group healed at 12.5 GB/s, 150 s start-up, 5 s steps). Prints the
side-by-side tables, the worst moves-per-hour ratio elastic / greedy over
the seeds and the reclaim deadlines met.

Part 2, generated queued workloads (``megascale_omni/scheduler/workload.py``:
Pollux's construction from the Philly trace, ``--jobs`` jobs arriving over 8
hours on each of ``--gpus`` cluster sizes, GPU-like costs) for
``--workload-seeds`` seeds, with +-20% demand noise: per seed the table, each
policy's makespan against the bound no schedule can beat, elastic's win /
tie / loss against each baseline on mean JCT and cluster utilisation, and
the means over the seeds.
``--quick``: 1 seed, the first 300 minutes of each trace, a 20-job workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.scheduler.baselines import make_policy  # noqa: E402
from megascale_omni.scheduler.cli import POLICY_NAMES  # noqa: E402
from megascale_omni.scheduler.model import CostModel  # noqa: E402
from megascale_omni.scheduler.policy import Knobs  # noqa: E402
from megascale_omni.scheduler.report import table  # noqa: E402
from megascale_omni.scheduler.simulator import simulate  # noqa: E402
from megascale_omni.scheduler.trace import load_trace  # noqa: E402
from megascale_omni.scheduler.workload import WorkloadSpec, generate_trace  # noqa: E402

TRACES = ("examples/scheduler/two_jobs.yaml", "examples/scheduler/diurnal_vm.yaml")
QUICK = {"seeds": 1, "horizon_min": 300.0, "workload_seeds": 1, "jobs": 20, "gpus": 16}


def run_all(trace, noise: float, seed: int):
    """Every policy on ``trace`` (elastic with the trace's knobs), in POLICY_NAMES order."""
    knobs = Knobs.from_dict(trace.policy)
    return [simulate(trace, make_policy(name, trace, knobs), noise=noise, seed=seed) for name in POLICY_NAMES]


def shipped(args) -> None:
    for path in TRACES:
        trace = load_trace(REPO / path)
        if args.horizon_min:
            trace.horizon_min = min(trace.horizon_min, args.horizon_min)
        print(f"trace {trace.name}, noise 0:")
        print(table(run_all(trace, 0.0, 0)))
        ratios, util, met, events = [], [], 0, 0
        for seed in range(1, args.seeds + 1):
            results = run_all(trace, args.noise, seed)
            elastic, greedy = results[0], results[2]
            if seed == 1:
                print(f"trace {trace.name}, noise +-{args.noise:g}, seed 1:")
                print(table(results))
            ratios.append(elastic.moves_per_hour / greedy.moves_per_hour if greedy.moves_per_hour else 0.0)
            util.append(elastic.utilisation)
            met += elastic.reclaims_met
            events += elastic.reclaim_events
        print(f"moves/hour ratio elastic / greedy at noise {args.noise:g}: {max(ratios):.3f} "
              f"(worst of {args.seeds} seeds)")
        print(f"elastic held utilisation at noise {args.noise:g}: min {min(util):.3f} over {args.seeds} seeds")
        print(f"reclaim deadlines met (elastic, noisy runs): {met}/{events}")
        gpu = dataclasses.replace(trace, costs=CostModel().costs())
        print(f"trace {trace.name}, noise +-{args.noise:g}, seed 1, GPU-like costs (CostModel defaults):")
        print(table(run_all(gpu, args.noise, 1)))
        print()


def makespan_bound_min(trace) -> float:
    """No schedule ends before every job has arrived and run alone at its
    largest size, nor before the cluster has done all the work at each
    job's best samples/s per GPU: the larger of the two, in minutes."""
    alone = max(j.arrive_min + j.work_samples / j.curve(j.max_replicas) / 60 for j in trace.jobs)
    gpus = sum(p.nodes * p.gpus_per_node for p in trace.pools)
    work = sum(j.work_samples / j.curve.best_per_replica * j.replica_gpus for j in trace.jobs) / gpus / 60
    return max(alone, min(j.arrive_min for j in trace.jobs) + work)


def verdict(mine: float, theirs: float, lower_is_better: bool) -> str:
    """'win', 'tie' (equal to 3 significant digits) or 'loss' for elastic's ``mine`` against ``theirs``."""
    if f"{mine:.3g}" == f"{theirs:.3g}":
        return "tie"
    return "win" if (mine < theirs) == lower_is_better else "loss"


def workloads(args) -> None:
    for gpus in args.gpus if isinstance(args.gpus, list) else [args.gpus]:
        spec = WorkloadSpec(jobs=args.jobs, gpus=gpus, window_min=480.0)
        print(f"generated workloads: {spec.jobs} jobs over {spec.window_min:g} min on {spec.gpus} GPUs, "
              f"costs {spec.cost_model}")
        sums: dict[str, list[float]] = {name: [0.0] * 4 for name in POLICY_NAMES}
        goal = []
        for seed in range(1, args.workload_seeds + 1):
            trace = generate_trace(spec, seed)
            print(f"workload {trace.name}, noise +-{args.noise:g}:")
            results = run_all(trace, args.noise, 1)
            print(table(results))
            bound = makespan_bound_min(trace)
            print("makespan (h): " + ", ".join(f"{r.policy} {r.end_min / 60:.2f}" for r in results)
                  + f"; no schedule ends before {bound / 60:.2f}")
            jct = {r.policy: sum(r.jct_min()) / len(r.jobs) for r in results}
            util = {r.policy: r.cluster_utilisation for r in results}
            for r in results:
                for k, value in enumerate((jct[r.policy], sum(r.queue_min()) / len(r.jobs),
                                           util[r.policy], r.moves_per_hour)):
                    sums[r.policy][k] += value / args.workload_seeds
            row = []
            for base in POLICY_NAMES[1:]:
                row.append(f"JCT {verdict(jct['elastic'], jct[base], True)} "
                           f"({jct['elastic'] / jct[base] - 1:+.1%}), cluster util. "
                           f"{verdict(util['elastic'], util[base], False)} ({util['elastic'] - util[base]:+.3f})")
            goal.append(f"| {seed} | " + " | ".join(row) + " |")
        print(f"elastic against each baseline, {spec.gpus} GPUs (JCT: relative; cluster util.: difference):")
        print("| seed | " + " | ".join(POLICY_NAMES[1:]) + " |")
        print("|---" * len(POLICY_NAMES) + "|")
        print("\n".join(goal))
        print(f"mean over {args.workload_seeds} workload seeds:")
        print("| policy | mean JCT (h) | mean queue (h) | cluster util. | moves/hour |")
        print("|---|---|---|---|---|")
        for name, (jct_h, queue, util_, moves) in sums.items():
            print(f"| {name} | {jct_h / 60:.3f} | {queue / 60:.3f} | {util_:.4f} | {moves:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="noisy runs per shipped trace (seeds 1..N)")
    p.add_argument("--noise", type=float, default=0.2, help="demand noise of the noisy runs (+-fraction)")
    p.add_argument("--horizon-min", type=float, default=None, help="cut every shipped trace at this many minutes")
    p.add_argument("--workload-seeds", type=int, default=5, help="generated workloads (seeds 1..N)")
    p.add_argument("--jobs", type=int, default=160, help="jobs per generated workload")
    p.add_argument("--gpus", type=int, nargs="+", default=[32, 16],
                   help="GPUs of the generated workloads' cluster; several: one set of workloads each")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    start = time.perf_counter()
    shipped(args)
    workloads(args)
    print(f"wall {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
