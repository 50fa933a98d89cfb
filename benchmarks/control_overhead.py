"""Cost of the per-step boundary exchanges: control commands and metrics.

    .venv/bin/python benchmarks/control_overhead.py [--iters 2000] [--steps 100] [--quick]

Two measurements, both with 2 processes on gloo/loopback:

1. Micro-benchmark (torchrun, this file with ``--worker``), before and after
   the metrics got their own exchange, side by side: *before*, one pipelined
   all-reduce of one vector carrying commands, the loss rank's record and
   the rank rows (as ``control/exchange.py`` did until 2026-12-01); *after*,
   two pipelined all-reduces, the command vector
   (:class:`~megascale_omni.control.exchange.BoundaryExchange`) and the
   metrics vector (:class:`~megascale_omni.metrics.exchange.MetricsExchange`).
   Each alone in a tight loop, after a stand-in step (compute + gradient
   all-reduce), and the full boundary as the Trainer runs it (metrics
   exchange + ``ControlPlane.step_boundary``), against a bare 1 x float32
   all-reduce (the cheapest collective there is) and a blocking exchange
   (the design we did not keep). Rounds alternate between the cases.
2. In situ: the tiny GPT smoke job (DP=2) records ``control_s`` (both
   exchanges) in every step record, and logs the control exchange alone;
   compared with its median step time.

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
    from megascale_omni.control import exchange as control_exchange
    from megascale_omni.control.commands import Op
    from megascale_omni.control.plane import ControlPlane
    from megascale_omni.metrics import exchange as metrics_exchange
    from megascale_omni.metrics.schema import RANK_FIELDS

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = from_dict(JobConfig, {"logging": {"output_dir": out_dir}})
    group_exchange = metrics_exchange.MetricsExchange.for_replica_group(sends_record=rank == 0)
    plane = ControlPlane(cfg, {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "vpp": None})
    commands = control_exchange.BoundaryExchange(dist.new_group(backend="gloo"), world, sends_ops=rank == 0)
    metrics = metrics_exchange.MetricsExchange.for_replica_group(sends_record=rank == 0)
    before = _OneVector(dist.new_group(backend="gloo"), world, rank, control_exchange, metrics_exchange)
    record = {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "skipped": False, "tokens": 256,
              "samples": 8, "tokens_per_s": 4000.0, "samples_per_s": 100.0, "step_s": 0.06, "data_s": 0.001,
              "fwd_bwd_s": 0.05, "optimizer_s": 0.005, "microbatches": 2, "loss_tokens": 256}
    row = [0.01 * (i + 1) for i in range(len(RANK_FIELDS))]
    ops = [Op("config_set", "logging.log_interval", 10.0)] if rank == 0 else []
    one = torch.zeros(1)
    blocking = torch.zeros(before.size, dtype=torch.float64)
    a, grads = torch.randn(192, 192), torch.zeros(1 << 16)

    def step() -> None:  # a stand-in training step: local compute, then a gradient all-reduce
        for _ in range(8):
            a.matmul(a)
        dist.all_reduce(grads)

    def boundary(i: int) -> None:  # what the Trainer runs at a step boundary
        plane.step_boundary(i, group_exchange(i, record, row))

    cases = {
        "before_us": lambda i: before(ops, record, i, row),
        "after_us": lambda i: (commands(ops), metrics(i, record, row)),
        "boundary_us": boundary,
        "bare_allreduce_us": lambda i: dist.all_reduce(one),
        "step_us": lambda i: step(),
        "step_before_us": lambda i: (step(), before(ops, record, i, row)),
        "step_after_us": lambda i: (step(), commands(ops), metrics(i, record, row)),
        # The alternative design: a blocking exchange after every step.
        "step_with_blocking_us": lambda i: (step(), dist.all_reduce(blocking)),
    }
    total = dict.fromkeys(cases, 0.0)
    rounds = ROUNDS
    per_round = iters // rounds
    for r in range(rounds):
        for name, call in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(per_round):
                call(r * per_round + i + 1)
            total[name] += time.perf_counter() - t0
    n = rounds * per_round
    if rank == 0:
        sizes = {"before_slots": before.size, "control_slots": control_exchange.SIZE,
                 "metrics_slots": metrics_exchange.vector_size(world)}
        print(json.dumps({"iters": n, **sizes, **{k: 1e6 * v / n for k, v in total.items()}}))
    before.wait()
    commands.flush(30.0)
    metrics.close()
    plane.close()
    group_exchange.close()
    dist.destroy_process_group()


class _OneVector:
    """The boundary exchange before 2026-12-01, rebuilt from today's encoders
    for the side-by-side measurement: commands, the loss rank's record and
    the rank rows in one vector, one pipelined SUM all-reduce, decoded a
    boundary later."""

    def __init__(self, group, world: int, rank: int, control_exchange, metrics_exchange):
        self.group, self.world, self.rank = group, world, rank
        self.control, self.metrics = control_exchange, metrics_exchange
        self.size = control_exchange.SIZE + metrics_exchange.vector_size(world)
        self.inflight = None

    def __call__(self, ops, record, step, row):
        import torch
        import torch.distributed as dist

        commands = [0.0] * self.control.SIZE
        metrics = [0.0] * self.metrics.vector_size(self.world)
        if self.rank == 0:
            self.control.encode_ops(commands, ops)
            self.metrics.encode_record(metrics, record)
        self.metrics.encode_rank_row(metrics, self.rank, step, row)
        buf = torch.tensor(commands + metrics, dtype=torch.float64)
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        self.wait()
        self.inflight = (work, buf)

    def wait(self):
        if self.inflight is None:
            return
        work, buf = self.inflight
        work.wait()
        values = buf.tolist()
        self.control.decode_ops(values[:self.control.SIZE])
        self.metrics.decode_record(values[self.control.SIZE:])
        self.metrics.decode_rank_rows(values[self.control.SIZE:], self.world)
        self.inflight = None


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
        boundary_s = statistics.median(r["control_s"] for r in records[1:] if "control_s" in r)
        control_us = float(re.search(r"exchange ([\d.]+) us per boundary", smoke.stderr).group(1))
    base = m["bare_allreduce_us"]
    print(f"micro-benchmark, {m['iters']} calls, 2 ranks gloo (means per call):")
    print(f"  before: one exchange, {m['before_slots']} x float64 (commands + record + rank rows): "
          f"{m['before_us']:.1f} us")
    print(f"  after: two exchanges, {m['control_slots']} + {m['metrics_slots']} x float64 (commands; record + "
          f"rank rows): {m['after_us']:.1f} us")
    print(f"  ratio after / before: {m['after_us'] / m['before_us']:.2f}x")
    print(f"  boundary as the Trainer runs it (metrics exchange + ControlPlane.step_boundary): "
          f"{m['boundary_us']:.1f} us")
    print(f"  bare all-reduce of 1 x float32 (cheapest collective, baseline): {base:.1f} us; "
          f"ratio boundary / baseline: {m['boundary_us'] / base:.2f}x")
    plus_before, plus_after = m["step_before_us"] - m["step_us"], m["step_after_us"] - m["step_us"]
    print(f"  stand-in step (8 matmuls 192^2 + 256 KiB all-reduce): {m['step_us']:.1f} us; "
          f"+ before {m['step_before_us']:.1f} us (+{plus_before:.1f} us), "
          f"+ after {m['step_after_us']:.1f} us (+{plus_after:.1f} us); "
          f"with a blocking exchange instead {m['step_with_blocking_us']:.1f} us "
          f"(+{m['step_with_blocking_us'] - m['step_us']:.1f} us)")
    print(f"in situ, tiny GPT DP=2, {args.steps} steps:")
    # In a real loop the boundary collectives also absorb the ranks' skew
    # (waiting for the slower rank), so this is an upper bound on their cost.
    print(f"  boundary {1e6 * boundary_s:.1f} us (control_s, median; control exchange alone {control_us:.1f} us "
          f"mean; incl. waiting for the slower rank), median step {1e3 * step_s:.1f} ms "
          f"-> {100 * boundary_s / step_s:.2f}% of a step")

if __name__ == "__main__":
    main()
