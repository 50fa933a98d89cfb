"""Cost of collecting the step metrics, as a share of the step it measures.

    .venv/bin/python benchmarks/metrics_overhead.py [--steps 300] [--quick]

Every step record carries ``metrics_s``: the time the previous record took
to build (breakdown, throughput, FLOPs/MFU, memory), to gather (the
straggler all-gather over the replica group) and to export (JSONL,
TensorBoard, the Prometheus endpoint, the log line). It is part of
``step_s``, so ``metrics_s / step_s`` measured in the same run, step by
step, is the overhead. Two layouts of the tiny GPT (2 processes, gloo):
DP2 and PP2, with TensorBoard and the Prometheus endpoint on.

``--quick``: 8 steps.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _quick import add_quick_flag, apply_quick  # noqa: E402

QUICK = {"steps": 8}
LAYOUTS = {"DP2": [], "PP2": ["parallel.pp=2"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, overrides: list[str], steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", "-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml",
           f"train.steps={steps}", f"logging.output_dir={out}", "logging.log_interval=50",
           f"logging.prometheus_port={_free_port()}", *overrides]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise SystemExit(f"{name} failed:\n{res.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Step 1 carries no previous record; later steps each carry one record's cost.
    steps_ = [r for r in records if "loss" in r and r["step"] > 1]
    share = [r["metrics_s"] / r["step_s"] for r in steps_]
    return {
        "layout": name,
        "steps": len(steps_),
        "median step_s": statistics.median(r["step_s"] for r in steps_),
        "median metrics_s": statistics.median(r["metrics_s"] for r in steps_),
        "median share": statistics.median(share),
        "p90 share": sorted(share)[int(0.9 * (len(share) - 1))],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in LAYOUTS.items():
            rows.append(run_layout(name, overrides, args.steps, Path(tmp) / name))
    print("| layout | steps | median step | median metrics | metrics / step (median) | (p90) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['steps']} | {r['median step_s'] * 1e3:.1f} ms | "
              f"{r['median metrics_s'] * 1e3:.2f} ms | {r['median share']:.2%} | {r['p90 share']:.2%} |")


if __name__ == "__main__":
    main()
