"""MoE routing on CPU: alltoall vs allgather token dispatcher at EP2, and
expert load over a run without balancing, with the auxiliary loss and with
the aux-loss-free expert bias.

    .venv/bin/python benchmarks/moe_routing.py [--steps 300] [--dispatch-steps 40] [--repeats 2] [--quick]

Every run is ``python -m megascale_omni.smoke`` on ``examples/gpt/tiny_moe.yaml``
(4 layers, hidden 64, 4 experts of width 128, top-2, fp32, dropless), one
torch thread per process; the numbers come from each run's
``metrics.jsonl`` (docs/moe.md, the step record).

1. Dispatcher: ``parallel.ep=2`` (2 processes, gloo), ``moe.token_dispatcher``
   ``alltoall`` then ``allgather``, repeated ``--repeats`` times in turn
   (ABAB: both see the same machine load); per run the median ``step_s`` and
   ``moe_dispatch_s`` (the dispatchers' exchanges, forward and backward)
   over the steps after the first 5. Baseline: alltoall, megatron's default.
2. Balance: one process, ``--steps`` steps at ``--global-batch`` sequences of
   32 tokens, router z-loss off, four routers: softmax without balancing
   (baseline), softmax with the auxiliary loss (``--aux-coeff``), sigmoid
   without balancing (the bias run's baseline) and sigmoid with the
   aux-loss-free bias (``--bias-rate`` per step). Reported: ``moe_load_max``
   (busiest expert / mean, per MoE layer) averaged over the layers, mean
   over the first 10 and the last 30 steps, and the worst layer at the end.
   Same seed and data everywhere.

``--quick``: 6 balance steps, 8 dispatch steps, one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _quick import add_quick_flag, apply_quick  # noqa: E402

QUICK = {"steps": 6, "dispatch_steps": 8, "repeats": 1}
CONFIG = "examples/gpt/tiny_moe.yaml"
COMMON = ["logging.progress_bar=false", "logging.tensorboard=false", "moe.z_loss_coeff=0"]
#: (name, overrides) of the balance runs; the first of each score function is its baseline.
BALANCE = {
    "softmax, no balancing (baseline)": ["moe.load_balancing=none", "moe.aux_loss_coeff=0"],
    "softmax, aux loss": ["moe.load_balancing=aux_loss", "moe.aux_loss_coeff={aux}"],
    "sigmoid, no balancing (baseline)": ["moe.score_function=sigmoid", "moe.load_balancing=none",
                                         "moe.aux_loss_coeff=0"],
    "sigmoid, aux-loss-free bias": ["moe.score_function=sigmoid", "moe.load_balancing=none",
                                    "moe.aux_loss_coeff=0", "moe.expert_bias=true", "moe.bias_update_rate={rate}"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out: Path, overrides: list[str], nproc: int = 1) -> list[dict]:
    """One smoke run; returns its step records."""
    args = ["-m", "megascale_omni.smoke", "--config", CONFIG, *COMMON, f"logging.output_dir={out}", *overrides]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(_free_port()),
                *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode:
        sys.exit(f"run failed ({' '.join(overrides)}):\n{res.stderr[-3000:]}")
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def dispatch(tmp: Path, steps: int, repeats: int) -> None:
    times: dict[str, dict[str, list[float]]] = {d: {"step_s": [], "moe_dispatch_s": []}
                                                 for d in ("alltoall", "allgather")}
    for rep in range(repeats):
        for d in times:
            recs = run(tmp / f"{d}{rep}", ["parallel.ep=2", f"moe.token_dispatcher={d}", f"train.steps={steps}"],
                       nproc=2)[5:] or []
            for key in times[d]:
                times[d][key].append(statistics.median(r[key] for r in recs))
    print(f"dispatcher at EP2 (2 processes, gloo), {steps} steps per run, median over steps 6..{steps}, "
          f"{repeats} run(s) each in turn:")
    print("| dispatcher | step (ms) | dispatch (ms) | dispatch share | step / alltoall |")
    print("|---|---|---|---|---|")
    base = statistics.mean(times["alltoall"]["step_s"])
    for d, t in times.items():
        step, exch = statistics.mean(t["step_s"]), statistics.mean(t["moe_dispatch_s"])
        print(f"| {d} | {1e3 * step:.1f} | {1e3 * exch:.1f} | {exch / step:.3f} | {step / base:.3f} |")


def balance(tmp: Path, steps: int, batch: int, aux: float, rate: float) -> None:
    print(f"expert load max/mean (mean over the 4 MoE layers), 1 process, {steps} steps of {batch} x 32 tokens, "
          f"4 experts top-2, aux coeff {aux}, bias rate {rate}:")
    print("| router | steps 1-10 | last 30 steps | worst layer, last 30 | final loss |")
    print("|---|---|---|---|---|")
    head, tail = min(10, steps), min(30, steps)
    for name, overrides in BALANCE.items():
        recs = run(tmp / name.split(",")[0] / name.split(", ")[1].split()[0],
                   [*(o.format(aux=aux, rate=rate) for o in overrides), f"train.steps={steps}",
                    f"train.global_batch_size={batch}"])
        per_step = [statistics.mean(r["moe_load_max"]) for r in recs]
        worst = max(statistics.mean(r["moe_load_max"][i] for r in recs[-tail:]) for i in range(4))
        print(f"| {name} | {statistics.mean(per_step[:head]):.3f} | {statistics.mean(per_step[-tail:]):.3f} | "
              f"{worst:.3f} | {recs[-1]['loss']:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of each balance run")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step of the balance runs")
    parser.add_argument("--aux-coeff", type=float, default=1e-2, help="moe.aux_loss_coeff of the aux-loss run")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="moe.bias_update_rate of the bias run")
    parser.add_argument("--dispatch-steps", type=int, default=40, help="steps of each dispatcher run")
    parser.add_argument("--repeats", type=int, default=2, help="dispatcher runs of each kind, in turn")
    add_quick_flag(parser, QUICK)
    args = apply_quick(parser.parse_args(), QUICK)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dispatch(Path(tmp), args.dispatch_steps, args.repeats)
        balance(Path(tmp), args.steps, args.global_batch, args.aux_coeff, args.bias_rate)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
