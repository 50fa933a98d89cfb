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

Image paths are relative to ``image_root``. A record is kept only if every
check passes; otherwise it is *rejected* with a reason and never silently
fixed: unreadable or non-UTF-8 JSON, an empty or mis-ordered conversation,
``<image>`` markers that do not match the images, a missing or undecodable
image, an ``<image>`` outside the user turns and, with a tokenizer, a
sample longer than ``seq_length``.

Work is split into *chunks* of ``samples_per_shard`` consecutive input
records; each chunk becomes one shard (its kept samples, ids = input
positions) written atomically by a worker process, with a marker file
recording what it kept and rejected. A rerun with the same inputs skips the
chunks whose marker exists (resumable), then indexes the shards
(``index.json``, with each sample's image sizes and, given a coster, its
token count: :mod:`megascale_omni.data.costs`), and writes ``rejected.jsonl`` (position, source, id,
reason per rejected record) and ``ingest_report.json`` (counts by reason).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import webdataset
from PIL import Image

from megascale_omni.config import ConfigError
from megascale_omni.data.conversation import ChatEncoder, ConversationError, normalize_turns
from megascale_omni.data.costs import Coster
from megascale_omni.data.sample import (
    IMAGE_PLACEHOLDER,
    KIND_MULTI_IMAGE,
    KIND_SINGLE_IMAGE,
    KIND_TEXT_ONLY,
    Sample,
    SampleValidationError,
)
from megascale_omni.data.shard_writer import encode_sample, index_shards, shard_name
from megascale_omni.utils.files import atomic_open, atomic_write_text

logger = logging.getLogger(__name__)

#: Bookkeeping directory inside the output (chunk markers, the input fingerprint).
STATE_DIR = ".ingest"
REJECTED_FILE = "rejected.jsonl"
REPORT_FILE = "ingest_report.json"
_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class LengthCheck:
    """Reject samples the model's chat template renders longer than ``seq_length`` tokens."""

    tokenizer: str
    seq_length: int
    tokens_per_image: int
    image_token: str = IMAGE_PLACEHOLDER


@dataclass(frozen=True)
class IngestInputs:
    """What to ingest (paths as given; see the module docstring)."""

    llava_json: Sequence[str] = ()
    captions: Sequence[str] = ()
    text: Sequence[str] = ()
    image_root: str = "."
    caption_prompt: str = ""

    def fingerprint(self, samples_per_shard: int, length: Optional[LengthCheck]) -> str:
        """Changes when an input file or a setting changes (resuming then refuses)."""
        parts: list[Any] = [samples_per_shard, os.path.abspath(self.image_root), self.caption_prompt,
                            None if length is None else vars(length)]
        for kind in ("llava_json", "captions", "text"):
            for path in getattr(self, kind):
                st = os.stat(path)
                parts.append([kind, os.path.abspath(path), st.st_size, st.st_mtime_ns])
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class IngestReport:
    """Counts of one ingestion (all chunks, resumed ones included)."""

    inputs: int = 0
    kept: int = 0
    rejected: int = 0
    reasons: Counter = field(default_factory=Counter)
    shards: int = 0
    chunks_resumed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "kept": self.kept, "rejected": self.rejected, "shards": self.shards,
                "chunks_resumed": self.chunks_resumed, "rejected_by_reason": dict(sorted(self.reasons.items()))}


def read_records(inputs: IngestInputs) -> Iterator[tuple[str, Any]]:
    """``(source, record)`` of every input record in order; ``record`` is a
    dict, or a string naming why the line could not be read (rejected later
    with that reason). Raises ConfigError for a missing or unreadable file."""
    for path in inputs.llava_json:
        data = _read_json(path)
        if not isinstance(data, list):
            raise ConfigError("--llava-json", path, "must hold a JSON array of samples (LLaVA format)")
        for i, record in enumerate(data):
            yield f"{path}[{i}]", record
    for kind, paths in (("caption", inputs.captions), ("text", inputs.text)):
        for path in paths:
            for lineno, line in enumerate(_read_bytes(path).splitlines(), 1):
                if not line.strip():
                    continue
                source = f"{path}:{lineno}"
                try:
                    record = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    yield source, "not UTF-8"
                    continue
                except json.JSONDecodeError as e:
                    yield source, f"not JSON ({e.msg})"
                    continue
                if isinstance(record, dict) and kind == "caption":
                    record = _caption_record(record, inputs.caption_prompt)
                yield source, record


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError("input", path, f"cannot be read: {e.strerror or e}") from None


