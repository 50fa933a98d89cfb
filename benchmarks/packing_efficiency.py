"""Packing efficiency of the LLaVA data path vs padding every sample to the max.

    .venv/bin/python benchmarks/packing_efficiency.py [--num-train 20000] [--seq-length 256] [--quick]

Builds (or reuses) the embedded shapes dataset, computes encoded lengths from
the shard metadata and reports, side by side, the fraction of non-padding
tokens with sequence packing and with one padded sample per row.
``--quick``: 500 samples.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.data.llava.batches import LlavaEncoder  # noqa: E402
from megascale_omni.data.packing import pack_samples, packing_efficiency, pad_to_max_efficiency  # noqa: E402
from megascale_omni.demo.llava_shapes import (  # noqa: E402
    ensure_shapes_dataset,
    load_shapes_tokenizer,
    open_shapes_split,
)

QUICK = {"num_train": 500}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-train", type=int, default=20000)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--tokens-per-image", type=int, default=16)
    p.add_argument("--data-dir", default=None, help="dataset dir (default: a temporary directory)")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    with tempfile.TemporaryDirectory(prefix="packing-bench-") as tmp:
        root = Path(args.data_dir or tmp) / f"shapes-{args.num_train}"
        ensure_shapes_dataset(root, num_train=args.num_train, num_val=20)
        reader = open_shapes_split(root, "train")
        enc = LlavaEncoder(load_shapes_tokenizer(root), args.tokens_per_image)
        lengths = np.array([enc.length_from_metadata(reader.read_metadata(i)) for i in range(len(reader))])
    t0 = time.perf_counter()
    packs = pack_samples(lengths, args.seq_length)
    pack_s = time.perf_counter() - t0
    packed = packing_efficiency(packs, args.seq_length)
    padded = pad_to_max_efficiency(lengths)
    print(f"samples {len(lengths)}  length mean {lengths.mean():.1f} max {lengths.max()}  seq_length {args.seq_length}")
    print(f"{'method':<24}{'efficiency':>12}{'rows':>10}")
    print(f"{'packed (best-fit)':<24}{packed:>12.3f}{len(packs):>10}")
    print(f"{'pad to longest sample':<24}{padded:>12.3f}{len(lengths):>10}")
    print(f"ratio {packed / padded:.2f}x useful tokens per row; packing took {pack_s:.2f}s")


if __name__ == "__main__":
    main()
