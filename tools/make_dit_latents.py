#!/usr/bin/env python
"""Encode a folder of captioned images into DiT latent shards (offline).

    python tools/make_dit_latents.py --images DIR --vae VAE_DIR --text-encoder TEXT_DIR \\
        --config examples/dit/my.yaml --out data/my-latents

``DIR`` holds images (``.png``/``.jpg``/``.jpeg``/``.webp``) with captions
in sidecar ``<name>.txt`` files. ``VAE_DIR`` is a diffusers ``AutoencoderKL``
directory and ``TEXT_DIR`` a transformers tokenizer + encoder directory
(CLIP text model, T5 encoder, ...), both local. Each image is assigned to a
bucket of the config's ``dit.buckets`` (latent pixels; image pixels are
``downsample`` times larger), resized to cover it, centre-cropped and
encoded; its caption's encoder states are stored beside it. Images smaller
than every bucket, missing captions and unreadable files are skipped and
counted. Train with ``data.path: OUT``, ``dit.in_channels: <latent
channels>``, ``dit.text_encoder: precomputed``, ``dit.text_dim: <D>``
(printed at the end and stored in ``OUT/dataset.json``).

Needs ``pip install -e '.[latents]'`` (diffusers, transformers).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
from PIL import Image

try:
    import megascale_omni  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale_omni.config import JobConfig, from_dict, load_yaml
from megascale_omni.data.dit.buckets import Bucket, BucketTable
from megascale_omni.data.dit.latents import TextStates, VaeCodec
from megascale_omni.data.dit.reader import encode_latent_record, resize_cover_crop, write_dit_dataset

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp"}
logger = logging.getLogger("make_dit_latents")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", required=True, type=Path, help="folder of images with <name>.txt captions")
    p.add_argument("--vae", required=True, type=Path, help="local diffusers AutoencoderKL directory")
    p.add_argument("--text-encoder", required=True, type=Path, help="local transformers tokenizer+encoder directory")
    p.add_argument("--config", required=True, type=Path, help="training YAML (dit.buckets, dit.max_text_length)")
    p.add_argument("--out", required=True, type=Path, help="output dataset directory (must not exist)")
    p.add_argument("--val-fraction", type=float, default=0.02, help="share of samples in val/ (default %(default)s)")
    p.add_argument("--samples-per-shard", type=int, default=1000)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.out.exists():
        print(f"error: --out {args.out} exists; choose a new directory", file=sys.stderr)
        return 1
    cfg = from_dict(JobConfig, load_yaml(args.config))
    table = BucketTable(cfg.dit.buckets, cfg.dit.patch_size, cfg.dit.token_budget)
    vae = VaeCodec.load(args.vae)
    text = TextStates.load(args.text_encoder, cfg.dit.max_text_length)
    f = vae.downsample
    records, skipped = [], []
    files = sorted(p for p in args.images.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    for path in files:
        caption_file = path.with_suffix(".txt")
        caption = caption_file.read_text(encoding="utf-8").strip() if caption_file.is_file() else ""
        if not caption:
            skipped.append((path.name, "missing caption"))
            continue
        try:
            with Image.open(path) as img:
                img = img.convert("RGB")
                k = table.assign(img.height // f, img.width // f)
                if k is None:
                    skipped.append((path.name, f"{img.width}x{img.height} px is smaller than every bucket"))
                    continue
                b = table.buckets[k]
                pixels = np.asarray(resize_cover_crop(img, Bucket(b.height * f, b.width * f)), dtype=np.uint8)
        except OSError as exc:
            skipped.append((path.name, f"unreadable image: {exc}"))
            continue
        latent = vae.encode(pixels[None])[0]
        states = text.encode([caption])[0]
        records.append(encode_latent_record(len(records), latent, caption, states))
    for name, reason in skipped:
        logger.warning("skipped %s: %s", name, reason)
    if not records:
        print(f"error: no usable images in {args.images} ({len(skipped)} skipped)", file=sys.stderr)
        return 1
    n_val = int(round(len(records) * args.val_fraction))
    splits = {"train": records[n_val:]}
    if n_val:
        splits["val"] = records[:n_val]
    desc = {"name": args.out.name, "kind": "latents", "in_channels": vae.channels, "text": "precomputed",
            "text_dim": text.dim, "vae": str(args.vae), "text_encoder": str(args.text_encoder),
            "downsample": f, "skipped": len(skipped)}
    write_dit_dataset(args.out, splits, desc, samples_per_shard=args.samples_per_shard)
    print(json.dumps({"out": str(args.out), "train": len(records) - n_val, "val": n_val, "skipped": len(skipped),
                      "in_channels": vae.channels, "text_dim": text.dim}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
