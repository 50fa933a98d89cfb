"""Elastic scheduling policy vs static peak allocation vs greedy goodput, on the shipped traces.

    .venv/bin/python benchmarks/scheduler_sim.py [--seeds 5] [--quick]

Runs ``examples/scheduler/two_jobs.yaml`` and ``diurnal_vm.yaml`` through the
trace simulator with each policy: once without noise, then with +-20% noise
on every job's demand for ``--seeds`` seeds (the same draws for every
policy). Prints the side-by-side tables, the worst moves-per-hour ratio
elastic / greedy over the seeds and the reclaim deadlines met.
``--quick``: 1 seed, the first 300 minutes of each trace.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.scheduler.baselines import GreedyGoodputPolicy, StaticPolicy  # noqa: E402
from megascale_omni.scheduler.policy import ElasticPolicy, Knobs  # noqa: E402
from megascale_omni.scheduler.report import table  # noqa: E402
from megascale_omni.scheduler.simulator import simulate  # noqa: E402
from megascale_omni.scheduler.trace import load_trace  # noqa: E402

TRACES = ("examples/scheduler/two_jobs.yaml", "examples/scheduler/diurnal_vm.yaml")
QUICK = {"seeds": 1, "horizon_min": 300.0}


def run_all(trace, noise: float, seed: int):
    policies = (ElasticPolicy(Knobs.from_dict(trace.policy)), StaticPolicy(), GreedyGoodputPolicy())
    return [simulate(trace, p, noise=noise, seed=seed) for p in policies]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="noisy runs per trace (seeds 1..N)")
    p.add_argument("--noise", type=float, default=0.2, help="demand noise of the noisy runs (+-fraction)")
    p.add_argument("--horizon-min", type=float, default=None, help="cut every trace at this many minutes")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    start = time.perf_counter()
    for path in TRACES:
        trace = load_trace(REPO / path)
        if args.horizon_min:
            trace.horizon_min = min(trace.horizon_min, args.horizon_min)
        print(f"trace {trace.name}, noise 0:")
        print(table(run_all(trace, 0.0, 0)))
        ratios, util, met, events = [], [], 0, 0
        for seed in range(1, args.seeds + 1):
            elastic, static, greedy = run_all(trace, args.noise, seed)
            if seed == 1:
                print(f"trace {trace.name}, noise +-{args.noise:g}, seed 1:")
                print(table([elastic, static, greedy]))
            ratios.append(elastic.moves_per_hour / greedy.moves_per_hour if greedy.moves_per_hour else 0.0)
            util.append(elastic.utilisation)
            met += elastic.reclaims_met
            events += elastic.reclaim_events
        print(f"moves/hour ratio elastic / greedy at noise {args.noise:g}: {max(ratios):.3f} "
              f"(worst of {args.seeds} seeds)")
        print(f"elastic utilisation at noise {args.noise:g}: min {min(util):.3f} over {args.seeds} seeds")
        print(f"reclaim deadlines met (elastic, noisy runs): {met}/{events}")
        print()
    print(f"wall {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
