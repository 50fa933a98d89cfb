"""The inputs of :mod:`megascale_omni.data.llava.ingest`: which files, how
their records are read, and which records make the val split.

Every input is read completely before anything is written, so a missing or
unreadable file stops the ingestion with a :class:`ConfigError` and leaves
the output as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from megascale_omni.config import ConfigError
from megascale_omni.data.sample import IMAGE_PLACEHOLDER


@dataclass(frozen=True)
class IngestInputs:
    """What to ingest (paths as given; see the module docstring)."""

    #: LLaVA-format JSON arrays.
    llava_json: Sequence[str] = ()
    #: Image-caption JSONL files (``{"image", "caption"}`` per line).
    captions: Sequence[str] = ()
    #: Text-only conversation JSONL files.
    text: Sequence[str] = ()
    #: Directory the records' image paths are relative to.
    image_root: str = "."
    #: User text after the ``<image>`` of caption samples.
    caption_prompt: str = ""

    def fingerprint(self, *settings: Any) -> str:
        """Changes when an input file (resolved path, size, mtime) or a
        setting changes (resuming then refuses). ``./x.json`` and ``x.json``
        give the same fingerprint."""
        parts: list[Any] = [*settings, os.path.realpath(self.image_root), self.caption_prompt]
        for kind in ("llava_json", "captions", "text"):
            parts.extend(_file_identity(kind, path) for path in getattr(self, kind))
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _file_identity(kind: str, path: str) -> list[Any]:
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError("input", path, f"cannot be read: {e.strerror or e}") from None
    return [kind, os.path.realpath(path), st.st_size, st.st_mtime_ns]


@dataclass(frozen=True)
class ValSplit:
    """Which records make the val split, and where it is written."""

    #: The val split directory (``tools/ingest_llava.py``: ``val`` beside ``--out``).
    out: str
    #: Share of the train inputs' records moved to val, chosen by :func:`in_val`; 0 <= fraction < 1.
    fraction: float = 0.0
    #: Seed of the :func:`in_val` hash (another seed draws another val set).
    seed: int = 0
    #: LLaVA-format JSON files whose every record goes to val.
    llava_json: Sequence[str] = ()

    def settings(self) -> list[Any]:
        """What the fingerprint of both splits covers (files: resolved path, size, mtime)."""
        return [self.fraction, self.seed, [_file_identity("val_json", p) for p in self.llava_json]]


def record_key(source: str, record: Any) -> str:
    """What :func:`in_val` hashes: the record's ``id`` (str or int) if it
    has one, else its canonical JSON (``source`` for an unreadable line)."""
    if isinstance(record, dict):
        rid = record.get("id")
        if isinstance(rid, (str, int)) and not isinstance(rid, bool):
            return f"id:{rid}"
        return "json:" + json.dumps(record, sort_keys=True, ensure_ascii=True, default=str)
    return f"source:{source}"


def in_val(key: str, fraction: float, seed: int) -> bool:
    """Whether the record with :func:`record_key` ``key`` goes to val: the
    first 8 bytes of sha256(seed, key) as a number in [0, 1) are below
    ``fraction``. Deterministic and independent of the other records, so
    records with the same id land in the same split."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode("utf-8", errors="surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2 ** 64


def read_records(inputs: IngestInputs) -> Iterator[tuple[str, Any]]:
    """``(source, record)`` of every input record in order; ``record`` is a
    dict, or a string naming why the line could not be read (rejected later
    with that reason). Raises ConfigError for a missing or unreadable file."""
    yield from llava_records(inputs.llava_json, "--llava-json")
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


def llava_records(paths: Sequence[str], flag: str) -> Iterator[tuple[str, Any]]:
    """``(source, record)`` of every record of the LLaVA-format JSON files
    ``paths`` (ConfigError naming ``flag`` for an unreadable one)."""
    for path in paths:
        data = _read_json(path, flag)
        if not isinstance(data, list):
            raise ConfigError(flag, path, "must hold a JSON array of samples (LLaVA format)")
        for i, record in enumerate(data):
            yield f"{path}[{i}]", record


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError("input", path, f"cannot be read: {e.strerror or e}") from None


def _read_json(path: str, flag: str) -> Any:
    # surrogateescape keeps a stray non-UTF-8 byte inside one sample from
    # losing the whole file: that sample is rejected, the others are kept.
    text = _read_bytes(path).decode("utf-8", errors="surrogateescape")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(flag, path, f"is not valid JSON (line {e.lineno}: {e.msg})") from None


def _caption_record(record: dict, prompt: str) -> dict:
    caption, image = record.get("caption"), record.get("image")
    user = f"{IMAGE_PLACEHOLDER}\n{prompt}".rstrip() if prompt else IMAGE_PLACEHOLDER
    return {"id": record.get("id"), "image": image,
            "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": caption}]}
