"""Integrity checks of a shard set (:mod:`megascale_omni.data.shards`).

What is fatal and what is a bad sample:

* **Fatal** (:class:`~megascale_omni.data.errors.DataFileError`, exit 3):
  ``index.json`` missing, not JSON or not matching the schema below
  (:func:`validate_index_doc`); a shard that is missing, or whose size or
  sha256 differs from ``index.json`` (:func:`verify_shard`). The set as a
  whole cannot be trusted: a byte flipped on disk may still decode (a PNG
  into other pixels), so no sample of that shard is safe to train on and
  skipping the whole shard would silently drop a slice of the data.
* **Bad sample** (skipped and counted against ``data.max_bad_sample_fraction``):
  a member of a shard whose checksum *is* right but whose content is wrong,
  i.e. the sample was written corrupt: an image failing
  :func:`decode_image_rgb`, wrong JSON fields or types, a missing member.

Image members hold the source file's bytes (JPEG, PNG or WebP, never
re-encoded). A JPEG has no checksum of its own, so the shard's size and
sha256 in ``index.json`` are what guard its bytes: a flipped byte that still
decodes into other pixels is caught when the shard is first opened.

Both are pure functions of the bytes on disk, so every rank decides alike.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from megascale_omni.data.costs import IMAGE_FORMATS, IMAGE_SUFFIXES, validate_cost_fields
from megascale_omni.data.errors import DataFileError

#: Fix offered for a broken ``index.json``.
INDEX_FIX = ("rebuild the set (tools/make_shapes_dataset.py, tools/make_dit_latents.py) or re-index its "
             "shards with megascale_omni.data.shard_writer.index_shards(<split dir>)")
#: Fix offered for a shard that does not match ``index.json``.
SHARD_FIX = ("restore the shard from its source or rebuild the set; if it was changed on purpose, "
             "re-index with megascale_omni.data.shard_writer.index_shards(<split dir>)")

_TAR_BLOCK = 512
_HASH_CHUNK = 4 << 20  # bytes per pread while hashing a shard
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _is_int(value: Any, minimum: int | None = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def validate_index_doc(doc: Any, path: Path, format_versions: Sequence[int]) -> None:
    """Check a parsed ``index.json`` against the schema written by
    :func:`megascale_omni.data.shard_writer.index_shards`.

    Schema: ``{"format_version": int, "num_samples": int, "shards": [{"name":
    str (a file name, no directory), "num_samples": int, "size": int,
    "sha256": 64 lowercase hex}], "samples": [{"id": int, "key": str,
    "shard": int, "members": {suffix: [data offset, size]}}]}``, all ints
    non-negative (``id`` any int); ``num_samples`` equals the sample count
    and each shard's ``num_samples`` the samples that name it; keys are
    unique; every member's data lies inside its shard after a 512-byte tar
    header, at a 512-byte boundary. Format 2 adds ``"cost_basis"`` and a
    ``"cost"`` per sample (:func:`~megascale_omni.data.costs.validate_cost_fields`).

    Raises:
        DataFileError: naming ``path`` and the first offending entry.
    """
    def bad(problem: str) -> DataFileError:
        return DataFileError(path, f"malformed shard index: {problem}", INDEX_FIX)

    if not isinstance(doc, dict):
        raise bad(f"top level is a {type(doc).__name__}, expected an object")
    version = doc.get("format_version")
    if isinstance(version, bool) or version not in format_versions:
        raise DataFileError(path, f"unsupported shard index format_version {version!r} "
                            f"(this code reads {', '.join(map(str, format_versions))})", INDEX_FIX)
    sample_fields = {"id", "key", "shard", "members"} | ({"cost"} if version >= 2 else set())
    for name, kind in (("num_samples", int), ("shards", list), ("samples", list)):
        if name not in doc:
            raise bad(f"field {name!r} missing")
        if not isinstance(doc[name], kind) or (kind is int and not _is_int(doc[name])):
            raise bad(f"field {name!r} is {doc[name]!r:.60}, expected a {'non-negative int' if kind is int else 'list'}")
    shards, samples = doc["shards"], doc["samples"]
    for i, s in enumerate(shards):
        where = f"shards[{i}]"
        if not isinstance(s, dict) or set(s) != {"name", "num_samples", "size", "sha256"}:
            raise bad(f"{where} must be an object with exactly name, num_samples, size, sha256")
        name = s["name"]
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
            raise bad(f"{where}.name {name!r} is not a plain file name")
        if not _is_int(s["num_samples"]) or not _is_int(s["size"]):
            raise bad(f"{where} num_samples/size must be non-negative ints")
        if not isinstance(s["sha256"], str) or not _SHA256.fullmatch(s["sha256"]):
            raise bad(f"{where}.sha256 {s['sha256']!r:.80} is not 64 lowercase hex digits")
    if doc["num_samples"] != len(samples):
        raise bad(f"num_samples={doc['num_samples']} but {len(samples)} samples are listed")
    per_shard = [0] * len(shards)
    keys: set[str] = set()
    for i, s in enumerate(samples):
        where = f"samples[{i}]"
        if not isinstance(s, dict) or set(s) != sample_fields:
            raise bad(f"{where} must be an object with exactly {', '.join(sorted(sample_fields))}")
        if not _is_int(s["id"], minimum=None) or not isinstance(s["key"], str) or not s["key"]:
            raise bad(f"{where} needs an int id and a non-empty str key")
        if s["key"] in keys:
            raise bad(f"{where}.key {s['key']!r} appears twice")
        keys.add(s["key"])
        if not _is_int(s["shard"]) or s["shard"] >= len(shards):
            raise bad(f"{where}.shard {s['shard']!r} is not a shard number (0..{len(shards) - 1})")
        per_shard[s["shard"]] += 1
        members, shard_size = s["members"], shards[s["shard"]]["size"]
        if not isinstance(members, dict) or not members:
            raise bad(f"{where}.members must be a non-empty object")
        for suffix, loc in members.items():
            if not (isinstance(loc, list) and len(loc) == 2 and _is_int(loc[0], _TAR_BLOCK) and _is_int(loc[1])
                    and loc[0] % _TAR_BLOCK == 0 and loc[0] + loc[1] <= shard_size):
                raise bad(f"{where}.members[{suffix!r}]={loc!r:.60} is not a [data offset, size] inside "
                          f"{shards[s['shard']]['name']} ({shard_size} bytes)")
    for i, (s, n) in enumerate(zip(shards, per_shard)):
        if s["num_samples"] != n:
            raise bad(f"shards[{i}] ({s['name']}) says num_samples={s['num_samples']} but {n} samples name it")
    if version >= 2:
        validate_cost_fields(doc, bad)


def sha256_of(path: Path) -> str:
    """Hex sha256 of the file at ``path`` (what ``index.json`` records per shard)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_shard(fd: int, path: Path, size: int, sha256: str) -> None:
    """Check the open shard ``fd`` against its ``index.json`` entry: size in
    bytes, then the sha256 of every byte (read with ``pread``, so the fd's
    offset is untouched). Costs one sequential read of the shard.

    Raises:
        DataFileError: naming ``path``, on a size or checksum mismatch.
    """
    actual = os.fstat(fd).st_size
    if actual != size:
        raise DataFileError(path, f"shard is {actual} bytes but index.json says {size} "
                            f"(truncated or rewritten after indexing)", SHARD_FIX)
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        try:
            block = os.pread(fd, min(_HASH_CHUNK, size - offset), offset)
        except OSError as exc:
            raise DataFileError(path, f"shard unreadable at byte {offset} ({exc.strerror})", SHARD_FIX) from None
        if not block:
            break
        digest.update(block)
        offset += len(block)
    if digest.hexdigest() != sha256:
        raise DataFileError(path, f"shard sha256 {digest.hexdigest()[:16]}... differs from index.json's "
                            f"{sha256[:16]}... (corrupted or changed after indexing)", SHARD_FIX)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png_chunks(data: bytes) -> None:
    """Walk the chunks of a PNG (``data`` starts with :data:`PNG_SIGNATURE`)
    up to ``IEND``, checking each one's CRC-32.

    PIL checks chunk CRCs only in ``verify()``, which consumes the image, so
    the pixels would need a second parse; this walk costs a few
    microseconds (zlib's CRC in C) and lets one ``Image.open`` do the rest.

    Raises:
        ValueError: a chunk that runs past the end, fails its CRC, or no ``IEND``.
    """
    view, pos, size = memoryview(data), len(PNG_SIGNATURE), len(data)
    while pos + 12 <= size:
        (length,) = struct.unpack_from(">I", data, pos)
        end = pos + 8 + length
        kind = bytes(view[pos + 4:pos + 8]).decode("latin-1")
        if end + 4 > size:
            raise ValueError(f"does not decode: chunk {kind} at byte {pos} runs past the end (truncated)")
        if zlib.crc32(view[pos + 4:end]) != struct.unpack_from(">I", data, end)[0]:
            raise ValueError(f"does not decode: chunk {kind} at byte {pos} fails its CRC")
        if kind == "IEND":
            return
        pos = end + 4
    raise ValueError("does not decode: no IEND chunk (truncated)")


