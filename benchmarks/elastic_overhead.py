"""Step time of one elastic replica group vs the same job without elastic.

    .venv/bin/python benchmarks/elastic_overhead.py [--steps 60] [--rounds 3] [--quick]

The job is examples/elastic/gpt_pp2.yaml (tiny GPT, TP1 x PP2, 2 processes).
Each round runs it four times, back to back: non-elastic
(``elastic.enabled=false``), and elastic with one replica group and its own
lighthouse (``elastic.min_replicas=1``; what a job that may grow pays while
it does not) in three settings: the quorum awaited before the step and
torchft's commit vote every step (``overlap_quorum=false lone_commit=false``),
the quorum overlapped (``overlap_quorum=true lone_commit=false``), and the
defaults (``overlap_quorum=true lone_commit=true``: a group alone in an
unchanged quorum also commits without the vote). The order rotates between
rounds so drift on a noisy host hits every side. Per run: the median
``step_s`` over the steps after the first ``--warmup``, and for elastic the
median ``quorum_s`` (blocked waiting for the lighthouse's quorum) and
``cross_replica_s`` (that wait, the sums, the commit). Reported: each
round's ratios elastic / non-elastic and their medians, then where the step
time goes on each side: the median of every breakdown field of the step
record (metrics/record.py) over all rounds, side by side.

``--quick``: 8 steps, 1 round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.metrics.record import BREAKDOWN  # noqa: E402
from tests.dist.elastic_helpers import CONFIG, start_lighthouse, start_replica, step_records  # noqa: E402
from tests.launcher import finish, kill_group, spawn, torchrun_cmd  # noqa: E402

QUICK = {"steps": 8, "rounds": 1, "warmup": 2}
TIMEOUT_S = 900


def _common(steps: int) -> list[str]:
    return [f"train.steps={steps}", "train.lr_decay_style=constant", "logging.progress_bar=false",
            "logging.log_interval=1000", "checkpoint.save_at_end=false"]


def _check(proc, what: str) -> None:
    res = finish(proc, TIMEOUT_S)
    if res.returncode != 0:
        raise RuntimeError(f"{what} exited {res.returncode}: {res.stderr[-3000:]}")


def run_static(out: Path, steps: int) -> list[dict]:
    proc = spawn(torchrun_cmd(2, "megascale_omni.smoke", [
        "--config", CONFIG, "elastic.enabled=false", *_common(steps), f"logging.output_dir={out}",
    ]), timeout=TIMEOUT_S)
    _check(proc, "the non-elastic job")
    return step_records(out)


#: Elastic settings compared with the non-elastic run: (label, overrides).
ELASTIC = {
    "vote": ("quorum awaited, vote", ["elastic.overlap_quorum=false", "elastic.lone_commit=false"]),
    "overlap": ("quorum overlapped, vote", ["elastic.overlap_quorum=true", "elastic.lone_commit=false"]),
    "lone": ("overlapped, lone commit", ["elastic.overlap_quorum=true", "elastic.lone_commit=true"]),
}


def run_elastic(out: Path, steps: int, overrides: list[str]) -> list[dict]:
    lighthouse, addr = start_lighthouse(timeout=TIMEOUT_S)
    try:
        proc = start_replica("r0", addr, out, [*_common(steps), "elastic.min_replicas=1", *overrides],
                             timeout=TIMEOUT_S)
        _check(proc, "the elastic group")
    finally:
        kill_group(lighthouse)
    return step_records(out / "r0")


def _median(records: list[dict], key: str, warmup: int) -> float:
    return statistics.median(r[key] for r in records[warmup:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(argv), QUICK)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    sides = ("static", *ELASTIC)
    ratios: dict[str, list[float]] = {side: [] for side in ELASTIC}
    steps: dict[str, list[dict]] = {side: [] for side in sides}
    print(f"{'round':>5} {'static ms':>10} | " + " | ".join(
        f"{side + ' ms':>10} {'quorum':>7} {'x-repl':>7} {'ratio':>6}" for side in ELASTIC))
    with tempfile.TemporaryDirectory(prefix="elastic-overhead-") as tmp:
        for k in range(args.rounds):
            records = {}
            for side in sides[k % len(sides):] + sides[:k % len(sides)]:
                out = Path(tmp) / f"{side}{k}"
                records[side] = (run_static(out, args.steps) if side == "static"
                                 else run_elastic(out, args.steps, ELASTIC[side][1]))
            for side in sides:
                steps[side].extend(records[side][args.warmup:])
            static = _median(records["static"], "step_s", args.warmup)
            cells = []
            for side in ELASTIC:
                step = _median(records[side], "step_s", args.warmup)
                ratios[side].append(step / static)
                cells.append(f"{step * 1e3:>10.2f} {_median(records[side], 'quorum_s', args.warmup) * 1e3:>7.2f} "
                             f"{_median(records[side], 'cross_replica_s', args.warmup) * 1e3:>7.2f} "
                             f"{ratios[side][-1]:>6.3f}")
            print(f"{k:>5} {static * 1e3:>10.2f} | " + " | ".join(cells))
    for side, (label, _) in ELASTIC.items():
        r = ratios[side]
        print(f"elastic ({label}) / non-elastic, median over {args.rounds} rounds: {statistics.median(r):.3f} "
              f"(min {min(r):.3f}, max {max(r):.3f})")
    print(f"\nmedian ms per step over all rounds\n{'':>16}" + "".join(f"{side:>10}" for side in sides))
    for key in ("step_s", *BREAKDOWN, "other_s"):
        print(f"{key:>16}" + "".join(f"{statistics.median(r.get(key, 0.0) for r in steps[side]) * 1e3:>10.3f}"
                                     for side in sides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
