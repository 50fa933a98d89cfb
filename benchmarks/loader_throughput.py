"""LLaVA data loading: the in-process path vs ``data.num_workers`` worker processes.

    .venv/bin/python benchmarks/loader_throughput.py [--workers 1 2] [--steps 60] [--quick]

(a) The loader alone: samples/s of building the demo's micro-batches
(``examples/llava/tiny_cpu.yaml`` shapes: 256-token packed rows, 16 tokens
per image, global batch 8, micro-batch 2, one DP rank takes the whole
batch) for ``--loader-steps`` consecutive steps, in this process and through
:class:`~megascale_omni.data.loader.StepLoader` with each ``--workers``
count, consumed as fast as they come, one torch thread in every process
(as under torchrun). Worker start-up (spawn, imports) is
reported apart and not counted in the rate. Then the wait per step when the
consumer spends ``--pause`` s between steps (asleep: the cores are free).

(b) In training: ``--steps`` steps of the demo (2 processes, DP2, gloo) with
``data.num_workers`` 0 and each ``--workers`` count, side by side;
``data_s`` (the time the loop waited for its micro-batches) as a share of
``step_s``, from ``metrics.jsonl``, the first 3 steps (start-up) left out.

``--quick``: 500 samples, 6 + 3 loader steps, 5 training steps, one worker count.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.data.health import SkipCounter  # noqa: E402
from megascale_omni.data.llava.batches import LlavaBatcher, LlavaEncoder, plan_sample  # noqa: E402
from megascale_omni.data.llava.steps import LlavaSteps  # noqa: E402
from megascale_omni.data.loader import StepLoader  # noqa: E402
from megascale_omni.data.sample_plan import PackedEpochPlan  # noqa: E402
from megascale_omni.demo.llava_shapes import (  # noqa: E402
    ensure_shapes_dataset,
    load_shapes_tokenizer,
    open_shapes_split,
)

QUICK = {"num_train": 500, "loader_steps": 6, "paced_steps": 3, "pause": 0.05, "steps": 5, "workers": [1]}
SEQ, TOKENS_PER_IMAGE, GLOBAL_BATCH, MBS, SEED = 256, 16, 8, 2, 1234
SKIP_STEPS = 3


def demo_steps(root: Path) -> LlavaSteps:
    """The demo's step function on the shapes set at ``root`` (every sample usable)."""
    reader = open_shapes_split(root, "train")
    encoder = LlavaEncoder(load_shapes_tokenizer(root), TOKENS_PER_IMAGE)
    lengths = np.array([plan_sample(reader, encoder, i)[0] for i in range(len(reader))])
    plan = PackedEpochPlan(lengths, SEQ, GLOBAL_BATCH, SEED)
    batcher = LlavaBatcher(reader, encoder, SEQ, encoder.tok.pad_id, 32, counter=SkipCounter())
    return LlavaSteps(plan, np.arange(len(reader)), batcher, MBS)


def loader_rate(root: Path, workers: int, steps: int, paced: int, pause: float) -> dict:
    """Samples/s of building ``steps`` steps (DP rank 0 of 1) with ``workers``
    processes (0: in-process), consumed back to back; then the median wait
    for each of ``paced`` more steps when the consumer sleeps ``pause`` s
    between them (the hand-over cost when the loader keeps up)."""
    build = demo_steps(root)
    t0 = time.perf_counter()
    loader = StepLoader(build, num_workers=workers, prefetch_steps=2 * max(workers, 1), last_step=steps + paced + 1,
                        log_level="WARNING")
    try:
        loader.get(0, 0, 1)  # with workers: waits for start-up, then the first step
        startup = time.perf_counter() - t0
        t1 = time.perf_counter()
        for step in range(1, steps + 1):
            loader.get(step, 0, 1)
        elapsed = time.perf_counter() - t1
        waits = []
        for step in range(steps + 1, steps + paced + 1):
            time.sleep(pause)
            t2 = time.perf_counter()
            loader.get(step, 0, 1)
            waits.append(time.perf_counter() - t2)
    finally:
        loader.close()
    samples = sum(p.num_samples for s in range(1, steps + 1) for p in build.share(s, 0, 1))
    return {"workers": workers, "startup_s": startup, "samples": samples, "rate": samples / elapsed,
            "wait_s": statistics.median(waits)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_run(root: Path, workers: int, steps: int, out: Path) -> dict:
    """``steps`` demo steps on 2 processes with ``data.num_workers=workers``: data_s / step_s."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml",
           f"data.path={root}", f"train.steps={steps}", "train.eval_interval=0", f"logging.output_dir={out}",
           "logging.log_interval=1000", "logging.progress_bar=false", f"data.num_workers={workers}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if res.returncode:
        raise SystemExit(f"demo run with {workers} workers failed:\n{res.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in records if "loss" in r and r["step"] > min(SKIP_STEPS, steps - 1)]
    return {
        "workers": workers, "steps": len(recs),
        "step_s": statistics.median(r["step_s"] for r in recs),
        "data_s": statistics.median(r["data_s"] for r in recs),
        "share": sum(r["data_s"] for r in recs) / sum(r["step_s"] for r in recs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-train", type=int, default=20000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--loader-steps", type=int, default=60)
    p.add_argument("--paced-steps", type=int, default=20)
    p.add_argument("--pause", type=float, default=0.5, help="seconds between paced steps (a stand-in for compute)")
    p.add_argument("--steps", type=int, default=60, help="training steps per demo run")
    p.add_argument("--data-dir", default=None, help="where the shapes set is built (default: a temporary directory)")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    # As in training (torchrun sets OMP_NUM_THREADS=1 per rank) and in the
    # workers (DataLoader sets 1): two intra-op threads on a busy 2-core host
    # made the in-process baseline 4-7x slower, a contention artefact.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="loader-bench-") as tmp:
        root = Path(args.data_dir or tmp) / f"shapes-{args.num_train}"
        ensure_shapes_dataset(root, num_train=args.num_train, num_val=20)
        rates = [loader_rate(root, w, args.loader_steps, args.paced_steps, args.pause) for w in [0, *args.workers]]
        base = rates[0]["rate"]
        print(f"(a) loader alone: {args.loader_steps} steps of {GLOBAL_BATCH} packed rows, DP rank 0 of 1; "
              f"wait per step with {args.pause:g} s between steps")
        print("| workers | samples | samples/s | vs in-process | start-up | wait per step |")
        print("|---|---|---|---|---|---|")
        for r in rates:
            print(f"| {r['workers'] or 'in-process'} | {r['samples']} | {r['rate']:.0f} | {r['rate'] / base:.2f}x | "
                  f"{r['startup_s']:.2f} s | {r['wait_s'] * 1e3:.1f} ms |")
        runs = [demo_run(root, w, args.steps, Path(tmp) / f"run-{w}") for w in [0, *args.workers]]
        print(f"(b) demo training, 2 processes (DP2), {args.steps} steps, first {SKIP_STEPS} left out")
        print("| data.num_workers | steps | median step | median data wait | data wait / step time |")
        print("|---|---|---|---|---|")
        for r in runs:
            print(f"| {r['workers']} | {r['steps']} | {r['step_s'] * 1e3:.1f} ms | {r['data_s'] * 1e3:.2f} ms | "
                  f"{r['share']:.2%} |")


if __name__ == "__main__":
    main()