#: Pixel modes of a stored image that convert to 8-bit RGB without loss of
#: meaning (PIL's ``convert("RGB")``, as LLaVA's own loader does: alpha is
#: dropped, grey and palette expanded, CMYK/YCbCr converted). 16-bit and
#: float modes are refused: PIL clips them instead of scaling.
RGB_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr")


def decode_image_rgb(data: bytes, fmt: str, modes: Sequence[str] = RGB_MODES) -> np.ndarray:
    """Strictly decode an image member declared (by its suffix) to be of
    PIL format ``fmt``: a PNG's every chunk passes its CRC
    (:func:`check_png_chunks`: a flipped byte in the pixel data often still
    inflates into other pixels), the bytes are of format ``fmt``, of a mode in
    ``modes``, fully decodable (a truncated JPEG fails here) and at least
    1x1. Returns np.uint8 ``[H, W, 3]`` (converted to RGB).

    Raises:
        ValueError: saying which check failed.
    """
    if data[:len(PNG_SIGNATURE)] == PNG_SIGNATURE:
        check_png_chunks(data)
    array = None
    try:
        with Image.open(io.BytesIO(data)) as img:
            found, mode = img.format, img.mode
            if found in IMAGE_FORMATS:  # the format it is stored as (MPO: a JPEG)
                found = IMAGE_SUFFIXES[IMAGE_FORMATS[found]]
            if found == fmt and mode in modes:
                img.load()
                array = np.asarray(img if mode == "RGB" else img.convert("RGB"), dtype=np.uint8).copy()
    # PIL signals malformed input with many types (OSError, SyntaxError,
    # zlib.error, DecompressionBombError, ...); any of them means corrupt.
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"does not decode: {type(exc).__name__}: {exc}") from exc
    if found != fmt:
        raise ValueError(f"is {found}, expected {fmt}")
    if array is None:
        raise ValueError(f"has mode {mode}, expected 8-bit {'RGB' if tuple(modes) == ('RGB',) else ', '.join(modes)}")
    if array.ndim != 3 or array.shape[2] != 3 or array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"decodes to shape {array.shape}, expected [H, W, 3] with H, W >= 1")
    return array


def decode_png_rgb(data: bytes) -> np.ndarray:
    """:func:`decode_image_rgb` of a PNG that must already be 8-bit RGB (the
    DiT image members, and what shards written before source bytes held)."""
    return decode_image_rgb(data, "PNG", ("RGB",))
