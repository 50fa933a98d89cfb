"""Checkpoint directories: free space and each rank's write throughput.

Every rank writes ``preflight.checkpoint_probe_mib`` into each configured
tier (``checkpoint.dir``, ``checkpoint.local_dir``) at the same time, as a
sharded save does, fsyncs it and removes it. A directory that cannot be
created or written (read-only, a path under a file, out of space) fails
with 0 MB/s and the operating system's reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

from megascale_omni.config.preflight_section import PreflightConfig
from megascale_omni.preflight.result import CheckResult, judge, skipped

_BLOCK = 4 << 20  # bytes per write


def write_mb_s(directory: Path, nbytes: int, rank: int) -> float:
    """MB/s (1e6 bytes) of writing and fsyncing ``nbytes`` to a probe file in
    ``directory`` (created if missing); the probe is removed. Raises OSError."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".preflight-{socket.gethostname()}-{rank}-{os.getpid()}.tmp"
    block = os.urandom(min(_BLOCK, nbytes))
    start = time.perf_counter()
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, block[:left])
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed = max(time.perf_counter() - start, 1e-9)
    finally:
        probe.unlink(missing_ok=True)
    return nbytes / elapsed / 1e6


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (the file system it will be on)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_checkpoint_dirs(pf: PreflightConfig, tiers: list[tuple[str, str]], rank: int) -> list[CheckResult]:
    """``checkpoint_free`` and ``checkpoint_write`` for each ``(config field, directory)`` that is set."""
    tiers = [(name, path) for name, path in tiers if path]
    if not tiers:
        return [skipped("checkpoint_write", "checkpoint.dir is empty: checkpointing is off")]
    results = []
    for name, path in tiers:
        directory = Path(path)
        free_gib = shutil.disk_usage(_existing(directory)).free / 2**30
        results.append(judge("checkpoint_free", free_gib, "GiB", pf.min_checkpoint_free_gib,
                             "preflight.min_checkpoint_free_gib", detail=f"{name}={path}"))
        try:
            rate = write_mb_s(directory, int(pf.checkpoint_probe_mib * 2**20), rank)
            detail = f"{name}={path}"
        except OSError as exc:
            rate, detail = 0.0, f"{name}={path} is not writable ({exc.strerror or exc})"
        results.append(judge("checkpoint_write", rate, "MB/s", pf.min_checkpoint_write_mb_s,
                             "preflight.min_checkpoint_write_mb_s", detail=detail))
    return results
