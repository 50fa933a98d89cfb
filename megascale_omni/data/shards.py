"""WebDataset tar shards of :class:`~megascale_omni.data.sample.Sample` with a
byte-offset index for O(1) random access.

On-disk layout of a split directory::

    shard-000000.tar      WebDataset tar: <key>.json, <key>.0.jpg, <key>.1.png, ...
    shard-000001.tar
    index.json            ShardIndex: manifest + per-sample member offsets and costs

Members of sample ``key`` (a zero-padded 9-digit position in the split):

* ``<key>.json``: UTF-8 JSON ``{"id", "kind", "conversation",
  "image_dependent_words", "num_images"}`` (sorted keys, compact separators).
* ``<key>.<i>.<jpg|png|webp>``: image ``i``, ``0 <= i < num_images``: the
  source file's bytes as they are (JPEG, PNG or WebP, never re-encoded; the
  suffix names the format), or an 8-bit RGB PNG for images written from
  arrays. Read as 8-bit RGB (:func:`~megascale_omni.data.integrity.decode_image_rgb`).

The shards are ordinary WebDataset tars (streamable with ``webdataset.WebDataset``);
``index.json`` additionally records, for each member, the byte offset of its
data and its size, so :class:`ShardedSampleReader` reads a sample with one
``pread`` per member and never scans a tar. Format 2 also records each
sample's cost (image sizes, and token counts when written with a coster;
:mod:`megascale_omni.data.costs`), so a planner needs only the index.
Format 3 allows image members other than PNG (``.jpg``, ``.webp``): code
that reads only formats 1 and 2 refuses it with the format number instead
of reporting every image as missing. Format 4 adds videos: members
``<key>.v<j>.<f>.<jpg|png|webp>`` (frame ``f`` of video ``j``, every frame
of a video the same size) and ``num_videos`` in the JSON member; it is
written only for sets with videos, so code that reads formats up to 3
refuses exactly those. Formats 1 (no costs) and 2 (PNG images only) are
still read.

This module holds the format (:class:`ShardIndex`, :func:`decode_sample`)
and the reader; :mod:`megascale_omni.data.shard_writer` writes and indexes
shard sets.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from megascale_omni.data.costs import IMAGE_SUFFIXES, SampleCost, video_members
from megascale_omni.data.errors import DataFileError
from megascale_omni.data.integrity import INDEX_FIX, decode_image_rgb, validate_index_doc, verify_shard
from megascale_omni.data.sample import METADATA_FIELDS, Sample, SampleValidationError, validate_metadata

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
#: The format of a set with video members (written only then).
VIDEO_FORMAT_VERSION = 4
#: Index formats this code reads (1: no per-sample costs; 2: PNG image members only; 4: videos).
READ_FORMAT_VERSIONS = (1, 2, 3, 4)
INDEX_FILENAME = "index.json"
SHARD_PREFIX = "shard-"
_TAR_BLOCK = 512  # a tar member's header is the 512-byte block right before its data


def _header_matches(buf: bytes, name: str, size: int) -> bool:
    """Whether ``buf`` starts with a valid ustar header for ``name`` (a short
    name, no prefix field) of ``size`` bytes: the fields the reader checks on
    every member read, compared in place. ``tarfile.TarInfo.frombuf`` parses
    every field of the header, which was a sixth of a sample's read and
    decode; it still runs when this says no, to name what differs."""
    encoded = name.encode("utf-8")
    if len(encoded) >= 100 or buf[:100] != encoded.ljust(100, b"\0") or buf[345] != 0:
        return False
    try:
        stored_size = int(buf[124:136].rstrip(b"\0 ") or b"0", 8)
        checksum = int(buf[148:156].rstrip(b"\0 ") or b"-1", 8)
    except ValueError:
        return False
    # The checksum counts its own 8-byte field as spaces (0x20).
    return stored_size == size and checksum == sum(buf[:148]) + 8 * 0x20 + sum(buf[156:_TAR_BLOCK])
_REQUIRED_JSON_FIELDS = METADATA_FIELDS
_DEFAULT_MISSING_HINT = (
    "build it with `python tools/make_shapes_dataset.py --out <dataset dir>` "
    "(or megascale_omni.data.shard_writer.write_shards for your own samples)"
)


class BadSampleError(Exception):
    """A stored sample cannot be read or decoded.

    Attributes:
        sample_id: ``Sample.id`` recorded in the index for this sample.
        shard_path: the shard file that holds (or should hold) it.
        reason: human-readable cause (corrupt image, missing field, truncated shard, ...).
    """

    def __init__(self, sample_id: int, shard_path: str | os.PathLike, reason: str):
        self.sample_id = sample_id
        self.shard_path = str(shard_path)
        self.reason = reason
        super().__init__(f"bad sample id={sample_id} in {self.shard_path}: {reason}")

    def __reduce__(self):  # keep the fields when re-raised across DataLoader workers
        return (type(self), (self.sample_id, self.shard_path, self.reason))


class SampleDecodeError(ValueError):
    """Raised by :func:`decode_sample` for malformed member bytes."""


# --------------------------------------------------------------------- index
@dataclass(frozen=True)
class ShardInfo:
    """Manifest entry of one shard file. ``size`` is in bytes."""

    name: str
    num_samples: int
    size: int
    sha256: str


@dataclass(frozen=True)
class SampleLocation:
    """Where sample ``key`` lives: shard number and ``member suffix -> (data offset, size)``
    in bytes; suffixes are ``"json"``, ``"0.jpg"``, ``"1.png"``, ..."""

    id: int
    key: str
    shard: int
    members: dict[str, tuple[int, int]]
    #: None: unknown (a format-1 index, or an image header that is not a PNG's).
    cost: Optional[SampleCost] = None


@dataclass
class ShardIndex:
    """Contents of ``index.json``: the manifest plus one location (and, from
    format 2, one cost) per sample."""

    format_version: int
    num_samples: int
    shards: list[ShardInfo]
    samples: list[SampleLocation] = field(repr=False)
    #: ``{"format", "tokenizer"}`` the samples' token counts are for; None:
    #: no token counts (:mod:`megascale_omni.data.costs`).
    cost_basis: Optional[dict[str, str]] = None

    @property
    def has_costs(self) -> bool:
        """Whether the index records per-sample costs (format 2 and later)."""
        return self.format_version >= 2

    def to_json(self) -> str:
        samples = []
        for s in self.samples:
            entry = {"id": s.id, "key": s.key, "shard": s.shard, "members": {k: list(v) for k, v in s.members.items()}}
            if self.has_costs:
                entry["cost"] = None if s.cost is None else s.cost.to_json()
            samples.append(entry)
        doc = {
            "format_version": self.format_version,
            "num_samples": self.num_samples,
            "shards": [asdict(s) for s in self.shards],
            "samples": samples,
        }
        if self.has_costs:
            doc["cost_basis"] = self.cost_basis
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, path: str | os.PathLike = INDEX_FILENAME) -> "ShardIndex":
        """Parse and validate ``index.json`` text read from ``path``.

        Raises:
            DataFileError: not JSON or not the schema of
                :func:`~megascale_omni.data.integrity.validate_index_doc`; names ``path``.
        """
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFileError(path, f"shard index is not valid JSON ({exc})", INDEX_FIX) from None
        validate_index_doc(doc, Path(path), READ_FORMAT_VERSIONS)
        samples = [
            SampleLocation(id=s["id"], key=s["key"], shard=s["shard"],
                           members={k: (int(v[0]), int(v[1])) for k, v in s["members"].items()},
                           cost=SampleCost.from_json(s.get("cost")))
            for s in doc["samples"]
        ]
        return cls(doc["format_version"], int(doc["num_samples"]), [ShardInfo(**s) for s in doc["shards"]], samples,
                   doc.get("cost_basis"))


# ------------------------------------------------------------------ decode
def decode_sample(members: Mapping[str, bytes]) -> Sample:
    """Inverse of :func:`~megascale_omni.data.shard_writer.encode_sample`. Extra members are ignored.

    Raises:
        SampleDecodeError: missing/corrupt JSON, a field missing or of the
            wrong type (:func:`~megascale_omni.data.sample.validate_metadata`),
            a missing member (or two for one image), or an image failing
            :func:`~megascale_omni.data.integrity.decode_image_rgb` (corrupt,
            truncated, not the format its suffix names); the message says which.
    """
    if "json" not in members:
        raise SampleDecodeError("member 'json' missing")
    try:
        meta = json.loads(members["json"].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SampleDecodeError(f"corrupt json member: {exc}") from exc
    try:
        validate_metadata(meta)
    except SampleValidationError as exc:
        raise SampleDecodeError(str(exc)) from exc
    images = []
    for i in range(meta["num_images"]):
        names = [f"{i}.{suffix}" for suffix in IMAGE_SUFFIXES if f"{i}.{suffix}" in members]
        if len(names) != 1:
            raise SampleDecodeError(f"member '{i}.<jpg|png|webp>' missing (json says num_images={meta['num_images']})" if not names
                                    else f"image {i} has {len(names)} members {names}; expected one")
        name = names[0]
        try:
            images.append(decode_image_rgb(members[name], IMAGE_SUFFIXES[name.rpartition(".")[2]]))
        except ValueError as exc:
            raise SampleDecodeError(f"corrupt image member {name!r}: {exc}") from exc
    videos = [_decode_video(members, j, names) for j, names in enumerate(video_members(members))]
    if len(videos) != meta.get("num_videos", 0):
        raise SampleDecodeError(f"{len(videos)} video(s) among the members but json says "
                                f"num_videos={meta.get('num_videos', 0)}")
    try:
        return Sample.from_dict({**meta, "images": images, "videos": videos})
    except (SampleValidationError, KeyError, TypeError, ValueError) as exc:
        raise SampleDecodeError(f"invalid sample: {exc}") from exc


def _decode_video(members: Mapping[str, bytes], j: int, names: list[str]) -> np.ndarray:
    """Video ``j``'s frames (members ``names``, in frame order) as uint8 ``[F, H, W, 3]``."""
    numbers = [int(n.split(".")[1]) for n in names]
    if not names or names[0].split(".")[0] != f"v{j}" or numbers != list(range(len(names))):
        raise SampleDecodeError(f"video {j}: frame members {names[:4]} are not v{j}.0, v{j}.1, ... in order")
    frames = []
    for name in names:
        try:
            frames.append(decode_image_rgb(members[name], IMAGE_SUFFIXES[name.rpartition(".")[2]]))
        except ValueError as exc:
            raise SampleDecodeError(f"corrupt video frame member {name!r}: {exc}") from exc
        if frames[-1].shape != frames[0].shape:
            raise SampleDecodeError(f"video {j}: frame {name!r} is {frames[-1].shape[:2]}, frame 0 "
                                    f"{frames[0].shape[:2]}")
    return np.stack(frames)


