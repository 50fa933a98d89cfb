"""Cost of the control plane's per-step command exchange.

    .venv/bin/python benchmarks/control_overhead.py [--iters 2000] [--steps 100] [--quick]

Two measurements, both with 2 processes on gloo/loopback:

1. Micro-benchmark (torchrun, this file with ``--worker``): mean time of
   ``ControlPlane.step_boundary`` (encode, one 41-element float64 all-reduce,
   decode, publish) side by side with bare all-reduces (the same 41 float64;
   1 float32, the cheapest collective there is), and a stand-in step
   (compute + gradient all-reduce) alone, with the pipelined boundary after
   it, and with a blocking 41-float64 all-reduce after it (the design we
   did not keep).
   Rounds alternate between the cases.
2. In situ: the tiny GPT smoke job (DP=2) logs the mean boundary time it
   measured over its real steps; compared with its median step time.

``--quick``: 40 calls per case, 5 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

#: The micro-benchmark's cases alternate in this many rounds.
ROUNDS = 20
QUICK = {"iters": 2 * ROUNDS, "steps": 5}


def worker(iters: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from megascale_omni.config import JobConfig, from_dict
    from megascale_omni.control.exchange import SIZE
    from megascale_omni.control.plane import ControlPlane

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = from_dict(JobConfig, {"logging": {"output_dir": out_dir}})
    plane = ControlPlane(cfg, {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "vpp": None}, sends_metrics=rank == 0)
    record = {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "skipped": False, "tokens": 256,
              "samples": 8, "tokens_per_s": 4000.0, "samples_per_s": 100.0, "step_s": 0.06, "data_s": 0.001,
              "fwd_bwd_s": 0.05, "optimizer_s": 0.005, "microbatches": 2, "loss_tokens": 256}
    one, same_size = torch.zeros(1), torch.zeros(SIZE, dtype=torch.float64)
    a, grads = torch.randn(192, 192), torch.zeros(1 << 16)

    def step() -> None:  # a stand-in training step: local compute, then a gradient all-reduce
        for _ in range(8):
            a.matmul(a)
        dist.all_reduce(grads)

    def step_with_boundary(i: int) -> None:
        step()
        plane.step_boundary(i, record)

    cases = {
        "boundary_us": lambda i: plane.step_boundary(i, record),
        "bare_same_size_us": lambda i: dist.all_reduce(same_size),
        "bare_allreduce_us": lambda i: dist.all_reduce(one),
        "step_us": lambda i: step(),
        "step_with_boundary_us": step_with_boundary,
        # The alternative design: a blocking exchange after every step.
        "step_with_blocking_us": lambda i: (step(), dist.all_reduce(same_size)),
    }
    total = dict.fromkeys(cases, 0.0)
    rounds = ROUNDS
    per_round = iters // rounds
    for r in range(rounds):
        for name, call in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(per_round):
                call(r * per_round + i)
            total[name] += time.perf_counter() - t0
    n = rounds * per_round
    if rank == 0:
        print(json.dumps({"iters": n, **{k: 1e6 * v / n for k, v in total.items()}}))
    plane.close()
    dist.destroy_process_group()


def _run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, check=False)
    if res.returncode:
        sys.exit(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=2000, help=f"calls per case (at least {ROUNDS})")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    if args.iters < ROUNDS:
        p.error(f"--iters must be >= {ROUNDS} (the cases alternate in {ROUNDS} rounds)")
    if args.worker:
        return worker(args.iters, args.worker)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    with tempfile.TemporaryDirectory() as tmp:
        micro = _run([*torchrun, __file__, "--iters", str(args.iters), "--worker", f"{tmp}/micro"], env)
        m = json.loads(micro.stdout.strip().splitlines()[-1])
        smoke = _run(
            [*torchrun, "-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml",
             f"train.steps={args.steps}", f"logging.output_dir={tmp}/smoke", "logging.tensorboard=false",
             "logging.log_interval=1000"],
            env,
        )
        records = [json.loads(line) for line in Path(f"{tmp}/smoke/metrics.jsonl").read_text().splitlines()]
        step_s = statistics.median(r["step_s"] for r in records if "step_s" in r)
        situ = float(re.search(r"exchange ([\d.]+) us per boundary", smoke.stderr).group(1))
    print(f"micro-benchmark, {m['iters']} calls, 2 ranks gloo:")
    print(f"  step_boundary (encode, all-reduce 41 x float64, decode, publish): {m['boundary_us']:.1f} us")
    print(f"  bare all-reduce of the same 41 x float64:                        {m['bare_same_size_us']:.1f} us")
    print(f"  bare all-reduce of 1 x float32 (cheapest collective, baseline):  {m['bare_allreduce_us']:.1f} us")
    print(f"  ratio step_boundary / baseline: {m['boundary_us'] / m['bare_allreduce_us']:.2f}x")
    extra = m["step_with_boundary_us"] - m["step_us"]
    print(f"  stand-in step (8 matmuls 192^2 + 256 KiB all-reduce): {m['step_us']:.1f} us, "
          f"with step_boundary {m['step_with_boundary_us']:.1f} us -> +{extra:.1f} us "
          f"({100 * extra / m['step_us']:.2f}%); with a blocking exchange instead "
          f"{m['step_with_blocking_us']:.1f} us (+{m['step_with_blocking_us'] - m['step_us']:.1f} us)")
    print(f"in situ, tiny GPT DP=2, {args.steps} steps:")
    # In a real loop the boundary collective also absorbs the ranks' skew
    # (waiting for the slower rank), so this is an upper bound on its cost.
    print(f"  boundary {situ:.1f} us (incl. waiting for the slower rank), median step {1e3 * step_s:.1f} ms "
          f"-> {100 * situ * 1e-6 / step_s:.2f}% of a step")


if __name__ == "__main__":
    main()
