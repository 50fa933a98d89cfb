"""Join latency of an elastic replica group vs a full torchrun restart + checkpoint reload.

    .venv/bin/python benchmarks/elastic_join.py [--steps 200] [--join-after 10]

Side by side, on the tiny GPT of examples/elastic/gpt_pp2.yaml (TP1 x PP2):

- join: a lighthouse and replica group r0 train; after r0 committed
  ``--join-after`` steps, replica group r1 is launched. Join latency = r1's
  launch -> r1's first committed step (healed from r0 over HTTP, no disk).
  Survivor disruption = the extra time of r0's slowest step while r1 joined,
  over r0's median step time before the join, in units of that median.
- restart baseline: the same job without elasticity, checkpointing every
  step; it is killed after ``--join-after`` steps and relaunched with
  torchrun. Restart latency = relaunch -> first committed step after
  resuming from the checkpoint. Every replica stops for all of it.

Times are wall-clock seconds observed by polling metrics.jsonl every 20 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.dist.elastic_helpers import CONFIG, start_lighthouse, start_replica, step_records  # noqa: E402
from tests.launcher import _kill_group, finish, spawn, torchrun_cmd  # noqa: E402

COMMON = ["train.lr_decay_style=constant", "logging.progress_bar=false", "logging.tensorboard=false"]


def _wait(predicate, timeout: float, procs=()) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step timed out")
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} exited {p.returncode}: {finish(p, 1).stderr[-2000:]}")
        time.sleep(0.02)
    return time.monotonic()


def measure_join(work: Path, steps: int, join_after: int) -> dict:
    run = work / "join"
    lighthouse, addr = start_lighthouse(timeout=1200)
    r0 = r1 = lighthouse
    args = [f"train.steps={steps}", *COMMON]
    try:
        r0 = start_replica("r0", addr, run, args, timeout=1200)
        _wait(lambda: len(step_records(run / "r0")) >= join_after, 600, [r0])
        launched = time.monotonic()
        before = len(step_records(run / "r0"))
        r1 = start_replica("r1", addr, run, args, timeout=1200)
        first = _wait(lambda: len(step_records(run / "r1")) >= 1, 600, [r0, r1])
        during = len(step_records(run / "r0"))
        _wait(lambda: len(step_records(run / "r0")) >= during + 3, 600, [r0, r1])
    finally:
        for p in (r0, r1, lighthouse):
            _kill_group(p)
    recs = step_records(run / "r0")
    pre = [r["step_s"] for r in recs[2:before]]  # skip warm-up steps
    median = statistics.median(pre)
    window = [r["step_s"] for r in recs[before - 1 : during + 1]]
    joined = next(r for r in recs if r["participants"] == 2)
    return {
        "join_latency_s": first - launched,
        "survivor_median_step_s": median,
        "survivor_worst_step_during_join_s": max(window),
        "survivor_lost_steps": (max(window) - median) / median,
        "joined_at_step": joined["step"],
        "join_step_s": joined["step_s"],
    }


def measure_restart(work: Path, steps: int, kill_after: int) -> dict:
    out = work / "restart"
    args = ["--config", CONFIG, "elastic.enabled=false", f"train.steps={steps}", *COMMON,
            f"logging.output_dir={out}", f"checkpoint.dir={out / 'ckpt'}", "checkpoint.interval=1",
            "checkpoint.async_save=false"]
    first = spawn(torchrun_cmd(2, "megascale_omni.smoke", args), timeout=1200)
    _wait(lambda: len(step_records(out)) >= kill_after + 1, 600, [first])
    _kill_group(first)
    done = len(step_records(out))
    relaunched = time.monotonic()
    second = spawn(torchrun_cmd(2, "megascale_omni.smoke", args), timeout=1200)
    try:
        resumed = _wait(lambda: len(step_records(out)) > done, 600, [second])
    finally:
        _kill_group(second)
    return {"restart_latency_s": resumed - relaunched}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="steps of the elastic run (must outlast the join)")
    p.add_argument("--join-after", type=int, default=10, help="r0's committed steps before r1 is launched")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        join = measure_join(work, args.steps, args.join_after)
        restart = measure_restart(work, args.steps, args.join_after)
    result = {**join, **restart, "join_over_restart": join["join_latency_s"] / restart["restart_latency_s"]}
    print(json.dumps(result, indent=2))
    print(f"join latency {join['join_latency_s']:.1f} s vs restart+reload {restart['restart_latency_s']:.1f} s "
          f"(ratio {result['join_over_restart']:.2f}); survivors lost {join['survivor_lost_steps']:.2f} step times "
          f"during the join (restart: everyone stops for {restart['restart_latency_s']:.1f} s = "
          f"{restart['restart_latency_s'] / join['survivor_median_step_s']:.0f} step times)")


if __name__ == "__main__":
    main()
