"""Per-sample costs carried by ``index.json`` (format 2), so a planner lays out
packed rows from the index alone instead of opening every sample.

Each index sample entry has ``"cost"``: ``null`` (unknown: a planner reads
the sample) or ``{"tokens": int | null, "images": [[height, width], ...]}``:

* ``images``: the pixel size of each image member (``<i>.png``, ``<i>.jpg``,
  ``<i>.webp``), in order, read from the image's header at index time (no
  decode). A tiled (anyres) image's view count follows from it.
* ``tokens``: the sample's encoded length *without* image placeholders
  (text, special and template tokens only), under the index's
  ``cost_basis`` ``{"format": data.format, "tokenizer": fingerprint}``;
  ``null`` when the index was written without a tokenizer or the sample
  could not be encoded (it is then read, and excluded, at plan time as
  before). The encoded length for the model is ``tokens + tokens_per_image
  * views``, ``views`` = 1 per image (``num_views`` per image for anyres).

A sample with videos (index format 4) also has ``"videos": [[frames,
height, width], ...]``: per video, its stored frames (members
``v<j>.<f>.<jpg|png|webp>``) and their pixel size, from the first frame's
header. A video costs ``vision.video_tokens(min(frames, data.video_frames))``
LM tokens (:func:`video_tokens`) and that many tower inputs, without decoding anything.

A ``cost`` is ``null`` when an image member's header is not readable as
the format its suffix names (the sample is bad and is reported when read).

Who computes ``tokens``: a :class:`Coster` handed to
:func:`~megascale_omni.data.shard_writer.index_shards` (the LLaVA encoders are
costers); the index records its :meth:`Coster.cost_basis` so a run with
another tokenizer or format ignores the counts instead of trusting them.
"""

from __future__ import annotations

import hashlib
import io
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from PIL import Image

#: Member suffix (``<i>.<suffix>``) -> PIL's name of the format it holds.
#: Images are stored as their source bytes.
IMAGE_SUFFIXES = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}
#: PIL's format name -> the member suffix of an image PIL identifies so. MPO
#: (a camera's multi-picture JPEG) is a JPEG whose first picture every JPEG
#: decoder shows, and what PIL decodes as its frame 0.
IMAGE_FORMATS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Bytes of a PNG needed for its size: signature, IHDR length and type, width, height.
PNG_HEADER_BYTES = 24
_IMAGE_MEMBER = re.compile(r"(\d+)\.(" + "|".join(IMAGE_SUFFIXES) + ")")
#: A video frame's member: ``v<video>.<frame>.<suffix>``.
_VIDEO_MEMBER = re.compile(r"v(\d+)\.(\d+)\.(" + "|".join(IMAGE_SUFFIXES) + ")")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class Coster(Protocol):
    """What :func:`~megascale_omni.data.shard_writer.index_shards` needs to count a sample's tokens."""

    def cost_basis(self) -> dict[str, str]:
        """``{"format": str, "tokenizer": 64 hex digits}``: what the counts are valid for."""

    def text_tokens(self, meta: Mapping[str, Any]) -> int:
        """Encoded length of the sample with JSON member ``meta``, image
        placeholders excluded. Raises ValueError/KeyError/TypeError (or a
        subclass such as BadSampleError) for a sample that cannot be encoded."""


