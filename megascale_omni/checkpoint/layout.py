"""On-disk layout of checkpoints: step directories, commit markers, tiers.

A tier is a directory of step directories::

    <tier>/step_00000120/          megatron dist_checkpointing files
    <tier>/step_00000120/commit.json

A checkpoint is *complete* once ``commit.json`` exists. The marker is written
last, by one process, through write-to-temp + ``os.replace`` (atomic on
POSIX), and it lists every file of the checkpoint with its size and sha256.
So a process killed at any moment leaves either a complete checkpoint or a
directory without a marker, which every reader ignores.

Nothing here touches torch.distributed: callers decide which rank runs it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from megascale_omni.checkpoint.errors import CheckpointError
from megascale_omni.utils.files import atomic_write_json

logger = logging.getLogger(__name__)

COMMIT_FILE = "commit.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_HASH_CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_step_dir_name(name: str) -> bool:
    return _STEP_DIR.match(name) is not None


@dataclass(frozen=True)
class CheckpointInfo:
    """One step directory of one tier, as found on disk."""

    path: Path
    step: int
    tier: str
    #: The parsed commit marker, or None while incomplete.
    commit: Optional[dict] = field(default=None, compare=False)

    @property
    def complete(self) -> bool:
        return self.commit is not None

    @property
    def size_bytes(self) -> int:
        """Bytes the commit marker lists (entries without an integer size count 0)."""
        files = (self.commit or {}).get("files", {}).values()
        return sum(f["size"] for f in files if isinstance(f, dict) and type(f.get("size")) is int)


def scan_tier(root: str | os.PathLike, tier: str) -> list[CheckpointInfo]:
    """Every step directory under ``root``, oldest first (missing root -> [])."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append(CheckpointInfo(entry, int(m.group(1)), tier, _read_commit(entry)))
    return sorted(found, key=lambda c: c.step)


def _load_commit(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """``(marker, None)``, ``(None, None)`` without a marker, or ``(None,
    what is wrong with it)`` for a marker that is unreadable or not an object
    with a ``files`` object (per-file entries are checked by :func:`verify`)."""
    try:
        with open(path / COMMIT_FILE, encoding="utf-8") as f:
            commit = json.load(f)
    except FileNotFoundError:
        return None, None
    except json.JSONDecodeError as e:
        what = e.msg.removesuffix(" at").removesuffix(" starting")  # json puts the position after "at"
        return None, f"is not valid JSON ({what} at line {e.lineno} column {e.colno}; truncated or overwritten?)"
    except ValueError:
        return None, "is not UTF-8 text"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    if not isinstance(commit, dict):
        return None, f"must hold a JSON object, not a {type(commit).__name__}"
    if not isinstance(commit.get("files"), dict):
        return None, 'has no "files" object mapping each file to its size and sha256'
    return commit, None


def _read_commit(path: Path) -> Optional[dict]:
    commit, problem = _load_commit(path)
    if problem:
        logger.warning("checkpoint %s: %s %s; treating it as incomplete", path, COMMIT_FILE, problem)
    return commit


def commit_problem(path: str | os.PathLike) -> Optional[str]:
    """What is wrong with the commit marker of step directory ``path``, or
    None when it is usable or absent (absent: a save that never finished)."""
    return _load_commit(Path(path))[1]


def step_info(path: str | os.PathLike) -> Optional[CheckpointInfo]:
    """``path`` as one step directory (complete or not); None if it is not one."""
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    if not (m and path.is_dir()):
        return None
    return CheckpointInfo(path, int(m.group(1)), "explicit", _read_commit(path))


def check_resume_path(path: str | os.PathLike) -> None:
    """Raise ConfigError naming ``checkpoint.resume`` unless ``path`` is a
    ``step_NNNNNNNN`` directory (whether it is intact is checked on load).
    Stat calls only: every rank runs it before any process group."""
    from megascale_omni.errors import ConfigError

    path = Path(path)
    fix = "name a step_NNNNNNNN directory, or use auto (the newest under checkpoint.dir) or none (start fresh)"
    if not path.exists():
        raise ConfigError("checkpoint.resume", str(path), f"does not exist; {fix}")
    if step_info(path) is not None:
        return
    steps = scan_tier(path, "explicit") if path.is_dir() else []
    if steps:
        raise ConfigError("checkpoint.resume", str(path),
                          f"is a checkpoint root, not one checkpoint; name one of its step directories "
                          f"(e.g. {steps[-1].path}), or set checkpoint.dir to it and checkpoint.resume: auto")
    raise ConfigError("checkpoint.resume", str(path), f"is not a checkpoint directory; {fix}")


def newest_complete(tiers: Iterable[tuple[str, str | os.PathLike]]) -> list[CheckpointInfo]:
    """Complete checkpoints of all ``(tier, root)`` pairs, newest step first;
    on equal steps the tier listed first wins (pass the fast tier first)."""
    ranked = []
    for order, (tier, root) in enumerate(tiers):
        ranked += [(c.step, -order, c) for c in scan_tier(root, tier) if c.complete]
    return [c for _, _, c in sorted(ranked, key=lambda t: (t[0], t[1]), reverse=True)]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _payload_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != COMMIT_FILE and ".tmp" not in p.name)


def write_commit(path: Path, step: int, extra: dict) -> dict:
    """Hash every file of ``path`` and atomically publish ``commit.json`` (one process)."""
    files = {
        str(p.relative_to(path)): {"size": p.stat().st_size, "sha256": file_digest(p)} for p in _payload_files(path)
    }
    commit = {"format": FORMAT_VERSION, "step": step, "committed_unix": time.time(), "files": files, **extra}
    # The commit marker makes the checkpoint count: it must survive a power loss (durable).
    atomic_write_json(path / COMMIT_FILE, commit, durable=True, indent=1, sort_keys=True)
    return commit


