"""LLaVA-format JSON, caption JSONL and text-only JSONL -> our WebDataset shards.

Inputs (any mix, read in this order; every record gets a global position):

- ``llava_json``: a JSON array in LLaVA's format, ``{"id", "image": "a.jpg"
  | "images": [...], "conversations": [{"from": "human"|"gpt"|"system",
  "value": ...}]}``, each ``<image>`` in a human turn standing for the next
  image (LLaVA-Instruct, ShareGPT4V, ...);
- ``captions``: JSONL, one ``{"image": "a.jpg", "caption": "..."}`` per line
  (stage-1 alignment data), made into ``user: <image>`` / ``assistant:
  caption`` (``caption_prompt`` is appended to the user turn when given);
- ``text``: JSONL, one ``{"conversations": [...]}`` per line, no images.

A LLaVA-Video / LLaVA-OneVision record may also have ``"video": path`` (or
``"videos": [...]``), a clip file or a folder of frames, each standing for
one ``<video>`` marker of its human turns; its frames are chosen by a
:class:`~megascale_omni.data.video.VideoSampling` and stored as image
members (:mod:`megascale_omni.data.video` says how and why).

Image paths are relative to ``image_root``. Images are stored as the
source file's bytes (JPEG, PNG or WebP: never re-encoded, so a JPEG set
takes its own size on disk), after PIL checked them once here: ``verify``
plus a full decode, which catches a truncated JPEG that ``verify`` passes.
A record is kept only if every check passes; otherwise it is *rejected*
with a reason and never silently fixed: unreadable or non-UTF-8 JSON, an
empty or mis-ordered conversation or a turn of the wrong type (the reason
names the turn, its role and field), ``<image>`` markers that do not match
the images, a missing, directory or undecodable image or one of another
format, an ``<image>`` outside the user turns and, with a tokenizer, a
sample longer than ``seq_length``.

Val split (:class:`ValSplit`): records of ``--val-json`` files, and a
``fraction`` of the other records chosen by a hash of (seed, record key)
(:func:`in_val`; the key is the record's ``id``, else its canonical JSON),
so the choice depends on neither the order nor the other records, go to a
second split directory ingested the same way.

Work is split into *chunks* of ``samples_per_shard`` consecutive input
records of a split; each chunk becomes one shard (its kept samples, ids =
positions in the split) written atomically by a worker process, with a
marker file recording what it kept and rejected. The inputs' fingerprint
(resolved paths, sizes, mtimes, settings) is stamped into the split only
after every input was read, so a failed read leaves nothing that refuses
the corrected rerun. A rerun with the same inputs skips the chunks whose
marker exists (resumable), then indexes the shards (``index.json``, with
each sample's image sizes and, given a coster, its token count:
:mod:`megascale_omni.data.costs`), and writes ``rejected.jsonl`` (position,
source, id, reason per rejected record) and ``ingest_report.json`` (counts
by reason).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from PIL import Image

from megascale_omni.config import ConfigError
from megascale_omni.data.conversation import ChatEncoder, ConversationError, normalize_turns, type_phrase
from megascale_omni.data.costs import IMAGE_FORMATS, IMAGE_SUFFIXES, Coster
from megascale_omni.data.integrity import decode_image_rgb
from megascale_omni.data.llava.ingest_inputs import (  # noqa: F401 - IngestInputs, ValSplit: this module's API
    IngestInputs,
    ValSplit,
    in_val,
    llava_records,
    read_records,
    record_key,
)
from megascale_omni.data.sample import (
    IMAGE_PLACEHOLDER,
    KIND_MULTI_IMAGE,
    KIND_SINGLE_IMAGE,
    KIND_TEXT_ONLY,
    KIND_VIDEO,
    VIDEO_PLACEHOLDER,
    Sample,
    SampleValidationError,
)
from megascale_omni.data.shard_writer import encode_sample, index_shards, shard_name, tar_writer
from megascale_omni.data.video import VideoError, VideoSampling, load_video
from megascale_omni.utils.files import atomic_open, atomic_write_text

logger = logging.getLogger(__name__)

#: Bookkeeping directory inside the output (chunk markers, the input fingerprint).
STATE_DIR = ".ingest"
REJECTED_FILE = "rejected.jsonl"
REPORT_FILE = "ingest_report.json"
_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class LengthCheck:
    """Reject samples the model's chat template renders longer than
    ``seq_length`` tokens, images and videos as their placeholders: a video
    of ``f`` kept frames as :meth:`video_tokens` (the training run's
    ``vision.video_tokens(f)``, never more: a run reads at most the kept frames)."""

    tokenizer: str
    seq_length: int
    tokens_per_image: int
    image_token: str = IMAGE_PLACEHOLDER
    #: LM placeholders of one video frame after pooling: ``ceil(grid / vision.video_pool_stride) ** 2``
    #: (0: unknown, and a record with a video is rejected).
    tokens_per_frame: int = 0
    #: Placeholders after each video's frames (1 with ``vision.image_newline``).
    video_newline: int = 0
    video_token: str = VIDEO_PLACEHOLDER

    def video_tokens(self, frames: int) -> int:
        """LM placeholders of one video of ``frames`` frames."""
        return frames * self.tokens_per_frame + self.video_newline


@dataclass
class IngestReport:
    """Counts of one ingestion (all chunks, resumed ones included)."""

    inputs: int = 0
    kept: int = 0
    rejected: int = 0
    reasons: Counter = field(default_factory=Counter)
    shards: int = 0
    chunks_resumed: int = 0
    #: The val split's report (None: no val split was made).
    val: Optional["IngestReport"] = None

    def to_dict(self) -> dict[str, Any]:
        doc = {"inputs": self.inputs, "kept": self.kept, "rejected": self.rejected, "shards": self.shards,
               "chunks_resumed": self.chunks_resumed, "rejected_by_reason": dict(sorted(self.reasons.items()))}
        if self.val is not None:
            doc["val"] = self.val.to_dict()
        return doc


# ------------------------------------------------------------- one record
class Rejected(Exception):
    """A record that is not ingested; the message is the reason (short, stable)."""


def to_sample(position: int, record: Any, image_root: str, encoder: Optional[ChatEncoder] = None,
              seq_length: Optional[int] = None, video: VideoSampling = VideoSampling()
              ) -> tuple[Sample, list[tuple[str, bytes]], list[list[tuple[str, bytes]]]]:
    """The :class:`Sample` of one input record (id = ``position``, images
    and the ``video`` sampling's frames decoded), its images' ``(PIL format,
    source bytes)`` and its videos' frames' (what the shard stores). Raises
    :class:`Rejected` with the reason when the record is bad."""
    if isinstance(record, str):
        raise Rejected(record)
    if not isinstance(record, dict):
        raise Rejected(f"record is {type_phrase(record)}, expected an object")
    if _has_surrogates(record):
        raise Rejected("not UTF-8")
    conversation = record.get("conversations")
    if not conversation:
        raise Rejected("empty conversation")
    if not isinstance(conversation, list):
        raise Rejected(f"conversations is {type_phrase(conversation)}, expected a list of turns")
    try:
        turns = normalize_turns(conversation, where="conversations")
    except ConversationError as e:
        raise Rejected(f"bad conversation: {e}") from None
    paths = _media_paths(record, "image")
    markers = sum(t["content"].count(IMAGE_PLACEHOLDER) for t in turns)
    if markers != len(paths):
        raise Rejected(f"{markers} {IMAGE_PLACEHOLDER} marker(s) for {len(paths)} image(s)")
    video_paths = _media_paths(record, "video")
    video_markers = sum(t["content"].count(VIDEO_PLACEHOLDER) for t in turns)
    if video_markers != len(video_paths):
        raise Rejected(f"{video_markers} {VIDEO_PLACEHOLDER} marker(s) for {len(video_paths)} video(s)")
    loaded = [_load_image(image_root, p) for p in paths]
    videos = [_load_video(image_root, p, video) for p in video_paths]
    images = [array for array, _, _ in loaded]
    kind = KIND_TEXT_ONLY if not images else KIND_SINGLE_IMAGE if len(images) == 1 else KIND_MULTI_IMAGE
    sample = Sample(
        id=position,
        kind=KIND_VIDEO if videos else kind,
        images=images,
        conversation=[{"role": t["role"], "text": _spaced_markers(t["content"])} for t in turns],
        videos=[v.frames for v in videos],
    )
    try:
        sample.validate()
    except SampleValidationError as e:
        raise Rejected(f"invalid sample: {e}") from None
    if encoder is not None and seq_length is not None:
        if videos and encoder.video_tokens is None:
            raise Rejected("video length unknown: the length check needs --tokens-per-frame")
        try:
            encoded = encoder.encode(conversation, num_images=len(images), max_length=seq_length,
                                     frames_per_video=[len(v.frames) for v in videos])
        except ConversationError as e:
            raise Rejected(f"longer than seq_length {seq_length}: {e}") from None
        if encoded.truncated:
            raise Rejected(f"longer than seq_length {seq_length} (only {encoded.assistant_turns} round(s) fit)")
    return sample, [(fmt, data) for _, fmt, data in loaded], [v.sources for v in videos]


def _has_surrogates(value: Any) -> bool:
    if isinstance(value, str):
        return bool(_SURROGATES.search(value))
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogates(v) for v in value)
    return False


def _media_paths(record: dict, kind: str) -> list[str]:
    """The paths of ``kind`` (``image`` or ``video``): the record's
    ``<kind>s`` list or its ``<kind>`` path."""
    field_name = f"{kind}s" if f"{kind}s" in record else kind
    value = record.get(field_name)
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list):
        raise Rejected(f"{field_name} is {type_phrase(value)}, expected a path or a list of paths")
    for i, p in enumerate(paths):
        where = field_name if isinstance(value, str) else f"{field_name}[{i}]"
        if not isinstance(p, str):
            raise Rejected(f"{where} is {type_phrase(p)}, expected a path")
        if not p:
            raise Rejected(f"{where} is empty, expected a path")
    return paths


def _spaced_markers(text: str) -> str:
    """The text with every marker a whitespace-separated word (the Sample
    contract counts markers by words); text already so is returned as is."""
    words = text.split()
    if all(words.count(m) == text.count(m) for m in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)):
        return text
    return re.sub(r"\s*(<image>|<video>)\s*", r" \1 ", text).strip()


def _load_video(root: str, rel: str, sampling: VideoSampling):
    """Video ``rel`` (a clip file or a frame folder) as
    :class:`~megascale_omni.data.video.LoadedVideo`. Raises :class:`Rejected`
    naming the file and the reason."""
    path = os.path.join(root, rel)
    if not os.path.exists(path):
        raise Rejected(f"video not found: {rel}")
    try:
        return load_video(path, sampling)
    except VideoError as e:
        raise Rejected(f"video {e.reason}: {rel}" + (f" ({e.detail})" if e.detail else "")) from None
    except OSError as e:
        raise Rejected(f"video cannot be read: {rel} ({e.strerror or e})") from None


def _load_image(root: str, rel: str) -> tuple[np.ndarray, str, bytes]:
    """Image ``rel`` decoded (np.uint8 ``[H, W, 3]``), its PIL format and its
    bytes as read. Raises :class:`Rejected` naming the file and the reason."""
    path = os.path.join(root, rel)
    if os.path.isdir(path):
        raise Rejected(f"image path is a directory: {rel}")
    if not os.path.isfile(path):
        raise Rejected(f"image not found: {rel}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise Rejected(f"image cannot be read: {rel} ({e.strerror or e})") from None
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format
            if fmt in IMAGE_FORMATS:
                img.verify()  # structure and checksums (PNG CRCs), without decoding
    # PIL reports malformed files with many exception types; any means unreadable.
    except Exception as e:  # noqa: BLE001
        raise Rejected(f"image cannot be decoded: {rel} ({type(e).__name__}: {e})") from None
    if fmt not in IMAGE_FORMATS:
        raise Rejected(f"image format {fmt} is not stored: {rel} (convert it to JPEG, PNG or WebP)")
    try:
        # The full decode the reader will do: catches what verify() does not
        # look at, e.g. a JPEG cut short.
        array = decode_image_rgb(data, IMAGE_SUFFIXES[IMAGE_FORMATS[fmt]])
    except ValueError as e:
        raise Rejected(f"image cannot be decoded: {rel} ({e})") from None
    return array, fmt, data


# ------------------------------------------------------------- one chunk
@functools.lru_cache(maxsize=1)
def _encoder(length: LengthCheck) -> ChatEncoder:
    """One chat encoder per worker process (loading a tokenizer takes seconds)."""
    return ChatEncoder.from_pretrained(length.tokenizer, image_token=length.image_token,
                                       tokens_per_image=length.tokens_per_image, video_token=length.video_token,
                                       video_tokens=length.video_tokens if length.tokens_per_frame else None)


def _write_chunk(job: tuple) -> dict:
    """Convert chunk ``number``'s records and write its shard (worker process).
    Returns the chunk marker: shard name (None if nothing was kept), kept
    count, rejected records. Samples are written as they are converted, so a
    worker holds one sample's images at a time."""
    number, first, records, image_root, out, length, video = job
    encoder = _encoder(length) if length else None
    kept, rejected = 0, []
    name = shard_name(number)
    with atomic_open(Path(out) / name, "wb") as fileobj:
        writer = tar_writer(fileobj)
        for offset, (source, record) in enumerate(records):
            position = first + offset
            try:
                sample, sources, video_sources = to_sample(position, record, image_root, encoder,
                                                           length.seq_length if length else None, video)
            except Rejected as e:
                rid = record.get("id") if isinstance(record, dict) else None
                rejected.append({"position": position, "source": source, "id": _plain(rid), "reason": str(e)})
                continue
            writer.write({"__key__": f"{position:09d}", **encode_sample(sample, sources, video_sources)})
            kept += 1
        writer.close()
    if not kept:
        (Path(out) / name).unlink()
    marker = {"chunk": number, "shard": name if kept else None, "kept": kept, "inputs": len(records),
              "rejected": rejected}
    atomic_write_text(Path(out) / STATE_DIR / f"chunk-{number:06d}.json", json.dumps(marker, sort_keys=True) + "\n")
    return marker


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None



# --------------------------------------------------------------- ingest
def ingest(inputs: IngestInputs, out_dir: str | os.PathLike, samples_per_shard: int = 1000, workers: int = 1,
           length: Optional[LengthCheck] = None, coster: Optional[Coster] = None,
           val: Optional[ValSplit] = None, video: VideoSampling = VideoSampling()) -> IngestReport:
    """Ingest ``inputs`` into the split directory ``out_dir`` (see the module
    docstring): parallel over ``workers`` processes, resumable, with a
    report of every rejected record. ``coster`` (the training run's
    encoder, e.g. :func:`chat_coster`) counts each sample's tokens into the
    index so training plans from it without reading the samples. ``val``:
    also make the val split (its report is the returned one's ``val``).
    ``video``: which frames of each video are kept.
    Raises ConfigError for unusable arguments (missing or unreadable inputs,
    an output holding another ingestion), before any shard is written."""
    if samples_per_shard <= 0:
        raise ConfigError("--samples-per-shard", samples_per_shard, "must be > 0")
    if workers <= 0:
        raise ConfigError("--workers", workers, "must be > 0")
    if not os.path.isdir(inputs.image_root):
        raise ConfigError("--image-root", inputs.image_root, "no such directory")
    splits = {"train": Path(out_dir)}
    if val is not None:
        if not 0 <= val.fraction < 1:
            raise ConfigError("--val-fraction", val.fraction, "must be >= 0 and < 1 (e.g. 0.01)")
        if not (val.fraction or val.llava_json):
            raise ConfigError("--val-fraction/--val-json", None, "give a fraction > 0 or a val JSON file")
        splits["val"] = Path(val.out)
        if os.path.realpath(splits["val"]) == os.path.realpath(splits["train"]):
            raise ConfigError("--val-out", val.out, "must differ from --out (default: val beside --out)")
    settings = [samples_per_shard, None if length is None else vars(length),
                None if val is None else val.settings()]
    if video != VideoSampling():  # the default keeps the fingerprints of sets ingested before videos
        settings.append(vars(video))
    stamps = {}
    for split, out in splits.items():
        stamps[split] = (out / STATE_DIR / "inputs.sha256", inputs.fingerprint(*settings, split))
        stamp, fingerprint = stamps[split]
        if stamp.exists() and stamp.read_text().strip() != fingerprint:
            raise ConfigError("--out" if split == "train" else "--val-out", str(out),
                              "holds an ingestion of other inputs or settings; use an empty directory")
    records = {"train": list(read_records(inputs)), "val": []}
    if val is not None:
        records["val"] = list(llava_records(val.llava_json, "--val-json"))
        if val.fraction:
            chosen = [in_val(record_key(*item), val.fraction, val.seed) for item in records["train"]]
            records["val"] += [item for item, v in zip(records["train"], chosen) if v]
            records["train"] = [item for item, v in zip(records["train"], chosen) if not v]
    # Every input was read: only now stamp the outputs (a failed read must not
    # refuse the corrected rerun), and before any chunk is written (a rerun
    # with other inputs must not resume these chunks).
    for stamp, fingerprint in stamps.values():
        stamp.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(stamp, fingerprint + "\n")
    reports = {split: _ingest_split(records[split], out, inputs.image_root, samples_per_shard, workers, length,
                                    coster, video) for split, out in splits.items()}
    reports["train"].val = reports.get("val")
    return reports["train"]


def _ingest_split(items: list[tuple[str, Any]], out: Path, image_root: str, samples_per_shard: int, workers: int,
                  length: Optional[LengthCheck], coster: Optional[Coster], video: VideoSampling) -> IngestReport:
    """Write, index and report one split's records (see :func:`ingest`)."""
    state = out / STATE_DIR
    report = IngestReport()
    markers: dict[int, dict] = {}
    todo = []
    for number, first in enumerate(range(0, len(items), samples_per_shard)):
        done = state / f"chunk-{number:06d}.json"
        if done.exists():
            markers[number] = json.loads(done.read_text(encoding="utf-8"))
            report.chunks_resumed += 1
        else:
            todo.append((number, first, items[first:first + samples_per_shard], image_root, str(out), length, video))
    if workers == 1 or len(todo) <= 1:
        results = map(_write_chunk, todo)
    else:
        pool = get_context("spawn").Pool(min(workers, len(todo)))
        results = pool.imap_unordered(_write_chunk, todo)
    try:
        for marker in results:
            markers[marker["chunk"]] = marker
            logger.info("%s chunk %d: kept %d of %d", out, marker["chunk"], marker["kept"], marker["inputs"])
    finally:
        if workers > 1 and len(todo) > 1:
            pool.close()
            pool.join()
    names = [markers[n]["shard"] for n in sorted(markers) if markers[n]["shard"]]
    rejected = [r for n in sorted(markers) for r in markers[n]["rejected"]]
    index = index_shards(out, names, coster)
    with open(out / REJECTED_FILE, "w", encoding="utf-8") as f:
        for r in rejected:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    report.inputs = sum(m["inputs"] for m in markers.values())
    report.kept = index.num_samples
    report.rejected = len(rejected)
    report.reasons = Counter(_reason_kind(r["reason"]) for r in rejected)
    report.shards = len(names)
    atomic_write_text(out / REPORT_FILE, json.dumps(report.to_dict(), sort_keys=True) + "\n")
    return report


def _reason_kind(reason: str) -> str:
    """The reason without its per-record details (file names, counts), for the summary."""
    for prefix in ("image not found", "image path is a directory", "image cannot be read", "image cannot be decoded",
                   "longer than seq_length", "bad conversation", "not JSON"):
        if reason.startswith(prefix):
            return prefix
    if reason.startswith("image format "):
        return "image format not stored"
    if "marker(s) for" in reason:
        return ("<video> markers do not match the videos" if reason.endswith("video(s)")
                else "<image> markers do not match the images")
    if reason.startswith("video "):
        return reason.partition(":")[0]  # "video has no frames: a.mp4 (...)" -> "video has no frames"
    return reason


def chat_coster(tokenizer: str | os.PathLike, image_token: str = IMAGE_PLACEHOLDER) -> Coster:
    """The ``data.format=chat`` encoder of an HF tokenizer directory, as an index coster."""
    from megascale_omni.data.llava.chat import ChatLlavaEncoder

    # Token counts exclude image placeholders and are never truncated: neither
    # tokens_per_image nor seq_length enters them.
    return ChatLlavaEncoder.from_pretrained(tokenizer, image_token, tokens_per_image=1, seq_length=1)


def words_coster(tokenizer: str | os.PathLike) -> Coster:
    """The ``data.format=words`` encoder of a word-level ``tokenizer.json``, as an index coster."""
    from megascale_omni.data.llava.batches import LlavaEncoder
    from megascale_omni.data.tokenizer import TextTokenizer

    return LlavaEncoder(TextTokenizer.from_path(tokenizer), tokens_per_image=1)


# ----------------------------------------------- our samples -> LLaVA JSON
def write_llava_json(samples: Sequence[Sample], out_dir: str | os.PathLike, name: str = "llava.json") -> Path:
    """Write ``samples`` in LLaVA's JSON format: ``OUT/<name>`` plus
    ``OUT/images/<id>_<i>.png`` (the inverse of ingestion, used to run the
    whole path on the embedded shapes data). Returns the JSON file's path."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for sample in samples:
        paths = []
        for i, image in enumerate(sample.images):
            rel = f"images/{sample.id:09d}_{i}.png"
            Image.fromarray(image, mode="RGB").save(out / rel, format="PNG")
            paths.append(rel)
        record: dict[str, Any] = {"id": str(sample.id), "conversations": [
            {"from": {"user": "human", "assistant": "gpt"}.get(t["role"], t["role"]), "value": t["text"]}
            for t in sample.conversation]}
        if len(paths) == 1:
            record["image"] = paths[0]
        elif paths:
            record["images"] = paths
        records.append(record)
    path = out / name
    path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return path
