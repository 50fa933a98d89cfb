"""LLaVA start-up: building the training plan from index.json's per-sample costs
vs reading every sample's JSON member (the path of indexes without costs).

    .venv/bin/python benchmarks/plan_startup.py [--num-train 20000] [--repeats 3] [--quick]

Builds (or reuses) the embedded shapes dataset, whose index carries token
counts for its tokenizer, and a second index over the same shard files
without them. Each repeat times, for both indexes in turn (side by side, same
page cache), what ``ConversationData`` does at start-up: open the split, compute
every sample's length and cost, and build the step-indexed packed plan. The
two plans must be identical. ``--quick``: 500 samples, one repeat.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.data.llava.batches import LlavaEncoder  # noqa: E402
from megascale_omni.data.llava.plan_scan import PlanScanner  # noqa: E402
from megascale_omni.data.sample_plan import PackedEpochPlan  # noqa: E402
from megascale_omni.data.shard_writer import index_shards  # noqa: E402
from megascale_omni.data.shards import ShardedSampleReader  # noqa: E402
from megascale_omni.demo.llava_shapes import ensure_shapes_dataset, load_shapes_tokenizer  # noqa: E402

QUICK = {"num_train": 500, "repeats": 1}


def build_plan(split: Path, encoder: LlavaEncoder, args: argparse.Namespace):
    """Start-up as the LLaVA task does it: (seconds, plan, samples planned from the index)."""
    t0 = time.perf_counter()
    reader = ShardedSampleReader(split)
    scan = PlanScanner(encoder, args.tokens_per_image, args.seq_length, 1).scan(reader)
    plan = PackedEpochPlan(scan.lengths, args.seq_length, args.global_batch_size, 1234, costs=scan.costs)
    plan.epoch_packs(0)
    seconds = time.perf_counter() - t0
    reader.close()
    return seconds, plan, scan.from_index


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-train", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--tokens-per-image", type=int, default=16)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--data-dir", default=None, help="dataset dir (default: a temporary directory)")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    with tempfile.TemporaryDirectory(prefix="plan-startup-") as tmp:
        root = Path(args.data_dir or tmp) / f"shapes-{args.num_train}"
        ensure_shapes_dataset(root, num_train=args.num_train, num_val=20)
        encoder = LlavaEncoder(load_shapes_tokenizer(root), args.tokens_per_image)
        # The same shard files, indexed without token counts.
        plain = Path(tmp) / "no-token-counts"
        plain.mkdir()
        for shard in sorted((root / "train").glob("shard-*.tar")):
            os.symlink(shard.resolve(), plain / shard.name)
        index_shards(plain)
        times = {"index": [], "json": []}
        for _ in range(args.repeats):
            s_json, plan_json, n_json = build_plan(plain, encoder, args)
            s_index, plan_index, n_index = build_plan(root / "train", encoder, args)
            times["json"].append(s_json)
            times["index"].append(s_index)
        same = all(plan_json.global_batch(s) == plan_index.global_batch(s) for s in range(plan_index.steps_in_epoch(0)))
    n = args.num_train
    best = {k: min(v) for k, v in times.items()}
    print(f"samples {n}, seq_length {args.seq_length}, {args.tokens_per_image} tokens per image, "
          f"{args.repeats} repeat(s), best of each")
    print("| start-up path | planned from index | plan build (s) | per sample (us) | ratio |")
    print("|---|---|---|---|---|")
    print(f"| read every sample's JSON (baseline) | {n_json} | {best['json']:.3f} | {1e6 * best['json'] / n:.1f} "
          f"| 1.00x |")
    print(f"| index.json costs | {n_index} | {best['index']:.3f} | {1e6 * best['index'] / n:.1f} | "
          f"{best['json'] / best['index']:.2f}x faster |")
    print(f"plans identical: {same}; all runs json {[round(t, 3) for t in times['json']]}, "
          f"index {[round(t, 3) for t in times['index']]}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