# -------------------------------------------------------------------- reader
class ShardedSampleReader:
    """Random access to a split directory written by :func:`~megascale_omni.data.shard_writer.write_shards`.

    ``reader[i]`` reads each member of sample ``i`` with one ``os.pread`` at
    the offset recorded in ``index.json`` and decodes it (JPEG, PNG or WebP
    -> np.uint8 ``[H, W, 3]``). Shard file descriptors are opened lazily and cached. pread
    does not move a shared file offset, so descriptors inherited through
    ``fork`` stay safe; pickling drops them (they are reopened on demand).

    Integrity (see :mod:`megascale_omni.data.integrity`): with ``verify``
    (default) the first open of a shard in a process checks its size and
    sha256 against ``index.json`` (one sequential read of the shard; a
    reader's scan of every sample's metadata therefore hashes the whole set
    once). Every member read also checks the tar header in front of the data
    (name, size, checksum), so an index that does not describe its shard is
    reported instead of silently yielding wrong bytes. :attr:`index_digest`
    identifies the split's content without reading a shard
    (:mod:`megascale_omni.data.identity`).

    Raises (from ``__init__``):
        FileNotFoundError: ``root`` is not a directory; the message names
            the path and how to build the dataset.
        DataFileError: ``root/index.json`` is missing, unreadable, not JSON
            or malformed (fatal: the split cannot be read at all).
    Raises (from ``__getitem__`` / ``read_metadata`` / ``read_members``):
        IndexError: out-of-range index.
        DataFileError: the sample's shard is missing, unreadable, or its
            size or sha256 differs from ``index.json`` (fatal).
        BadSampleError: a sample of an intact shard that cannot be used:
            a member missing or not where the index says, corrupt JSON or
            image, or a sample violating the Sample contract.
    """

    def __init__(self, root: str | os.PathLike, missing_hint: str = _DEFAULT_MISSING_HINT, verify: bool = True):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"dataset directory {str(self.root)!r} does not exist; {missing_hint}")
        index_path = self.root / INDEX_FILENAME
        if not index_path.is_file():
            raise DataFileError(index_path, "shard index missing", missing_hint)
        try:
            raw = index_path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataFileError(index_path, f"shard index unreadable ({exc})", INDEX_FIX) from None
        self.index = ShardIndex.from_json(text, index_path)
        #: sha256 hex of the ``index.json`` bytes: the split's content identity
        #: (every shard's size and sha256, every sample's location and cost).
        self.index_digest = hashlib.sha256(raw).hexdigest()
        self.verify = verify
        self._fds: dict[int, int] = {}
        #: Shards whose checksum this process has checked (kept across pickling: same files).
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return self.index.num_samples

    def __getitem__(self, idx: int) -> Sample:
        loc, shard_path, members = self.read_members(idx)
        try:
            return decode_sample(members)
        except SampleDecodeError as exc:
            raise BadSampleError(loc.id, shard_path, str(exc)) from exc

    def read_members(self, idx: int) -> tuple[SampleLocation, Path, dict[str, bytes]]:
        """Raw bytes of every member of sample ``idx`` (no decoding), with its
        location and shard path for error reports. Raises IndexError or BadSampleError."""
        idx = operator.index(idx)
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sample index {idx} out of range for {n} samples in {self.root}")
        loc = self.index.samples[idx]
        shard_path = self.root / self.index.shards[loc.shard].name
        members = {suffix: self._read_member(loc, shard_path, suffix, offset, size)
                   for suffix, (offset, size) in loc.members.items()}
        return loc, shard_path, members

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def resolve(self, idx: int) -> tuple["ShardedSampleReader", int]:
        """The reader holding sample ``idx`` and its index there: this one
        (a :class:`~megascale_omni.data.blend.ConcatReader` answers with a source's)."""
        return self, idx

    def read_metadata(self, idx: int, required: Iterable[str] = _REQUIRED_JSON_FIELDS) -> dict[str, Any]:
        """Only the JSON member of sample ``idx`` (no image decode): what a
        planner needs to compute lengths and costs for a whole split quickly.

        Raises BadSampleError like ``__getitem__`` for unreadable or corrupt
        JSON, or when a field of ``required`` is missing.
        """
        loc = self.index.samples[operator.index(idx)]
        shard_path = self.root / self.index.shards[loc.shard].name
        if "json" not in loc.members:
            raise BadSampleError(loc.id, shard_path, "member 'json' missing")
        offset, size = loc.members["json"]
        raw = self._read_member(loc, shard_path, "json", offset, size)
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadSampleError(loc.id, shard_path, f"corrupt json member: {exc}") from exc
        if not isinstance(meta, dict):
            raise BadSampleError(loc.id, shard_path, "json member is not an object")
        missing = [f for f in required if f not in meta]
        if missing:
            raise BadSampleError(loc.id, shard_path, f"json member lacks field(s) {missing}")
        return meta

    def _fd(self, loc: SampleLocation, shard_path: Path) -> int:
        fd = self._fds.get(loc.shard)
        if fd is None:
            try:
                fd = os.open(shard_path, os.O_RDONLY)
            except OSError as exc:
                raise DataFileError(shard_path, f"shard missing or unreadable ({exc.strerror})",
                                    "restore it or rebuild the set") from None
            if self.verify and loc.shard not in self._verified:
                info = self.index.shards[loc.shard]
                try:
                    verify_shard(fd, shard_path, info.size, info.sha256)
                except BaseException:
                    os.close(fd)
                    raise
                self._verified.add(loc.shard)
            # setdefault: if another thread won the race, use its fd and drop ours.
            kept = self._fds.setdefault(loc.shard, fd)
            if kept != fd:
                os.close(fd)
            fd = kept
        return fd

    def _read_member(self, loc: SampleLocation, shard_path: Path, suffix: str, offset: int, size: int) -> bytes:
        fd = self._fd(loc, shard_path)
        start = offset - _TAR_BLOCK
        try:
            buf = os.pread(fd, _TAR_BLOCK + size, start)
        except OSError as exc:
            raise BadSampleError(loc.id, shard_path, f"reading member {suffix!r} failed: {exc}") from exc
        if len(buf) < _TAR_BLOCK + size:
            raise BadSampleError(loc.id, shard_path,
                                 f"truncated shard: member {suffix!r} needs bytes [{start}, {offset + size}) "
                                 f"but the file has only {start + len(buf)}")
        expected_name = f"{loc.key}.{suffix}"
        if _header_matches(buf, expected_name, size):
            return buf[_TAR_BLOCK:]
        try:  # the slow path names what differs
            header = tarfile.TarInfo.frombuf(buf[:_TAR_BLOCK], "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            header = None
            detail = f"invalid tar header ({exc})"
        else:
            detail = f"header says {header.name!r} with {header.size} bytes"
        if header is None or header.name != expected_name or header.size != size:
            raise BadSampleError(loc.id, shard_path,
                                 f"index does not match shard at member {expected_name!r} "
                                 f"({detail}); the shard changed after indexing - "
                                 f"rebuild it or re-run index_shards()")
        return buf[_TAR_BLOCK:]

    def verify_shards(self) -> dict[str, str]:
        """Check every shard's size and sha256 against the manifest (reads
        every byte). Returns ``{shard name: problem}`` for each bad shard
        (empty if all good); ``"missing"`` for a shard that cannot be opened."""
        problems = {}
        for info in self.index.shards:
            try:
                fd = os.open(self.root / info.name, os.O_RDONLY)
            except OSError:
                problems[info.name] = "missing"
                continue
            try:
                verify_shard(fd, self.root / info.name, info.size, info.sha256)
            except DataFileError as err:
                problems[info.name] = err.problem
            finally:
                os.close(fd)
        return problems

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> "ShardedSampleReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing useful to do
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fds"] = {}  # descriptor numbers mean nothing in another process
        return state

    def __repr__(self) -> str:
        return f"ShardedSampleReader({str(self.root)!r}, samples={len(self)}, shards={len(self.index.shards)})"