def verify(info: CheckpointInfo, checksums: bool = True) -> list[str]:
    """Problems that make ``info`` unloadable (empty list = intact)."""
    if not info.complete:
        problem = commit_problem(info.path)
        return [f"{COMMIT_FILE} {problem}" if problem else f"no {COMMIT_FILE} (the save never finished)"]
    if not info.commit["files"]:
        return [f"{COMMIT_FILE} lists no files (a save writes at least one; the marker was edited or truncated)"]
    problems = []
    for rel, meta in sorted(info.commit["files"].items()):
        if (not isinstance(meta, dict) or isinstance(meta.get("size"), bool) or not isinstance(meta.get("size"), int)
                or not isinstance(meta.get("sha256"), str)):
            problems.append(f"{rel}: malformed entry in {COMMIT_FILE} (needs an integer size and a sha256 string)")
            continue
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            problems.append(f"{rel}: outside the checkpoint directory")
            continue
        p = info.path / rel
        if not p.is_file():
            problems.append(f"missing file {rel}")
            continue
        size = p.stat().st_size
        if size != meta.get("size"):
            problems.append(f"{rel}: size {size} bytes, commit says {meta.get('size')} (truncated?)")
        elif checksums and file_digest(p) != meta.get("sha256"):
            problems.append(f"{rel}: sha256 mismatch")
    return problems


def first_intact(
    candidates: Iterable[CheckpointInfo], checksums: bool = True
) -> tuple[Optional[CheckpointInfo], list[str]]:
    """The first of ``candidates`` (newest first) that verifies, and one
    ``"<path>: <problems>"`` line per broken one skipped (logged)."""
    rejected = []
    for info in candidates:
        problems = verify(info, checksums)
        if not problems:
            return info, rejected
        logger.warning(
            "checkpoint %s is broken (%s); falling back to the previous complete checkpoint",
            info.path, "; ".join(problems),
        )
        rejected.append(f"{info.path}: {'; '.join(problems)}")
    return None, rejected


def resolve(path: str | os.PathLike, checksums: bool = True) -> CheckpointInfo:
    """The intact checkpoint a user points at: a ``step_NNNNNNNN`` directory,
    or a checkpoint root (its newest intact complete checkpoint).

    Raises CheckpointError naming the path and every problem found.
    """
    path = Path(path)
    info = step_info(path)
    if info is not None:
        problems = verify(info, checksums)
        if problems:
            raise CheckpointError(f"checkpoint {path} is broken: " + "; ".join(problems))
        return info
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (expected a checkpoint root or a step_NNNNNNNN directory)")
    info, rejected = first_intact(newest_complete([("persistent", path)]), checksums)
    if info is not None:
        return info
    if rejected:
        raise CheckpointError(f"no intact checkpoint under {path}: " + " | ".join(rejected))
    incomplete = [c.step for c in scan_tier(path, "persistent")]
    raise CheckpointError(
        f"no complete checkpoint under {path} "
        + (f"(steps {incomplete} never finished saving)" if incomplete
           else "(expected step_NNNNNNNN directories with a commit.json)")
    )


def remove(info: CheckpointInfo) -> None:
    """Delete a checkpoint crash-safely: un-publish (marker first), then files."""
    try:
        (info.path / COMMIT_FILE).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(info.path, ignore_errors=True)


def prune(
    root: str | os.PathLike, tier: str, keep_last: int, keep_steps: Iterable[int] = (), remove_abandoned: bool = True
) -> list[int]:
    """Keep the newest ``keep_last`` complete checkpoints of a tier.

    With ``remove_abandoned``, also removes incomplete directories older
    than the newest complete one (abandoned saves; not when several writers
    share the tier). Never removes the newest complete checkpoint nor any
    step in ``keep_steps`` (e.g. a save in flight). Returns removed steps.
    """
    infos = scan_tier(root, tier)
    complete = [c for c in infos if c.complete]
    if not complete:
        return []
    keep = {c.step for c in complete[-max(keep_last, 1):]} | set(keep_steps)
    newest = complete[-1].step
    removed = []
    for c in infos:
        if c.step in keep or (not c.complete and (c.step > newest or not remove_abandoned)):
            continue
        remove(c)
        removed.append(c.step)
    return removed


def remove_incomplete(root: str | os.PathLike, tier: str) -> list[int]:
    """Delete every step directory without a marker (only when no save can be in flight)."""
    removed = []
    for c in scan_tier(root, tier):
        if not c.complete:
            remove(c)
            removed.append(c.step)
    return removed


def replicate(src: CheckpointInfo, dst_root: str | os.PathLike, tier: str) -> CheckpointInfo:
    """Copy a complete checkpoint into another tier; the copy's marker is
    written last, after every file was copied and its size checked."""
    assert src.complete, src
    dst = Path(dst_root) / src.path.name
    if dst.exists():
        remove(CheckpointInfo(dst, src.step, tier))
    dst.mkdir(parents=True)
    for rel, meta in src.commit["files"].items():
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src.path / rel, target)
        with open(target, "rb+") as f:
            os.fsync(f.fileno())
        if target.stat().st_size != meta["size"]:
            raise OSError(f"replicating {src.path / rel}: copied {target.stat().st_size} bytes, expected {meta['size']}")
    atomic_write_json(dst / COMMIT_FILE, {**src.commit, "replicated_from": str(src.path)}, durable=True, indent=1,
                      sort_keys=True)
    return CheckpointInfo(dst, src.step, tier, _read_commit(dst))
