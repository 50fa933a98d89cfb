"""Background execution of megatron ``dist_checkpointing`` async saves.

``dist_checkpointing.save(..., async_sharded_save=True)`` does the
collective planning on the caller's thread and returns an ``AsyncRequest``:
``async_fn`` writes this rank's files (no collectives) and ``finalize_fns``
publish the metadata (collective: every rank must call them at the same
point of the program).

megatron's own ``AsyncCallsQueue`` runs ``async_fn`` in a forked or spawned
process and assumes CUDA (``torch.cuda.set_device`` in the worker, CUDA
tensors in its completion collective). We keep megatron's request format and
per-bucket write function but drive them ourselves: one persistent writer
thread per process, at most one request in flight, and completion agreed
through the caller's per-step flag collective (see
:mod:`megascale_omni.checkpoint.manager`).

megatron's ``async_fn`` itself (``write_preloaded_data_multiproc``) forks one
process per write bucket; forking the multi-threaded trainer is what Python
3.12 deprecates. The writer thread therefore hands the buckets to
:class:`~megascale_omni.checkpoint.write_workers.WriteWorkers` instead
(pre-started spawned processes, zero-copy through shared memory, or this
process when the tensors are not in shared memory): nothing forks.

The staging buffers a save hands over stay untouched until it is written:
``Checkpointer.save`` waits for the previous save before staging again (at
most one save in flight), and :meth:`WriteWorkers.write` returns only after
every bucket's writer has reported.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from megascale_omni.checkpoint.hf_assets import HFAssets
from megascale_omni.checkpoint.write_workers import WriteWorkers

logger = logging.getLogger(__name__)


@dataclass
class InflightSave:
    """One save between its blocking phase and its collective finalisation."""

    step: int
    reason: str
    request: AsyncRequest
    future: Future
    started: float
    blocking_s: float
    #: Recorded in the commit marker (layout, world size).
    meta: dict
    #: Seconds per blocking phase (wait, state_dict, split, host_copy, plan).
    phases: dict
    #: Tokenizer and processor files the committer writes into the step directory.
    assets: HFAssets = HFAssets()


class AsyncWriter:
    """One writer thread; ``submit`` -> ``done_locally`` -> ``finalize`` (every rank).
    ``files`` writes megatron's buckets (see the module docstring)."""

    def __init__(self, files: WriteWorkers) -> None:
        self.files = files
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self.inflight: Optional[InflightSave] = None

    def submit(
        self, step: int, reason: str, request: AsyncRequest, started: float, blocking_s: float, meta: dict,
        phases: Optional[dict] = None, assets: HFAssets = HFAssets(),
    ) -> None:
        """Start writing ``request``'s files in the background (host copies staged)."""
        assert self.inflight is None, "at most one checkpoint save may be in flight"
        future = self._pool.submit(_run_write, request, self.files)
        self.inflight = InflightSave(step, reason, request, future, started, blocking_s, meta, phases or {}, assets)

    def done_locally(self) -> bool:
        """True when no save is in flight or this rank's files are written."""
        return self.inflight is None or self.inflight.future.done()

    def wait_locally(self) -> None:
        if self.inflight is not None:
            self.inflight.future.result()

    def local_error(self) -> Optional[BaseException]:
        """Why this rank could not write the in-flight save's files, or None
        (blocks until they are written). The caller agrees on it across ranks
        before :meth:`finalize` or :meth:`abandon`."""
        assert self.inflight is not None
        try:
            return self.inflight.future.result()
        except Exception as e:  # a writer that is not megatron's raised
            return e

    def finalize(self) -> InflightSave:
        """Run the request's collective finalisers (every rank, once all
        ranks have written their files without error)."""
        assert self.inflight is not None
        save, self.inflight = self.inflight, None
        save.future.result()
        for fn in save.request.finalize_fns:
            fn()
        return save

    def abandon(self) -> InflightSave:
        """Drop the in-flight save without its finalisers (every rank, once
        all ranks agreed that one of them failed): megatron's metadata is not
        written and nothing is committed."""
        assert self.inflight is not None
        save, self.inflight = self.inflight, None
        if self.files.handles(save.request):
            self.files.discard_results(save.request)
        return save

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.files.close()


def _run_write(request: AsyncRequest, files: WriteWorkers) -> Optional[BaseException]:
    """Write ``request``'s files; the error of a bucket that failed, or None."""
    if request.async_fn is not None and files.handles(request):
        return files.write(request)
    if request.async_fn is not None:  # not megatron's forking writer: run it as given
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    return None


def prepare_request(request: AsyncRequest) -> AsyncRequest:
    """Run the request's host staging now (the blocking part) and return a
    request whose ``async_fn`` only writes."""
    if request.preload_fn is None:
        return request
    args = list(request.async_fn_args)
    args[1] = request.preload_fn()
    return request._replace(async_fn_args=tuple(args), preload_fn=None)


#: How torch's zip writer (``torch.save``) reports a write of its stream that
#: failed: a RuntimeError (``[enforce fail at inline_container.cc:...]
#: unexpected pos ...`` or ``PytorchStreamWriter failed writing ...``), no errno.
_ZIP_WRITER_FAILURE = ("inline_container.cc", "PytorchStreamWriter")
#: Bytes the probe of :func:`storage_error` writes and syncs.
_PROBE_BYTES = 1 << 16


def storage_error(err: Optional[BaseException], directory: Path) -> Optional[BaseException]:
    """The ``OSError`` behind ``err`` if it is torch's zip writer failing to
    write a file under ``directory``; ``err`` itself otherwise.

    A full disk reaches a rank as an ``OSError`` (ENOSPC) from Python's file
    writes, except inside ``torch.save``: its zip writer turns the failed
    write into a RuntimeError without errno, which the ranks would take for
    a bug (the job fails instead of abandoning the save, see
    ``Checkpointer._agree_failures``). So ask the file system: a probe
    file of 64 KiB written and synced in ``directory`` (then removed) fails
    with the real ``OSError`` when the disk is full; if it succeeds, the
    failure was an I/O error that has passed, reported as ``EIO``."""
    if not isinstance(err, RuntimeError) or not any(mark in str(err) for mark in _ZIP_WRITER_FAILURE):
        return err
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".space-probe-") as probe:
            probe.write(bytes(_PROBE_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as cause:
        cause.filename = cause.filename or str(directory)
        return cause
    return OSError(errno.EIO, f"torch's zip writer failed ({err}); a probe write there then succeeded",
                   str(directory))
