"""Step time of the tiny LLaVA, image-only against 20% video, at equal global batch.

    .venv/bin/python benchmarks/video_step_time.py [--steps 120] [--rounds 2] [--quick]

The demo's model and batch (examples/llava/tiny_cpu.yaml: a 2-layer ViT, a
4-layer GPT, 8 packed rows of 256 tokens per step, 2 processes, DP2, gloo)
on two shapes sets built here with the same seed: image-only, and one fifth
clips of 4 frames (each frame a tower input, pooled 2x2 to 4 LM tokens;
megascale_omni/demo/video_shapes.py). The global batch is the same number
of packed rows, so the LM sees the same tokens per step and the tower more
inputs. Runs alternate (image, video, image, video, ...) so both see the
same load on a shared host; per run the first 10 steps are dropped. Reports
medians of ``step_s`` and its ``compute_s``, the tower inputs (images plus
frames) and vision tokens per step from the step records, and the ratios.

``--quick``: 6 steps, 1 round, 200 samples.
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

QUICK = {"steps": 6, "rounds": 1, "samples": 200}
MIXES = {"image-only": 0.0, "20% video": 0.2}
WARMUP = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(data: Path, steps: int, out: Path) -> list[dict]:
    """One training run of ``steps`` on ``data``; its step records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml",
           "vision.lr_mult=0.3", f"data.path={data}", f"train.steps={steps}", "train.eval_interval=0",
           f"logging.output_dir={out}", "logging.tensorboard=false", "logging.log_interval=50"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if res.returncode:
        raise SystemExit(f"{data.name} failed:\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"step_s"' in line]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="steps per run (the first 10 are dropped)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mix, alternating")
    p.add_argument("--samples", type=int, default=4000, help="training samples of each set")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(argv), QUICK)
    from megascale_omni.demo.llava_shapes import make_shapes_dataset

    rows: dict[str, list[dict]] = {name: [] for name in MIXES}
    with tempfile.TemporaryDirectory(prefix="video-step-") as tmp:
        for name, fraction in MIXES.items():
            make_shapes_dataset(Path(tmp) / name, num_train=args.samples, num_val=8, seed=1234,
                                video_fraction=fraction)
        for k in range(args.rounds):
            for name in MIXES:
                records = run(Path(tmp) / name, args.steps, Path(tmp) / f"run-{name}-{k}")
                rows[name] += records[WARMUP:] if len(records) > WARMUP else records[1:]
    table = {}
    for name, records in rows.items():
        frames = [r["vision_tokens"] / 16 for r in records]  # 16 tower tokens per input at 32 px, 8 px patches
        table[name] = {
            "steps": len(records),
            "step_s": statistics.median(r["step_s"] for r in records),
            "compute_s": statistics.median(r["compute_s"] for r in records),
            "tokens": statistics.mean(r["tokens"] for r in records),
            "samples": statistics.mean(r["samples"] for r in records),
            "video samples": statistics.mean(r["samples_video"] for r in records),
            "tower inputs": statistics.mean(frames),
        }
    base, video = table["image-only"], table["20% video"]
    print("| mix | steps | median step_s | median compute_s | LM tokens / step | samples / step | "
          "video samples / step | tower inputs / step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, t in table.items():
        print(f"| {name} | {t['steps']} | {t['step_s']:.3f} | {t['compute_s']:.3f} | {t['tokens']:.0f} | "
              f"{t['samples']:.1f} | {t['video samples']:.1f} | {t['tower inputs']:.1f} |")
    print(f"\nratio 20% video / image-only: step_s {video['step_s'] / base['step_s']:.3f}, "
          f"compute_s {video['compute_s'] / base['compute_s']:.3f}, "
          f"tower inputs {video['tower inputs'] / base['tower inputs']:.3f}")


if __name__ == "__main__":
    main()
