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
missing or empty caption, JSON fields of the wrong type, an image that is
not an intact RGB PNG of the size its JSON states, an array that is
unreadable, of the wrong rank, size, channel count or dtype, or holds
NaN/Inf, an image smaller than every bucket. The task excludes (scan) or
the batcher skips them, and counts them. A broken ``dataset.json`` is a
:class:`~megascale_omni.data.errors.DataFileError` (fatal).
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
from megascale_omni.data.errors import DataFileError
from megascale_omni.data.integrity import decode_png_rgb
from megascale_omni.data.shard_writer import write_member_shards
from megascale_omni.data.shards import BadSampleError, ShardedSampleReader
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
    """``root/dataset.json`` (defaults for pixel data with captions when absent).

    Raises DataFileError when it is unreadable, not a JSON object, or its
    ``kind`` / ``in_channels`` / ``text`` are not of the documented values."""
    path = root / DATASET_FILENAME
    if not path.is_file():
        return {"kind": "pixels", "in_channels": 3, "text": "caption"}
    fix = "rewrite it (tools/make_dit_latents.py writes it) or rebuild the set"
    try:
        desc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataFileError(path, f"dataset description unreadable ({exc})", fix) from None
    if not isinstance(desc, dict):
        raise DataFileError(path, f"dataset description is a {type(desc).__name__}, expected an object", fix)
    channels = desc.get("in_channels", 3)
    if (desc.get("kind", "pixels") not in ("pixels", "latents") or desc.get("text", "caption") not in
            ("caption", "precomputed") or not isinstance(channels, int) or isinstance(channels, bool) or channels < 1):
        raise DataFileError(path, "dataset description needs kind pixels|latents, text caption|precomputed "
                            f"and a positive int in_channels; got {desc!r:.120}", fix)
    return desc


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
        """JSON member only (no decode); BadSampleError if unreadable,
        incomplete, ``id`` not an int, ``height``/``width`` not positive ints
        or ``caption`` present but not a str."""
        meta = self.shards.read_metadata(idx, required=REQUIRED_FIELDS)
        problem = _metadata_problem(meta)
        if problem:
            loc = self.shards.index.samples[idx]
            raise BadSampleError(loc.id, self.root / self.shards.index.shards[loc.shard].name, problem)
        return meta

    def load(self, idx: int, bucket: Bucket, need_text_states: bool) -> DitSample:
        """Decode sample ``idx`` at ``bucket`` size. Raises BadSampleError."""
        loc, shard_path, members = self.shards.read_members(idx)

        def bad(reason: str) -> BadSampleError:
            return BadSampleError(loc.id, shard_path, reason)

        try:
            meta = json.loads(members["json"].decode("utf-8"))
        except (KeyError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad(f"corrupt or missing json member: {exc}") from exc
        problem = _metadata_problem(meta)
        if problem:
            raise bad(problem)
        caption = meta.get("caption")
        if not isinstance(caption, str) or not caption.strip():
            raise bad("missing caption (json field 'caption' absent or empty)")
        size = (meta["height"], meta["width"])
        if self.kind == "latents":
            latent = self._array(members, "latent.npy", bad, ndim=3)
            if latent.shape[1:] != size:
                raise bad(f"latent of shape {latent.shape} but json says {size[0]}x{size[1]}")
            data = torch.from_numpy(latent.astype(np.float32))
            if data.shape[1] < bucket.height or data.shape[2] < bucket.width:
                raise bad(f"latent of shape {tuple(data.shape)} does not cover bucket {bucket.height}x{bucket.width}")
            data = _resize_latent(data, bucket)
        else:
            if "png" not in members:
                raise bad("member 'png' missing")
            try:
                arr = decode_png_rgb(members["png"])
            except ValueError as exc:
                raise bad(f"corrupt image member 'png': {exc}") from exc
            if arr.shape[:2] != size:
                raise bad(f"image is {arr.shape[0]}x{arr.shape[1]} but json says {size[0]}x{size[1]}")
            img = np.asarray(resize_cover_crop(Image.fromarray(arr, mode="RGB"), bucket), dtype=np.float32)
            data = torch.from_numpy(img / 127.5 - 1.0).permute(2, 0, 1).contiguous()
        text_states = None
        if need_text_states:
            states = self._array(members, "text.npy", bad, ndim=2)
            if states.shape[0] < 1:
                raise bad("text states 'text.npy' are empty")
            text_states = torch.from_numpy(states.astype(np.float32))
        return DitSample(int(meta["id"]), data, caption.strip(), text_states)

    @staticmethod
    def _array(members: dict[str, bytes], name: str, bad, ndim: int) -> np.ndarray:
        """Member ``name`` as a finite float array of rank ``ndim``; ``bad(reason)`` otherwise."""
        if name not in members:
            raise bad(f"member {name!r} missing")
        try:
            arr = np.load(io.BytesIO(members[name]), allow_pickle=False)
        except Exception as exc:  # noqa: BLE001 - numpy raises ValueError/OSError/EOFError on bad bytes
            raise bad(f"corrupt array member {name!r}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(arr, np.ndarray) or arr.dtype not in (np.float16, np.float32, np.float64):
            raise bad(f"array member {name!r} has dtype {getattr(arr, 'dtype', type(arr))}, expected float16/32/64")
        if arr.ndim != ndim:
            raise bad(f"array member {name!r} has shape {arr.shape}, expected {ndim} dimensions")
        if not np.isfinite(arr).all():
            raise bad(f"array member {name!r} holds NaN or Inf")
        return arr


def _metadata_problem(meta: Any) -> Optional[str]:
    """Why a DiT JSON member is unusable (None if it is fine): see :meth:`DitSampleReader.metadata`."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(meta, dict):
        return f"json member is a {type(meta).__name__}, expected an object"
    if not is_int(meta.get("id")):
        return f"json field 'id'={meta.get('id')!r:.40} is not an int"
    for name in ("height", "width"):
        if not is_int(meta.get(name)) or meta[name] < 1:
            return f"json field {name!r}={meta.get(name)!r:.40} is not a positive int"
    if "caption" in meta and not isinstance(meta["caption"], str):
        return f"json field 'caption'={meta['caption']!r:.40} is not a str"
    return None
