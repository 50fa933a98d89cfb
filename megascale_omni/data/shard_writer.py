"""Writing and indexing shard sets in the format of :mod:`megascale_omni.data.shards`.

:func:`write_shards` encodes :class:`~megascale_omni.data.sample.Sample` objects,
:func:`write_member_shards` writes already-encoded records (other families'
members), and :func:`index_shards` (re)builds ``index.json`` for the tars of
a split directory: member offsets and sizes, per-shard sizes and sha256, and
per-sample costs. Writes are reproducible: tar headers carry fixed
mtime/uid/gid/owner names, JSON is canonical, source image bytes are stored
as they are and PNG encoding (of images given as arrays) is deterministic
for a given zlib, so equal samples give byte-identical shards.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import webdataset
from PIL import Image

from megascale_omni.data.costs import (
    IMAGE_FORMATS,
    PNG_HEADER_BYTES,
    Coster,
    image_members,
    is_image_member,
    is_video_member,
    sample_cost,
    video_members,
)
from megascale_omni.data.integrity import sha256_of
from megascale_omni.data.sample import Sample
from megascale_omni.data.shards import (
    FORMAT_VERSION,
    INDEX_FILENAME,
    VIDEO_FORMAT_VERSION,
    SHARD_PREFIX,
    SampleLocation,
    ShardIndex,
    ShardInfo,
)
from megascale_omni.utils.files import atomic_write_text

logger = logging.getLogger(__name__)


def encode_image_png(image: np.ndarray) -> bytes:
    """np.uint8 ``[H, W, 3]`` -> PNG bytes (deterministic, lossless)."""
    buf = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def encode_sample(sample: Sample, sources: Optional[Sequence[tuple[str, bytes]]] = None,
                  video_sources: Optional[Sequence[Sequence[tuple[str, bytes]]]] = None) -> dict[str, bytes]:
    """Member suffix -> bytes for one sample (format: :mod:`megascale_omni.data.shards`).

    ``sources``: per image, ``(PIL format name, the file's bytes)`` (a key of
    :data:`~megascale_omni.data.costs.IMAGE_FORMATS`), stored as they are in
    ``<i>.jpg|png|webp``; the caller has decoded them into ``sample.images``
    (``tools/ingest_llava.py`` does). Without: each image is PNG-encoded.
    ``video_sources``: the same per frame of each video (``v<j>.<f>.<suffix>``);
    without: each frame is PNG-encoded.
    """
    sample.validate()
    members = {"json": json.dumps(sample.metadata(), sort_keys=True, separators=(",", ":")).encode("utf-8")}
    if video_sources is None:
        video_sources = [[("PNG", encode_image_png(frame)) for frame in video] for video in sample.videos]
    if [len(v) for v in video_sources] != [len(v) for v in sample.videos]:
        raise ValueError(f"source frames {[len(v) for v in video_sources]} for videos of "
                         f"{[len(v) for v in sample.videos]} frames")
    for j, frames in enumerate(video_sources):
        for f, (fmt, data) in enumerate(frames):
            members[f"v{j}.{f}.{IMAGE_FORMATS[fmt]}"] = data
    if sources is None:
        for i, image in enumerate(sample.images):
            members[f"{i}.png"] = encode_image_png(image)
        return members
    if len(sources) != len(sample.images):
        raise ValueError(f"{len(sources)} source images for a sample of {len(sample.images)}")
    for i, (fmt, data) in enumerate(sources):
        members[f"{i}.{IMAGE_FORMATS[fmt]}"] = data
    return members


def tar_writer(fileobj) -> webdataset.TarWriter:
    """A writer of one shard into the open binary ``fileobj`` (closing the
    writer does not close ``fileobj``). Fixed metadata, so identical samples
    give byte-identical tars; ``mtime`` is the int 0 because a float makes
    tarfile put a 1 KiB PAX header before every member (2 KiB a sample)."""
    return webdataset.TarWriter(fileobj, user="", group="", mode=0o444, compress=False, encoder=False, mtime=0)


def shard_name(shard_number: int) -> str:
    return f"{SHARD_PREFIX}{shard_number:06d}.tar"


def write_shards(samples: Iterable[Sample], out_dir: str | os.PathLike, samples_per_shard: int,
                 overwrite: bool = False, coster: Optional[Coster] = None) -> ShardIndex:
    """Write ``samples`` to ``out_dir/shard-%06d.tar`` and build ``index.json``.

    Sample keys are their 0-based positions in ``samples``. Shards hold
    ``samples_per_shard`` samples each (the last may hold fewer).
    ``coster``: counts each sample's tokens into the index (see
    :func:`index_shards`); without one the index carries image sizes only.

    Raises:
        FileExistsError: ``out_dir`` already holds shards or an index and
            ``overwrite`` is False (stale shards would silently mix in).
    """
    return write_member_shards((encode_sample(s) for s in samples), out_dir, samples_per_shard, overwrite, coster)


def write_member_shards(records: Iterable[Mapping[str, bytes]], out_dir: str | os.PathLike,
                        samples_per_shard: int, overwrite: bool = False,
                        coster: Optional[Coster] = None) -> ShardIndex:
    """Like :func:`write_shards` for already-encoded records (member suffix ->
    bytes, e.g. ``{"json": ..., "png": ...}``); the ``json`` member should carry
    an integer ``"id"``. Used by sample formats other than :class:`Sample`
    (DiT images and latents, see :mod:`megascale_omni.data.dit.reader`)."""
    if samples_per_shard <= 0:
        raise ValueError(f"samples_per_shard must be > 0, got {samples_per_shard}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(out.glob(f"{SHARD_PREFIX}*.tar"))
    if (out / INDEX_FILENAME).exists():
        stale.append(out / INDEX_FILENAME)
    if stale:
        if not overwrite:
            raise FileExistsError(f"{out} already contains a sharded dataset ({stale[0].name}, ...); "
                                  f"pass overwrite=True or use an empty directory")
        for path in stale:
            path.unlink()

    names: list[str] = []
    fileobj = writer = None
    try:
        for pos, record in enumerate(records):
            if pos % samples_per_shard == 0:
                if writer is not None:
                    writer.close()
                    fileobj.close()
                names.append(shard_name(len(names)))
                fileobj = open(out / names[-1], "wb")
                writer = tar_writer(fileobj)
            writer.write({"__key__": f"{pos:09d}", **record})
    finally:
        if writer is not None:
            writer.close()
            fileobj.close()
    return index_shards(out, names, coster)


def index_shards(out_dir: str | os.PathLike, shard_names: list[str] | None = None,
                 coster: Optional[Coster] = None) -> ShardIndex:
    """Scan tar shards and (re)write ``out_dir/index.json``; returns the index.

    Works for any uncompressed WebDataset tar whose members are ``<key>.<suffix>`` with a
    dot-free key, e.g. shards written by ``webdataset.ShardWriter``. Sample
    ids come from each sample's JSON ``id`` (falling back to its position if
    the JSON is unreadable, so a bad sample is still indexed and reported
    as :class:`BadSampleError` on read, not at index time).

    Each sample's cost (:mod:`megascale_omni.data.costs`) is recorded: the
    sizes of its image members from their headers and, with
    ``coster``, its token count (the index then records
    ``coster.cost_basis()``).

    Args:
        shard_names: file names inside ``out_dir``, in order; default: all
            ``shard-*.tar`` sorted by name.
        coster: counts a sample's tokens from its parsed JSON member.
    """
    out = Path(out_dir)
    if shard_names is None:
        shard_names = sorted(p.name for p in out.glob(f"{SHARD_PREFIX}*.tar"))
    shards: list[ShardInfo] = []
    samples: list[SampleLocation] = []
    seen_keys: set[str] = set()
    metas: list[Any] = []  # parsed JSON member per sample (None: absent or unreadable)
    heads: list[dict[str, bytes]] = []  # first bytes of each image member (enough for its size)
    for shard_number, name in enumerate(shard_names):
        path = out / name
        first = len(samples)
        current_key = None
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, dot, suffix = member.name.partition(".")
                if len(member.name.encode("utf-8")) >= 100:
                    # Longer names need a pax/GNU extension header, and the reader's
                    # header check relies on the plain ustar name field.
                    raise ValueError(f"{path}: member name {member.name!r} must be < 100 bytes")
                if not dot:
                    raise ValueError(f"{path}: member {member.name!r} has no '.<suffix>'")
                if key != current_key:
                    if key in seen_keys:
                        raise ValueError(f"{path}: key {key!r} is not contiguous / appears twice")
                    seen_keys.add(key)
                    current_key = key
                    samples.append(SampleLocation(id=len(samples), key=key, shard=shard_number, members={}))
                    metas.append(None)
                    heads.append({})
                loc = samples[-1]
                loc.members[suffix] = (member.offset_data, member.size)
                if is_image_member(suffix) or (is_video_member(suffix) and suffix.split(".")[1] == "0"):
                    # A PNG's size is in its first bytes; a JPEG's frame header may
                    # follow long EXIF data, so PIL gets the whole member.
                    heads[-1][suffix] = tar.extractfile(member).read(
                        PNG_HEADER_BYTES if suffix.endswith(".png") else -1)
                if suffix == "json":
                    try:
                        metas[-1] = json.loads(tar.extractfile(member).read())
                        sample_id = int(metas[-1]["id"])
                        samples[-1] = SampleLocation(sample_id, loc.key, loc.shard, loc.members)
                    except (ValueError, KeyError, TypeError):
                        pass  # reported with the position as id when the sample is read
        shards.append(ShardInfo(name=name, num_samples=len(samples) - first,
                                size=path.stat().st_size, sha256=sha256_of(path)))
    samples = [replace(loc, cost=sample_cost(
        meta, [(s, head[s]) for s in image_members(loc.members)], coster,
        [(len(frames), frames[0], head.get(frames[0], b"")) for frames in video_members(loc.members)]))
        for loc, meta, head in zip(samples, metas, heads)]
    basis = coster.cost_basis() if coster is not None else None
    # Format 4 only when there are videos: a set without stays readable by format-3 code.
    version = VIDEO_FORMAT_VERSION if any(video_members(s.members) for s in samples) else FORMAT_VERSION
    index = ShardIndex(version, len(samples), shards, samples, basis)
    # Readers never see a half-written index; not fsynced: the index is rebuilt
    # by re-running the writer, and every shard's sha256 in it is checked on read.
    atomic_write_text(out / INDEX_FILENAME, index.to_json())
    logger.info("indexed %d samples in %d shards under %s", len(samples), len(shards), out)
    return index