@dataclass(frozen=True)
class SampleCost:
    """One index entry's ``cost`` (see module docstring). ``image_hw``:
    ``(height, width)`` pixels per image; ``tokens``: None = unknown;
    ``video_fhw``: ``(frames, height, width)`` per video."""

    tokens: Optional[int]
    image_hw: tuple[tuple[int, int], ...]
    video_fhw: tuple[tuple[int, int, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        doc = {"tokens": self.tokens, "images": [list(hw) for hw in self.image_hw]}
        if self.video_fhw:
            doc["videos"] = [list(fhw) for fhw in self.video_fhw]
        return doc

    @classmethod
    def from_json(cls, doc: Optional[Mapping[str, Any]]) -> Optional["SampleCost"]:
        if doc is None:
            return None
        return cls(doc["tokens"], tuple((int(h), int(w)) for h, w in doc["images"]),
                   tuple((int(f), int(h), int(w)) for f, h, w in doc.get("videos", ())))


def frames_read(cost: Optional[SampleCost], video_frames: int) -> tuple[int, ...]:
    """Frames read of each of a sample's videos: ``min(frames, video_frames)``
    (every stored frame when ``video_frames`` is 0). Empty without videos or cost."""
    if cost is None:
        return ()
    return tuple(min(f, video_frames) if video_frames else f for f, _, _ in cost.video_fhw)


def video_tokens(cost: Optional[SampleCost], video_frames: int, tokens_of: Callable[[int], int]) -> int:
    """LM tokens of a sample's videos: ``tokens_of(frames read)`` summed over
    its videos (``tokens_of``: :meth:`~megascale_omni.config.VisionConfig.video_tokens`,
    the rule the model lays videos out by). 0 without videos or cost."""
    return sum(tokens_of(f) for f in frames_read(cost, video_frames))


def fingerprint(*parts: str) -> str:
    """sha256 hex of ``parts`` (length-prefixed, so no two part lists collide)."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def png_size(head: bytes) -> Optional[tuple[int, int]]:
    """``(height, width)`` from the first :data:`PNG_HEADER_BYTES` bytes of a
    PNG, or None if they are not a PNG signature followed by an IHDR chunk."""
    if len(head) < PNG_HEADER_BYTES or head[:8] != _PNG_SIGNATURE or head[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", head[16:24])
    return (height, width) if width > 0 and height > 0 else None


def image_size(suffix: str, data: bytes) -> Optional[tuple[int, int]]:
    """``(height, width)`` of an image member from its first bytes (a PNG:
    :data:`PNG_HEADER_BYTES`; a JPEG or WebP: the whole member, whose header
    PIL parses without decoding), or None if they are not a header of the
    format ``<i>.<suffix>`` names."""
    if suffix.endswith(".png"):
        return png_size(data)
    fmt = IMAGE_SUFFIXES.get(suffix.rpartition(".")[2])
    try:
        with Image.open(io.BytesIO(data), formats=[fmt] if fmt else []) as img:
            width, height = img.size
    except Exception:  # noqa: BLE001 - PIL reports a bad header with many types; any means unknown
        return None
    return (height, width) if width > 0 and height > 0 else None


def is_image_member(suffix: str) -> bool:
    """Whether member suffix ``suffix`` is an image's (``<i>.png|jpg|webp``)."""
    return _IMAGE_MEMBER.fullmatch(suffix) is not None


def is_video_member(suffix: str) -> bool:
    """Whether member suffix ``suffix`` is a video frame's (``v<j>.<f>.png|jpg|webp``)."""
    return _VIDEO_MEMBER.fullmatch(suffix) is not None


def video_members(members: Mapping[str, Any]) -> list[list[str]]:
    """The frame member suffixes of a sample's videos: one list per video (by
    video number), each in frame order. Numbers are not checked to be
    contiguous here (the reader does)."""
    found: dict[int, list[tuple[int, str]]] = {}
    for s in members:
        if m := _VIDEO_MEMBER.fullmatch(s):
            found.setdefault(int(m.group(1)), []).append((int(m.group(2)), s))
    return [[s for _, s in sorted(found[j])] for j in sorted(found)]


def image_members(members: Mapping[str, Any]) -> list[str]:
    """The image member suffixes (``<i>.png|jpg|webp``) of a sample, by image number."""
    found = sorted((int(m.group(1)), s) for s in members if (m := _IMAGE_MEMBER.fullmatch(s)))
    return [s for _, s in found]


def sample_cost(meta: Any, images: list[tuple[str, bytes]], coster: Optional[Coster],
                videos: Sequence[tuple[int, str, bytes]] = ()) -> Optional[SampleCost]:
    """The cost entry of one sample from its parsed JSON member (None if
    unreadable), its image members' ``(suffix, first bytes)`` in image
    order (:func:`image_size` says how many bytes) and, per video, ``(frames,
    first frame's suffix, its first bytes)``."""
    sizes = [image_size(suffix, data) for suffix, data in images]
    video_hw = [image_size(suffix, data) for _, suffix, data in videos]
    if any(s is None for s in sizes + video_hw):
        return None
    tokens = None
    if coster is not None and isinstance(meta, dict) and meta.get("num_images") == len(sizes):
        try:
            tokens = int(coster.text_tokens(meta))
        except (ValueError, KeyError, TypeError):
            tokens = None  # read and excluded at plan time, with its reason
    return SampleCost(tokens, tuple(sizes), tuple((f, *hw) for (f, _, _), hw in zip(videos, video_hw)))


def validate_cost_fields(doc: Mapping[str, Any], bad) -> None:
    """Check a format-2 index's ``cost_basis`` and every sample's ``cost``
    (see module docstring); ``bad(problem)`` builds the error to raise."""
    basis = doc.get("cost_basis", "absent")
    if basis == "absent":
        raise bad("field 'cost_basis' missing")
    if basis is not None and not (
        isinstance(basis, dict) and set(basis) == {"format", "tokenizer"} and isinstance(basis["format"], str)
        and isinstance(basis["tokenizer"], str) and _SHA256.fullmatch(basis["tokenizer"])
    ):
        raise bad(f"cost_basis {basis!r:.80} must be null or {{format: str, tokenizer: 64 lowercase hex}}")
    for i, s in enumerate(doc["samples"]):
        cost = s["cost"]
        if cost is None:
            continue
        where = f"samples[{i}].cost"
        if not isinstance(cost, dict) or set(cost) - {"videos"} != {"tokens", "images"}:
            raise bad(f"{where} must be null or an object with exactly tokens, images (and videos)")
        tokens, images = cost["tokens"], cost["images"]
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
            raise bad(f"{where}.tokens {tokens!r:.40} is not null or a non-negative int")
        if tokens is not None and basis is None:
            raise bad(f"{where}.tokens is set but cost_basis is null (counts for an unknown tokenizer)")
        if not isinstance(images, list) or not all(
            isinstance(hw, list) and len(hw) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                          for x in hw) for hw in images
        ):
            raise bad(f"{where}.images {images!r:.60} must be a list of [height, width] positive ints")
        num_members = len(image_members(s["members"]))
        if len(images) != num_members:
            raise bad(f"{where}.images lists {len(images)} sizes for {num_members} image members")
        videos = cost.get("videos", [])
        if not isinstance(videos, list) or not all(
            isinstance(fhw, list) and len(fhw) == 3 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                           for x in fhw) for fhw in videos
        ):
            raise bad(f"{where}.videos {videos!r:.60} must be a list of [frames, height, width] positive ints")
        frames = [len(v) for v in video_members(s["members"])]
        if [f for f, _, _ in videos] != frames:
            raise bad(f"{where}.videos lists frames {[f for f, _, _ in videos]} but the members hold {frames}")