def _read_json(path: str) -> Any:
    # surrogateescape keeps a stray non-UTF-8 byte inside one sample from
    # losing the whole file: that sample is rejected, the others are kept.
    text = _read_bytes(path).decode("utf-8", errors="surrogateescape")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("--llava-json", path, f"is not valid JSON (line {e.lineno}: {e.msg})") from None


def _caption_record(record: dict, prompt: str) -> dict:
    caption, image = record.get("caption"), record.get("image")
    user = f"{IMAGE_PLACEHOLDER}\n{prompt}".rstrip() if prompt else IMAGE_PLACEHOLDER
    return {"id": record.get("id"), "image": image,
            "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": caption}]}


# ------------------------------------------------------------- one record
class Rejected(Exception):
    """A record that is not ingested; the message is the reason (short, stable)."""


def to_sample(position: int, record: Any, image_root: str, encoder: Optional[ChatEncoder] = None,
              seq_length: Optional[int] = None) -> Sample:
    """The :class:`Sample` of one input record (id = ``position``). Raises
    :class:`Rejected` with the reason when the record is bad."""
    if isinstance(record, str):
        raise Rejected(record)
    if not isinstance(record, dict):
        raise Rejected(f"record is a {type(record).__name__}, expected an object")
    if _has_surrogates(record):
        raise Rejected("not UTF-8")
    conversation = record.get("conversations")
    if not conversation:
        raise Rejected("empty conversation")
    try:
        turns = normalize_turns(conversation)
    except ConversationError as e:
        raise Rejected(f"bad conversation: {e}") from None
    paths = _image_paths(record)
    markers = sum(t["content"].count(IMAGE_PLACEHOLDER) for t in turns)
    if markers != len(paths):
        raise Rejected(f"{markers} {IMAGE_PLACEHOLDER} marker(s) for {len(paths)} image(s)")
    images = [_load_image(image_root, p) for p in paths]
    sample = Sample(
        id=position,
        kind=KIND_TEXT_ONLY if not images else KIND_SINGLE_IMAGE if len(images) == 1 else KIND_MULTI_IMAGE,
        images=images,
        conversation=[{"role": t["role"], "text": _spaced_markers(t["content"])} for t in turns],
    )
    try:
        sample.validate()
    except SampleValidationError as e:
        raise Rejected(f"invalid sample: {e}") from None
    if encoder is not None and seq_length is not None:
        try:
            encoded = encoder.encode(conversation, num_images=len(images), max_length=seq_length)
        except ConversationError as e:
            raise Rejected(f"longer than seq_length {seq_length}: {e}") from None
        if encoded.truncated:
            raise Rejected(f"longer than seq_length {seq_length} (only {encoded.assistant_turns} round(s) fit)")
    return sample


def _has_surrogates(value: Any) -> bool:
    if isinstance(value, str):
        return bool(_SURROGATES.search(value))
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogates(v) for v in value)
    return False


def _image_paths(record: dict) -> list[str]:
    value = record.get("images", record.get("image"))
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise Rejected("'image'/'images' must be a path or a list of paths")
    return paths


def _spaced_markers(text: str) -> str:
    """The text with every marker a whitespace-separated word (the Sample
    contract counts markers by words); text already so is returned as is."""
    if text.split().count(IMAGE_PLACEHOLDER) == text.count(IMAGE_PLACEHOLDER):
        return text
    return re.sub(r"\s*<image>\s*", f" {IMAGE_PLACEHOLDER} ", text).strip()


def _load_image(root: str, rel: str) -> np.ndarray:
    path = os.path.join(root, rel)
    if not os.path.isfile(path):
        raise Rejected(f"image not found: {rel}")
    try:
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as img:
            img.verify()  # structure and checksums (PNG CRCs), without decoding
        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()
    # PIL reports malformed files with many exception types; any means unreadable.
    except Exception as e:  # noqa: BLE001
        raise Rejected(f"image cannot be decoded: {rel} ({type(e).__name__})") from None


# ------------------------------------------------------------- one chunk
@functools.lru_cache(maxsize=1)
def _encoder(tokenizer: str, image_token: str, tokens_per_image: int) -> ChatEncoder:
    """One chat encoder per worker process (loading a tokenizer takes seconds)."""
    return ChatEncoder.from_pretrained(tokenizer, image_token=image_token, tokens_per_image=tokens_per_image)


