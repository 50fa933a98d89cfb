"""The LLaVA plan on an image/video mix: padding waste, the vision-token budget and DP rank balance.

    .venv/bin/python benchmarks/video_mix_plan.py [--samples 20000] [--quick]

A synthetic LLaVA-OneVision-like sample mix (text 20-200 tokens; 0, 1 or 2
images of ``--tower-tokens`` tokens each, or a video of ``--frames`` frames
whose LM placeholders are pooled 2x2 plus a newline) is planned as training
plans it (``PackedEpochPlan``: windowed best-fit packing, then a
cost-balanced split of each step among DP ranks in whole micro-batches),
image-only and with 20% video, without and with a per-micro-batch
vision-token budget. Reported side by side for one epoch: packing efficiency
(non-padding share of the rows), rows, samples the budget deferred, the
largest micro-batch's vision tokens, and the worst and mean per-step rank
imbalance (max/mean estimated cost) of the balanced split next to the
contiguous cut. No timing: the numbers are exact for the seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.data.balance import imbalance, sample_cost, split_contiguous  # noqa: E402
from megascale_omni.data.llava.steps import LlavaSteps  # noqa: E402
from megascale_omni.data.packing import packing_efficiency  # noqa: E402
from megascale_omni.data.sample_plan import PackedEpochPlan  # noqa: E402

QUICK = {"samples": 600}


def sample_mix(n: int, video_share: float, frames: int, tower: int, seed: int) -> tuple[np.ndarray, ...]:
    """(LM lengths, balance costs, vision tokens) of ``n`` samples."""
    rng = np.random.default_rng(seed)
    text = rng.integers(20, 200, n)
    video = rng.random(n) < video_share
    images = rng.choice([0, 1, 1, 1, 2], n)
    inputs = np.where(video, frames, images)
    pooled = frames * (-(-int(np.sqrt(tower)) // 2)) ** 2 + 1  # 2x2-pooled frames and a newline
    lengths = text + np.where(video, pooled, images * tower)
    costs = np.asarray([sample_cost(int(n_), int(k), tower) for n_, k in zip(lengths, inputs)])
    return lengths, costs, inputs * tower


def measure(args, video_share: float, budget: int) -> list[str]:
    lengths, costs, vision = sample_mix(args.samples, video_share, args.frames, args.tower_tokens, args.seed)
    mbs = args.micro_batch_size
    plan = PackedEpochPlan(lengths, args.seq_length, args.global_batch_size, args.seed, costs=costs,
                           vision=vision, max_vision=budget // mbs)
    packs = plan.epoch_packs(0)
    cells = [f"{video_share:.0%}", f"{budget // args.tower_tokens} inputs" if budget else "off",
             f"{packing_efficiency(packs, args.seq_length):.1%}", str(len(packs)),
             str(sum(p.deferred for p in packs))]
    steps = LlavaSteps(plan, np.arange(len(lengths)), batcher=None, micro_batch_size=mbs)
    biggest = 0
    for dp in args.dp:
        balanced, naive = [], []
        for step in range(plan.steps_in_epoch(0)):
            batch = plan.global_batch(step)
            shares = [steps.share(step, r, dp) for r in range(dp)]
            biggest = max(biggest, *(sum(p.vision for p in s[i:i + mbs]) for s in shares for i in
                                     range(0, len(s), mbs)))
            balanced.append(imbalance([sum(p.cost for p in s) for s in shares]))
            naive.append(imbalance([sum(p.cost for p in s) for s in split_contiguous(batch, dp)]))
        cells.append(f"{max(balanced):.3f} ({np.mean(balanced):.3f}) vs {max(naive):.3f} ({np.mean(naive):.3f})")
    cells.insert(5, str(biggest))
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--global-batch-size", type=int, default=32, help="packed rows per step")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--tower-tokens", type=int, default=576, help="vision tokens per image or frame")
    p.add_argument("--frames", type=int, default=8, help="frames per video")
    p.add_argument("--budget", type=int, default=32, help="vision-token budget per micro-batch, in tower inputs")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seed", type=int, default=0)
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    head = ["video", "budget / micro-batch", "packing efficiency", "rows", "deferred", "max vision tokens / mb",
            *(f"imbalance dp {dp}: balanced worst (mean) vs contiguous" for dp in args.dp)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for share in (0.0, 0.2):
        for budget in (0, args.budget * args.tower_tokens):
            print("| " + " | ".join(measure(args, share, budget)) + " |", flush=True)


if __name__ == "__main__":
    main()
