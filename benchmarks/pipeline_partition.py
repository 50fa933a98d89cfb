"""Per-stage forward+backward time of a 4-stage LLaVA pipeline on CPU:
measured vs predicted, megatron's uniform split vs the auto partition.

    .venv/bin/python benchmarks/pipeline_partition.py [--steps 8] [--config examples/llava/pp4_vit_heavy.yaml] [--quick]

1. Profiles every component on this machine (tools/profile_layers.py).
2. For ``uniform`` and ``auto`` (planned from that profile) trains ``--steps``
   steps of the real LLaVA task with torchrun on 4 processes (PP=4). Each rank
   adds up the thread CPU time of megatron's ``forward_step`` and
   ``backward_step`` per step (its own compute, excluding pipeline waits and
   p2p; time spent waiting for a core does not count); the first step is
   warm-up. A rank's measured time is its fastest step, like the profile's
   fastest pass: on a shared host interference only adds time.
3. Prints, per pp rank, the predicted and measured milliseconds per
   micro-batch and their difference, and the max/mean imbalance of both.

``--quick``: 2 steps (1 measured), 1 profile pass per component, 400 samples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _quick import add_quick_flag, apply_quick  # noqa: E402

QUICK = {"steps": 2, "repeats": 1, "num_train": 400}


def worker(args: argparse.Namespace, overrides: list[str]) -> None:
    """One torchrun rank: train, timing this rank's forward/backward compute."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules

    from megascale_omni.entry import parse_for_family
    from megascale_omni.training.trainer import Trainer

    cfg, family = parse_for_family("llava", overrides)
    clock = {"seconds": 0.0, "forwards": 0}

    def timed(fn, count: bool):
        def wrapper(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                clock["seconds"] += time.thread_time() - t0
                clock["forwards"] += count
        return wrapper

    # Module globals: the 1F1B schedule looks both up at call time.
    schedules.forward_step = timed(schedules.forward_step, True)
    schedules.backward_step = timed(schedules.backward_step, False)
    trainer = Trainer(cfg, family)
    try:
        trainer.train_one_step()  # warm-up: allocator, first-touch, lazy inits
        per_step, walls = [], []
        for _ in range(args.steps - 1):
            clock.update(seconds=0.0, forwards=0)
            t0 = time.perf_counter()
            trainer.train_one_step()
            walls.append(time.perf_counter() - t0)
            per_step.append(clock["seconds"] / max(clock["forwards"], 1))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, per_step)
        if dist.get_rank() == 0:
            plan = trainer.pipeline_plan
            Path(args.out).write_text(json.dumps({
                "mode": plan.mode, "counts": list(plan.counts), "predicted_s": list(plan.rank_time),
                "predicted_imbalance": plan.imbalance, "measured_s": [min(s) for s in gathered],
                "measured_median_s": [sorted(s)[len(s) // 2] for s in gathered],
                "step_wall_s": sorted(walls)[len(walls) // 2],
            }))
    finally:
        trainer.close()


def imbalance(values: list[float]) -> float:
    return max(values) / (sum(values) / len(values))


def measure(args: argparse.Namespace, work: Path) -> dict:
    """Profile, then train uniform and auto; each run's result JSON by mode."""
    from megascale_omni.demo.llava_shapes import make_shapes_dataset

    data = work / f"shapes-{args.num_train}"
    if not data.exists():
        make_shapes_dataset(data, num_train=args.num_train, num_val=20, seed=11)
    profile = work / "profile.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    common = [f"--config={args.config}", f"data.path={data}", "train.eval_interval=0", "logging.tensorboard=false"]
    subprocess.run([sys.executable, str(REPO / "tools/profile_layers.py"), f"--out={profile}",
                    f"--repeats={args.repeats}", *common], check=True, env=env, cwd=REPO)
    results = {}
    for mode in ("uniform", "auto"):
        out = work / f"{mode}.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
            __file__, "--worker", f"--steps={args.steps}", f"--out={out}", *common,
            "parallel.pp=4", f"parallel.pipeline_partition={mode}", f"parallel.pipeline_profile={profile}",
            f"logging.output_dir={work / mode}", f"train.steps={args.steps}",
        ]
        subprocess.run(cmd, check=True, env=env, cwd=REPO, timeout=1800)
        results[mode] = json.loads(out.read_text())
    return results


def driver(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="pp-bench-") as tmp:
        results = measure(args, Path(args.work_dir or tmp))
    print(f"config {args.config}, PP=4, {args.steps - 1} measured steps; ms per micro-batch (thread CPU time)")
    print(f"{'mode':<8}{'rank':>5}{'layers':>8}{'predicted':>11}{'measured':>10}{'diff':>8}{'median step':>13}")
    for mode, r in results.items():
        for rank, (pred, meas, med) in enumerate(zip(r["predicted_s"], r["measured_s"], r["measured_median_s"])):
            print(f"{mode:<8}{rank:>5}{r['counts'][rank]:>8}{pred * 1e3:>11.1f}{meas * 1e3:>10.1f}"
                  f"{(meas - pred) / pred:>+8.1%}{med * 1e3:>13.1f}")
    print(f"{'mode':<8}{'max/mean predicted':>20}{'max/mean measured':>19}{'step wall s':>13}")
    for mode, r in results.items():
        print(f"{mode:<8}{r['predicted_imbalance']:>20.3f}{imbalance(r['measured_s']):>19.3f}{r['step_wall_s']:>13.2f}")
    u, a = (imbalance(results[m]["measured_s"]) for m in ("uniform", "auto"))
    slowest = max(results["uniform"]["measured_s"]) / max(results["auto"]["measured_s"])
    print(f"measured slowest stage: uniform / auto = {slowest:.2f}x; imbalance {u:.3f} -> {a:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/llava/pp4_vit_heavy.yaml")
    p.add_argument("--steps", type=int, default=8, help="steps per run, the first one warm-up")
    p.add_argument("--work-dir", default=None, help="dataset, profile and results (default: a temporary directory)")
    p.add_argument("--num-train", type=int, default=2000, help="training samples of the generated shapes dataset")
    p.add_argument("--repeats", type=int, default=7, help="timed passes per component in the profile (fastest counts)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    add_quick_flag(p, QUICK)
    args, rest = p.parse_known_args()
    apply_quick(args, QUICK)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is warm-up)")
    if rest and not args.worker:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.worker:
        worker(args, [f"--config={args.config}", *rest])
    else:
        driver(args)


if __name__ == "__main__":
    main()
