#!/usr/bin/env python
"""Build the synthetic shapes image-text dataset (shards + index + tokenizer).

    python tools/make_shapes_dataset.py --out data/shapes [--video-fraction 0.2] [--format llava-json]

Writes ``OUT/train/``, ``OUT/val/`` (WebDataset tar shards + index.json),
``OUT/tokenizer.json`` and ``OUT/dataset.json``. The same arguments always give
byte-identical files. ``--format llava-json`` writes the same samples in
LLaVA's JSON format instead (``OUT/<split>/llava.json`` + ``images/``, and
``OUT/tokenizer.json``), the input of ``tools/ingest_llava.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

try:
    from megascale_omni.demo.llava_shapes import make_shapes_dataset, make_shapes_llava_json
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megascale_omni.demo.llava_shapes import make_shapes_dataset, make_shapes_llava_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output dataset directory")
    p.add_argument("--num-train", type=int, default=4000, help="training samples (default: %(default)s)")
    p.add_argument("--num-val", type=int, default=500, help="validation samples (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1234, help="generator seed (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=32, help="image side in pixels (default: %(default)s)")
    p.add_argument("--samples-per-shard", type=int, default=500, help="samples per tar shard (default: %(default)s)")
    p.add_argument("--video-fraction", type=float, default=0.0,
                   help="share of each split that is 4-frame clips whose answers need the frame order "
                        "(demo/video_shapes.py; shards only; default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out directory")
    p.add_argument("--format", choices=("shards", "llava-json"), default="shards",
                   help="training shards (default) or LLaVA-format JSON + images for tools/ingest_llava.py")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    if not 0.0 <= args.video_fraction <= 1.0 or (args.video_fraction and args.format == "llava-json"):
        print(f"error: --video-fraction={args.video_fraction}: must be in [0, 1], with --format shards",
              file=sys.stderr)
        return 2
    if args.format == "llava-json":
        if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
            print(f"error: {args.out} already exists and is not empty; pass --overwrite", file=sys.stderr)
            return 1
        written = make_shapes_llava_json(args.out, args.num_train, args.num_val, args.seed, args.image_size)
        print(f"wrote {written} samples as LLaVA JSON under {args.out} in {time.perf_counter() - start:.1f}s")
        return 0
    try:
        description = make_shapes_dataset(
            args.out, num_train=args.num_train, num_val=args.num_val, seed=args.seed,
            image_size=args.image_size, samples_per_shard=args.samples_per_shard, overwrite=args.overwrite,
            video_fraction=args.video_fraction,
        )
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    print(json.dumps(description["splits"], indent=2, sort_keys=True))
    print(f"wrote {args.out} (vocab_size={description['vocab_size']}) in {elapsed:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
