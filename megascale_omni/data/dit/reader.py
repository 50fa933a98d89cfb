"""DiT samples on disk: images (or VAE latents) with captions, in our shard format.

A DiT split is a directory of WebDataset tar shards plus ``index.json``
(:mod:`megascale_omni.data.shards`). Members of sample ``<key>``:

* ``<key>.json``: ``{"id": int, "caption": str, "height": int, "width": int}``;
  height/width are the stored tensor's size in latent pixels (= image pixels
  for pixel-space data).
* pixel data: ``<key>.png``, 8-bit RGB, any size;
* latent data (``tools/make_dit_latents.py``): ``<key>.latent.npy`` float16
  ``[C, height, width]`` and, for precomputed text, ``<key>.text.npy``
  float16 ``[L, D]`` (text-encoder states of the caption).

``dataset.json`` beside the splits says which (``"kind": "pixels" | "latents"``,
``"in_channels"``, ``"text": "caption" | "precomputed"``).

Bad samples raise :class:`~megascale_omni.data.shards.BadSampleError`: a
missing or empty caption, an unreadable image or array, an image smaller
than every bucket. The batcher skips and counts them.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from PIL import Image

from megascale_omni.data.dit.buckets import Bucket
from megascale_omni.data.shards import BadSampleError, ShardedSampleReader, write_member_shards
from megascale_omni.data.tokenizer import TOKENIZER_FILENAME, build_word_tokenizer

DATASET_FILENAME = "dataset.json"
REQUIRED_FIELDS = ("id", "height", "width")


@dataclass
class DitSample:
    """One decoded sample: ``data`` float32 ``[C, H, W]`` (pixels in [-1, 1]
    or latents), the caption, and precomputed text states ``[L, D]`` if any."""

    id: int
    data: torch.Tensor
    caption: str
    text_states: Optional[torch.Tensor] = None


def encode_pixel_record(sample_id: int, image: np.ndarray, caption: Optional[str]) -> dict[str, bytes]:
    """Shard members of a pixel sample (``caption=None`` writes no caption field)."""
    meta: dict[str, Any] = {"id": int(sample_id), "height": int(image.shape[0]), "width": int(image.shape[1])}
    if caption is not None:
        meta["caption"] = caption
    buf = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buf, format="PNG")
    return {"json": json.dumps(meta, sort_keys=True, separators=(",", ":")).encode(), "png": buf.getvalue()}


def encode_latent_record(
    sample_id: int, latent: np.ndarray, caption: str, text_states: Optional[np.ndarray]
) -> dict[str, bytes]:
    """Shard members of a latent sample: ``latent [C, h, w]``, ``text_states [L, D]``."""
    meta = {"id": int(sample_id), "height": int(latent.shape[1]), "width": int(latent.shape[2]), "caption": caption}
    members = {"json": json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()}
    members["latent.npy"] = _npy(latent.astype(np.float16))
    if text_states is not None:
        members["text.npy"] = _npy(text_states.astype(np.float16))
    return members


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def write_dit_dataset(
    out_dir: Path,
    splits: Mapping[str, Iterable[Mapping[str, bytes]]],
    description: Mapping[str, Any],
    vocabulary: Optional[Sequence[str]] = None,
    samples_per_shard: int = 1000,
) -> None:
    """Write ``out_dir/<split>/`` shards for each split's encoded records,
    ``dataset.json`` (``description``: kind, in_channels, text, ...) and, for
    captions embedded by the model, a word-level ``tokenizer.json`` of ``vocabulary``."""
    out_dir = Path(out_dir)
    for split, records in splits.items():
        write_member_shards(records, out_dir / split, samples_per_shard)
    if vocabulary is not None:
        build_word_tokenizer(sorted(vocabulary), out_dir / TOKENIZER_FILENAME)
    (out_dir / DATASET_FILENAME).write_text(json.dumps(dict(description), indent=2, sort_keys=True) + "\n")


def load_dataset_description(root: Path) -> dict[str, Any]:
    path = root / DATASET_FILENAME
    if not path.is_file():
        return {"kind": "pixels", "in_channels": 3, "text": "caption"}
    return json.loads(path.read_text(encoding="utf-8"))


def resize_cover_crop(image: Image.Image, bucket: Bucket) -> Image.Image:
    """Resize (keeping aspect) so the image covers ``bucket``, then centre-crop to it."""
    w, h = image.size
    scale = max(bucket.width / w, bucket.height / h)
    nw, nh = max(bucket.width, round(w * scale)), max(bucket.height, round(h * scale))
    if (nw, nh) != (w, h):
        image = image.resize((nw, nh), Image.Resampling.BILINEAR, reducing_gap=None)
    left, top = (nw - bucket.width) // 2, (nh - bucket.height) // 2
    return image.crop((left, top, left + bucket.width, top + bucket.height))


def _resize_latent(latent: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """Latents are made at bucket size offline; other sizes are centre-cropped
    (never interpolated: resampling a VAE latent is not resampling an image)."""
    _, h, w = latent.shape
    top, left = (h - bucket.height) // 2, (w - bucket.width) // 2
    return latent[:, top : top + bucket.height, left : left + bucket.width]


class DitSampleReader:
    """Random access to a DiT split (every rank; read-only, fork-safe)."""

    def __init__(self, root: Path, kind: str = "pixels"):
        self.shards = ShardedSampleReader(root, missing_hint="build it with `python tools/make_dit_latents.py` or "
                                          "set data.path: null for the embedded shapes data")
        self.root = Path(root)
        self.kind = kind

    def __len__(self) -> int:
        return len(self.shards)

    def metadata(self, idx: int) -> dict[str, Any]:
        """JSON member only (no decode); BadSampleError if unreadable or incomplete."""
        return self.shards.read_metadata(idx, required=REQUIRED_FIELDS)

    def load(self, idx: int, bucket: Bucket, need_text_states: bool) -> DitSample:
        """Decode sample ``idx`` at ``bucket`` size. Raises BadSampleError."""
        loc, shard_path, members = self.shards.read_members(idx)

        def bad(reason: str) -> BadSampleError:
            return BadSampleError(loc.id, shard_path, reason)

        try:
            meta = json.loads(members["json"].decode("utf-8"))
        except (KeyError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad(f"corrupt or missing json member: {exc}") from exc
        caption = meta.get("caption")
        if not isinstance(caption, str) or not caption.strip():
            raise bad("missing caption (json field 'caption' absent or empty)")
        if self.kind == "latents":
            data = torch.from_numpy(self._array(members, "latent.npy", bad).astype(np.float32))
            if data.ndim != 3 or data.shape[1] < bucket.height or data.shape[2] < bucket.width:
                raise bad(f"latent of shape {tuple(data.shape)} does not cover bucket {bucket.height}x{bucket.width}")
            data = _resize_latent(data, bucket)
        else:
            if "png" not in members:
                raise bad("member 'png' missing")
            try:
                with Image.open(io.BytesIO(members["png"])) as img:
                    img = resize_cover_crop(img.convert("RGB"), bucket)
                    arr = np.asarray(img, dtype=np.float32)
            # PIL reports malformed files with many exception types.
            except Exception as exc:  # noqa: BLE001
                raise bad(f"corrupt image member 'png': {type(exc).__name__}: {exc}") from exc
            data = torch.from_numpy(arr / 127.5 - 1.0).permute(2, 0, 1).contiguous()
        text_states = None
        if need_text_states:
            text_states = torch.from_numpy(self._array(members, "text.npy", bad).astype(np.float32))
        return DitSample(int(meta["id"]), data, caption.strip(), text_states)

    @staticmethod
    def _array(members: dict[str, bytes], name: str, bad) -> np.ndarray:
        if name not in members:
            raise bad(f"member {name!r} missing")
        try:
            return np.load(io.BytesIO(members[name]), allow_pickle=False)
        except Exception as exc:  # noqa: BLE001 - numpy raises ValueError/OSError/EOFError on bad bytes
            raise bad(f"corrupt array member {name!r}: {type(exc).__name__}: {exc}") from exc
