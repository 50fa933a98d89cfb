"""Atomic file writes: readers see the old file or the new one, never a part.

Write to a temporary file in the target's directory (same file system, so
``os.replace`` is an atomic rename), then rename it over the target.
``durable=True`` also makes the new content survive a power loss: the file
is fsynced before the rename and the directory after it (the checkpoint
commit marker needs this; files that are regenerated or checked on read,
such as endpoint files, data indexes with their shards' sha256 and status
snapshots, skip the two fsyncs).

The temporary name is ``.<name>.tmp-<pid>``: hidden, unique per process, and
it contains ``.tmp`` so listings that skip half-written files (e.g. the
checkpoint payload's) skip it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import IO, Any, Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]


def temp_path(path: PathLike) -> Path:
    """Where :func:`atomic_open` writes before renaming onto ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_open(path: PathLike, mode: str = "w", durable: bool = False) -> Iterator[IO[Any]]:
    """A file object (text ``"w"`` in UTF-8, or ``"wb"``) whose content
    replaces ``path`` when the block exits normally; on an exception the
    target is untouched and the temporary file removed."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open mode must be 'w' or 'wb', not {mode!r}")
    tmp = temp_path(path)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(Path(path).parent)


def atomic_write_bytes(path: PathLike, data: bytes, durable: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring for ``durable``)."""
    with atomic_open(path, "wb", durable) as f:
        f.write(data)


def atomic_write_text(path: PathLike, text: str, durable: bool = False) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically."""
    with atomic_open(path, "w", durable) as f:
        f.write(text)


def atomic_write_json(path: PathLike, obj: Any, durable: bool = False, **dump_kwargs: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON atomically; ``dump_kwargs`` go to :func:`json.dump`."""
    with atomic_open(path, "w", durable) as f:
        json.dump(obj, f, **dump_kwargs)


def fsync_dir(path: PathLike) -> None:
    """fsync a directory, so a rename or a new entry in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
