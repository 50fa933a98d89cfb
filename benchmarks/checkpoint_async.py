"""How long a checkpoint save blocks training: synchronous vs asynchronous.

    .venv/bin/python benchmarks/checkpoint_async.py [--hidden 1024 --layers 8 --steps 13 --interval 4] [--quick]

Runs the same GPT (about 135M parameters with the defaults: ~1.6 GB of model
+ Adam state in fp32) twice in one process each, side by side in one
invocation: once with ``checkpoint.async_save=false`` (training waits for the
whole save) and once with the default async save (training waits for the
state dict, megatron's planning and the host copy only). Each run saves every
``--interval`` steps; the per-save numbers come from the run's
``checkpoints.jsonl``. Prints one table, the ratio async blocking / sync save
time, and the async blocking time of each save split into its phases (wait
for the previous save's write, state dict, save split, host copy, planning).
``--quick``: hidden 64, 2 layers, vocab 1024, 3 steps, a save every step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from _quick import add_quick_flag, apply_quick  # noqa: E402

QUICK = {"hidden": 64, "layers": 2, "vocab": 1024, "steps": 3, "interval": 1}
PHASES = ("wait", "state_dict", "split", "host_copy", "plan")


def run(mode: str, root: Path, args) -> list[dict]:
    out = root / mode
    cmd = [
        sys.executable, "-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml",
        f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "model.num_attention_heads=16",
        f"model.vocab_size={args.vocab}", "model.seq_length=128", "train.global_batch_size=1",
        "train.micro_batch_size=1",
        f"train.steps={args.steps}", f"logging.output_dir={out}", "logging.tensorboard=false",
        "logging.progress_bar=false", f"checkpoint.dir={out / 'ckpt'}", f"checkpoint.interval={args.interval}",
        "checkpoint.save_at_end=false", f"checkpoint.async_save={'true' if mode == 'async' else 'false'}",
        "checkpoint.keep_last=1",
    ]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if res.returncode:
        sys.exit(f"the {mode} run failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    print(f"  {mode}: run took {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return [json.loads(line) for line in (out / "checkpoints.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--interval", type=int, default=4)
    add_quick_flag(parser, QUICK)
    args = apply_quick(parser.parse_args(), QUICK)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        results = {mode: run(mode, Path(tmp), args) for mode in ("sync", "async")}
    load_after = os.getloadavg()[0]
    sync_s = statistics.mean(r["blocking_s"] for r in results["sync"])
    async_block = statistics.mean(r["blocking_s"] for r in results["async"])
    async_total = statistics.mean(r["total_s"] for r in results["async"])
    size_gb = results["sync"][0]["bytes"] / 1e9
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}; load average (1 min) {load_before:.1f} before, {load_after:.1f} after")
    print(f"checkpoint size: {size_gb:.2f} GB; saves per run: {len(results['sync'])}")
    print("| mode | training blocked per save (s) | save complete after (s) |")
    print("|---|---|---|")
    print(f"| sync (baseline) | {sync_s:.2f} | {sync_s:.2f} |")
    print(f"| async | {async_block:.3f} | {async_total:.2f} |")
    print(f"ratio async blocking / sync save: {async_block / sync_s:.3f}")
    own = statistics.mean(r["blocking_s"] - r["phases"].get("wait", 0.0) for r in results["async"])
    print(f"ratio without waiting for the previous save: {own / sync_s:.3f}")
    print("async blocking per save, by phase (s):")
    print("| save | " + " | ".join(PHASES) + " | blocked |")
    print("|---" * (len(PHASES) + 2) + "|")
    for r in results["async"]:
        phases = " | ".join(f"{r['phases'].get(p, 0.0):.3f}" for p in PHASES)
        print(f"| step {r['step']} | {phases} | {r['blocking_s']:.3f} |")


if __name__ == "__main__":
    main()
