"""The embedded DiT dataset: captioned shapes at several aspect ratios and sizes.

Each image is one solid shape (square / circle / triangle) in one of the
seven saturated colours of :mod:`megascale_omni.demo.shapes`, on black, with
the caption ``"a <colour> <shape>"``. Canvas sizes mix five aspect ratios
(1:1, 3:5, 5:3, 1:2, 2:1) at two scales, each side jittered by 0-3 px, so the
bucketing, dynamic batch size and balancing have real work to do, yet the
whole thing is learnable in pixel space on a CPU in minutes.

Colour is the measurable target of the demo: :func:`dominant_color` names the
palette colour that most lit pixels of an image are closest to, which is how
sampled images are scored against their prompts.

Sample ``i`` of stream ``s`` is a pure function of ``(seed, s, i)``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
from PIL import Image, ImageDraw

from megascale_omni.data.dit.reader import DATASET_FILENAME, encode_pixel_record, write_dit_dataset
from megascale_omni.demo.shapes import COLORS, SHAPES, sample_rng

logger = logging.getLogger(__name__)

#: Base canvas sizes ``(height, width)``; each side gets +0..3 px of jitter.
BASE_SIZES: tuple[tuple[int, int], ...] = (
    (16, 16), (24, 24), (12, 20), (20, 12), (16, 32), (32, 16), (12, 24), (24, 12),
)
MAX_JITTER = 3
SPLIT_STREAMS = {"train": 10, "val": 11}
FORMAT_VERSION = 1
#: A pixel counts as lit (part of the shape) when its brightest channel is above this.
LIT_THRESHOLD = 100


def caption_of(color: str, shape: str) -> str:
    return f"a {color} {shape}"


def vocabulary() -> list[str]:
    return sorted({"a", *COLORS, *SHAPES})


def render(rng: np.random.Generator, height: int, width: int, color: str, shape: str) -> np.ndarray:
    """Draw one shape, 35-55 % of the short side, at least 2 px from every
    edge plus the crop jitter; returns uint8 ``[height, width, 3]``."""
    short = min(height, width)
    extent = int(rng.integers(max(4, round(0.35 * short)), max(5, round(0.55 * short)) + 1))
    margin = 2 + MAX_JITTER // 2 + 1
    x0 = int(rng.integers(margin, max(margin, width - margin - extent) + 1))
    y0 = int(rng.integers(margin, max(margin, height - margin - extent) + 1))
    img = Image.new("RGB", (width, height), (0, 0, 0))
    draw = ImageDraw.Draw(img)
    x1, y1 = x0 + extent - 1, y0 + extent - 1
    fill = COLORS[color]
    if shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2.0, y0)], fill=fill)
    return np.asarray(img, dtype=np.uint8).copy()


def generate(index: int, seed: int, stream: int) -> tuple[np.ndarray, str, str]:
    """Sample ``index``: ``(image, caption, colour)``."""
    rng = sample_rng(seed, index, stream)
    h, w = BASE_SIZES[int(rng.integers(len(BASE_SIZES)))]
    h += int(rng.integers(MAX_JITTER + 1))
    w += int(rng.integers(MAX_JITTER + 1))
    color = list(COLORS)[int(rng.integers(len(COLORS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    return render(rng, h, w, color, shape), caption_of(color, shape), color


def records(num: int, seed: int, stream: int) -> Iterator[dict[str, bytes]]:
    """Encoded shard records of samples ``0 .. num-1`` of ``stream``."""
    for i in range(num):
        image, caption, _ = generate(i, seed, stream)
        yield encode_pixel_record(i, image, caption)


def description(**extra) -> dict:
    """``dataset.json`` of a pixel-space shapes dataset."""
    return {"name": "dit-shapes", "format_version": FORMAT_VERSION, "kind": "pixels", "in_channels": 3,
            "text": "caption", **extra}


def ensure_dit_shapes_dataset(
    out_dir: str | os.PathLike, num_train: int, num_val: int, seed: int = 1234, samples_per_shard: int = 1000
) -> Path:
    """Build the dataset at ``out_dir`` unless it exists (every rank may call;
    each builds privately and the first atomic rename wins)."""
    out = Path(out_dir)
    args = {"num_train": num_train, "num_val": num_val, "seed": seed, "samples_per_shard": samples_per_shard}
    if not (out / DATASET_FILENAME).is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            splits = {split: records(num, seed, SPLIT_STREAMS[split]) for split, num in
                      (("train", num_train), ("val", num_val))}
            write_dit_dataset(tmp, splits, description(build_args=args), vocabulary(), samples_per_shard)
            os.chmod(tmp, 0o755)
            os.rename(tmp, out)
            logger.info("built DiT shapes dataset at %s (%d train, %d val)", out, num_train, num_val)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (out / DATASET_FILENAME).is_file():
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    desc = json.loads((out / DATASET_FILENAME).read_text())
    if desc.get("build_args") != args:
        raise ValueError(f"{out} was built with {desc.get('build_args')}, requested {args}; delete it or pick another")
    return out


def dominant_color(image: np.ndarray) -> Optional[str]:
    """Palette colour that most lit pixels of ``image`` (uint8 ``[H, W, 3]``)
    are nearest to (Euclidean RGB), or None when no pixel is lit."""
    pixels = image.reshape(-1, 3).astype(np.float32)
    lit = pixels[pixels.max(axis=1) > LIT_THRESHOLD]
    if lit.shape[0] == 0:
        return None
    names = list(COLORS)
    palette = np.asarray([COLORS[n] for n in names], dtype=np.float32)
    nearest = np.argmin(((lit[:, None, :] - palette[None]) ** 2).sum(-1), axis=1)
    return names[int(np.bincount(nearest, minlength=len(names)).argmax())]
