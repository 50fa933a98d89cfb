"""DiT bucketing: padding waste and per-rank token balance vs the naive ways.

    .venv/bin/python benchmarks/dit_buckets.py [--config examples/dit/tiny_cpu.yaml] [--num-train 6000] [--quick]

On the embedded multi-aspect shapes data (sizes from the shard metadata),
prints side by side, for DP = 2, 4 and 8 (4 packages per rank) over one epoch:
padding waste of bucketed packages vs padding every image to the largest
bucket, and the per-step max/mean latent tokens over DP ranks of the
token-balanced package split vs an equal-image-count split.
``--quick``: 500 images.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.config import JobConfig, from_dict, load_yaml  # noqa: E402
from megascale_omni.data.dit.buckets import BucketPlan, BucketTable, bucket_report  # noqa: E402
from megascale_omni.data.dit.reader import DitSampleReader  # noqa: E402
from megascale_omni.demo.dit_shapes import ensure_dit_shapes_dataset  # noqa: E402

QUICK = {"num_train": 500}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/dit/tiny_cpu.yaml")
    p.add_argument("--num-train", type=int, default=6000)
    p.add_argument("--data-dir", default=None, help="dataset dir (default: a temporary directory)")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    cfg = from_dict(JobConfig, load_yaml(args.config))
    d = cfg.dit
    table = BucketTable(d.buckets, d.patch_size, d.token_budget)
    with tempfile.TemporaryDirectory(prefix="dit-bench-") as tmp:
        root = ensure_dit_shapes_dataset(Path(args.data_dir or tmp) / f"dit-{args.num_train}", args.num_train, 10)
        reader = DitSampleReader(root / "train")
        ids = [table.assign(m["height"], m["width"]) for m in map(reader.metadata, range(len(reader)))]
    print(f"{len(ids)} images; buckets (HxW:tokens x batch): {table.describe()}")
    for dp in (2, 4, 8):
        gbs = 4 * dp  # 4 packages per rank, as in the demo config (8 packages, dp=2)
        plan = BucketPlan(ids, table, gbs, cfg.train.seed)
        print(f"\ndp={dp}, {gbs} packages/step, {plan.steps_per_epoch} steps\n{bucket_report(plan, dp).table()}")


if __name__ == "__main__":
    main()