def _write_chunk(job: tuple) -> dict:
    """Convert chunk ``number``'s records and write its shard (worker process).
    Returns the chunk marker: shard name (None if nothing was kept), kept
    count, rejected records."""
    number, first, records, image_root, out, length = job
    encoder = _encoder(length.tokenizer, length.image_token, length.tokens_per_image) if length else None
    kept, rejected = [], []
    for offset, (source, record) in enumerate(records):
        position = first + offset
        try:
            kept.append(to_sample(position, record, image_root, encoder, length.seq_length if length else None))
        except Rejected as e:
            rid = record.get("id") if isinstance(record, dict) else None
            rejected.append({"position": position, "source": source, "id": _plain(rid), "reason": str(e)})
    name = None
    if kept:
        name = shard_name(number)
        with atomic_open(Path(out) / name, "wb") as fileobj:
            writer = webdataset.TarWriter(fileobj, user="", group="", mode=0o444, compress=False, encoder=False,
                                          mtime=0.0)
            for sample in kept:
                writer.write({"__key__": f"{sample.id:09d}", **encode_sample(sample)})
            writer.close()
    marker = {"chunk": number, "shard": name, "kept": len(kept), "inputs": len(records), "rejected": rejected}
    atomic_write_text(Path(out) / STATE_DIR / f"chunk-{number:06d}.json", json.dumps(marker, sort_keys=True) + "\n")
    return marker


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None



# --------------------------------------------------------------- ingest
def ingest(inputs: IngestInputs, out_dir: str | os.PathLike, samples_per_shard: int = 1000, workers: int = 1,
           length: Optional[LengthCheck] = None, coster: Optional[Coster] = None) -> IngestReport:
    """Ingest ``inputs`` into the split directory ``out_dir`` (see the module
    docstring): parallel over ``workers`` processes, resumable, with a
    report of every rejected record. ``coster`` (the training run's
    encoder, e.g. :func:`chat_coster`) counts each sample's tokens into the
    index so training plans from it without reading the samples. Raises
    ConfigError for unusable arguments (missing inputs, an output holding
    another ingestion)."""
    if samples_per_shard <= 0:
        raise ConfigError("--samples-per-shard", samples_per_shard, "must be > 0")
    if workers <= 0:
        raise ConfigError("--workers", workers, "must be > 0")
    if not os.path.isdir(inputs.image_root):
        raise ConfigError("--image-root", inputs.image_root, "no such directory")
    out = Path(out_dir)
    state = out / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    fingerprint = inputs.fingerprint(samples_per_shard, length)
    stamp = state / "inputs.sha256"
    if stamp.exists() and stamp.read_text().strip() != fingerprint:
        raise ConfigError("--out", str(out), "holds an ingestion of other inputs or settings; use an empty --out")
    stamp.write_text(fingerprint + "\n")

    report = IngestReport()
    markers: dict[int, dict] = {}
    jobs = []
    chunk: list = []
    for position, item in enumerate(read_records(inputs)):
        chunk.append(item)
        if len(chunk) == samples_per_shard:
            jobs.append((len(jobs), position + 1 - len(chunk), chunk))
            chunk = []
    if chunk:
        jobs.append((len(jobs), sum(len(j[2]) for j in jobs), chunk))
    todo = []
    for number, first, records in jobs:
        done = state / f"chunk-{number:06d}.json"
        if done.exists():
            markers[number] = json.loads(done.read_text(encoding="utf-8"))
            report.chunks_resumed += 1
        else:
            todo.append((number, first, records, inputs.image_root, str(out), length))
    if workers == 1 or len(todo) <= 1:
        results = map(_write_chunk, todo)
    else:
        pool = get_context("spawn").Pool(min(workers, len(todo)))
        results = pool.imap_unordered(_write_chunk, todo)
    try:
        for marker in results:
            markers[marker["chunk"]] = marker
            logger.info("chunk %d: kept %d of %d", marker["chunk"], marker["kept"], marker["inputs"])
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
    for prefix in ("image not found", "image cannot be decoded", "longer than seq_length", "bad conversation",
                   "not JSON"):
        if reason.startswith(prefix):
            return prefix
    if "marker(s) for" in reason:
        return "<image> markers do not match the images"
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
