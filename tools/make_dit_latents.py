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
encoded; its caption's encoder states are stored beside it. Images are
encoded in batches of ``--batch-size`` per bucket (one VAE and one
text-encoder call per batch) and the training shards are streamed to disk
as they fill, so memory stays bounded whatever the folder's size; val/ (a
stable hash of each file name picks ``--val-fraction`` of them) is written
after train/. Images smaller than every bucket, missing captions and
unreadable files are skipped and counted. Train with ``data.path: OUT``, ``dit.in_channels: <latent
channels>``, ``dit.text_encoder: precomputed``, ``dit.text_dim: <D>``
(printed at the end and stored in ``OUT/dataset.json``).

Needs ``pip install -e '.[latents]'`` (diffusers, transformers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Iterator

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
from megascale_omni.data.shard_writer import write_member_shards

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
    p.add_argument("--batch-size", type=int, default=16,
                   help="images of one bucket encoded together through the VAE and text encoder")
    return p.parse_args(argv)


def in_val(name: str, fraction: float) -> bool:
    """Whether image ``name`` goes to val/: a stable hash of the name, so the
    split does not depend on the folder's size or order."""
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest()[:8], 16) < fraction * 2**32


class LatentEncoder:
    """Collects images per bucket and encodes each full batch at once: one
    VAE call on ``[B, H, W, 3]`` pixels of one bucket and one text-encoder
    call on the B captions. Memory: at most ``batch_size`` images per bucket."""

    def __init__(self, vae: VaeCodec, text: TextStates, batch_size: int):
        self.vae, self.text, self.batch_size = vae, text, batch_size
        self.pending: dict[int, list[tuple[str, np.ndarray, str]]] = {}

    def add(self, bucket: int, name: str, pixels: np.ndarray, caption: str) -> Iterator[tuple]:
        """Queue one image; yields ``(name, latent, caption, states)`` when its bucket's batch is full."""
        batch = self.pending.setdefault(bucket, [])
        batch.append((name, pixels, caption))
        if len(batch) == self.batch_size:
            yield from self._encode(self.pending.pop(bucket))

    def flush(self) -> Iterator[tuple]:
        """Encode every partial batch (at the end)."""
        for bucket in sorted(self.pending):
            yield from self._encode(self.pending.pop(bucket))

    def _encode(self, batch: list[tuple[str, np.ndarray, str]]) -> Iterator[tuple]:
        latents = self.vae.encode(np.stack([pixels for _, pixels, _ in batch]))
        states = self.text.encode([caption for _, _, caption in batch])
        for (name, _, caption), latent, state in zip(batch, latents, states):
            yield name, latent, caption, state


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.out.exists():
        print(f"error: --out {args.out} exists; choose a new directory", file=sys.stderr)
        return 1
    if args.batch_size < 1 or not 0.0 <= args.val_fraction < 1.0 or args.samples_per_shard < 1:
        print("error: --batch-size and --samples-per-shard must be >= 1 and --val-fraction in [0, 1)",
              file=sys.stderr)
        return 2
    cfg = from_dict(JobConfig, load_yaml(args.config))
    table = BucketTable(cfg.dit.buckets, cfg.dit.patch_size, cfg.dit.token_budget)
    vae = VaeCodec.load(args.vae)
    text = TextStates.load(args.text_encoder, cfg.dit.max_text_length)
    f = vae.downsample
    encoder = LatentEncoder(vae, text, args.batch_size)
    skipped: list[tuple[str, str]] = []
    val: list[dict] = []
    counts = {"train": 0, "val": 0}

    def encoded() -> Iterator[tuple]:
        for path in sorted(p for p in args.images.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
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
            yield from encoder.add(k, path.name, pixels, caption)
        yield from encoder.flush()

    def train_records() -> Iterator[dict]:
        # Streamed to disk shard by shard; the val share (small) is kept until train is written.
        for name, latent, caption, states in encoded():
            split = "val" if in_val(name, args.val_fraction) else "train"
            record = encode_latent_record(counts[split], latent, caption, states)
            counts[split] += 1
            if split == "val":
                val.append(record)
            else:
                yield record

    desc = {"name": args.out.name, "kind": "latents", "in_channels": vae.channels, "text": "precomputed",
            "text_dim": text.dim, "vae": str(args.vae), "text_encoder": str(args.text_encoder), "downsample": f}
    write_member_shards(train_records(), args.out / "train", args.samples_per_shard)
    for name, reason in skipped:
        logger.warning("skipped %s: %s", name, reason)
    if not counts["train"]:
        shutil.rmtree(args.out, ignore_errors=True)
        print(f"error: no usable training images in {args.images} ({len(skipped)} skipped)", file=sys.stderr)
        return 1
    write_dit_dataset(args.out, {"val": val} if val else {}, {**desc, "skipped": len(skipped)},
                      samples_per_shard=args.samples_per_shard)
    print(json.dumps({"out": str(args.out), "train": counts["train"], "val": counts["val"], "skipped": len(skipped),
                      "in_channels": vae.channels, "text_dim": text.dim}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
