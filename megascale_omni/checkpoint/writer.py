"""Background execution of megatron ``dist_checkpointing`` async saves.

``dist_checkpointing.save(..., async_sharded_save=True)`` does the
collective planning on the caller's thread and returns an ``AsyncRequest``:
``async_fn`` writes this rank's files (no collectives) and ``finalize_fns``
publish the metadata (collective: every rank must call them at the same
point of the program).

megatron's own ``AsyncCallsQueue`` runs ``async_fn`` in a forked or spawned
process and assumes CUDA (``torch.cuda.set_device`` in the worker, CUDA
tensors in its completion collective). We keep megatron's write function and
request format but drive them ourselves: one persistent writer thread per
process, at most one request in flight, and completion agreed through the
caller's per-step flag collective (see :mod:`megascale_omni.checkpoint.manager`).
The writer thread only forks megatron's file-writer process and waits, so it
holds the GIL for microseconds.

Forking after CUDA is initialised (megatron-core 0.16.1,
``FileSystemWriterAsync.write_preloaded_data_multiproc``, run here on the
writer thread, forks one process per write bucket): safe, for three reasons.

* The child calls no CUDA API. By the time ``async_fn`` runs every tensor it
  writes is a host tensor (our staging buffers, and ``prepare_request`` ran
  megatron's ``preload_fn``); the child asserts ``tensor.is_cpu`` and
  serialises with ``torch.save``, whose CPU branch only reads the storage's
  bytes. Pinned (``cudaHostAlloc``) memory is ordinary host memory to read.
  A CUDA call in the child would raise (PyTorch marks a forked child
  "bad fork"), not corrupt the parent.
* Nothing is freed in the child: the buffers stay referenced by the process
  arguments until the child leaves through ``os._exit``, and megatron's
  ``_disable_gc`` holds cyclic GC off across the fork. ``gc.disable`` is
  process-wide, so while a write runs the trainer's own cyclic GC is off too
  (reference counting still frees memory).
* Pinned pages can be shared with the child rather than copied on write
  (megatron's own async path met this with reused pinned buffers), so the
  parent must not refill them while the child reads them. It does not:
  ``Checkpointer.save`` waits for the previous save before staging again (at
  most one save in flight), and the write function returns only after every
  child has reported.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

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


class AsyncWriter:
    """One writer thread; ``submit`` -> ``done_locally`` -> ``finalize`` (every rank)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self.inflight: Optional[InflightSave] = None

    def submit(
        self, step: int, reason: str, request: AsyncRequest, started: float, blocking_s: float, meta: dict,
        phases: Optional[dict] = None,
    ) -> None:
        """Start writing ``request``'s files in the background (host copies staged)."""
        assert self.inflight is None, "at most one checkpoint save may be in flight"
        future = self._pool.submit(_run_write, request)
        self.inflight = InflightSave(step, reason, request, future, started, blocking_s, meta, phases or {})

    def done_locally(self) -> bool:
        """True when no save is in flight or this rank's files are written."""
        return self.inflight is None or self.inflight.future.done()

    def wait_locally(self) -> None:
        if self.inflight is not None:
            self.inflight.future.result()

    def finalize(self) -> InflightSave:
        """Run the request's collective finalisers (every rank, once all ranks are done).

        Re-raises a write error of this rank (the caller then fails the job:
        a rank that could not write its shard leaves no complete checkpoint).
        """
        assert self.inflight is not None
        save, self.inflight = self.inflight, None
        save.future.result()
        for fn in save.request.finalize_fns:
            fn()
        return save

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _run_write(request: AsyncRequest) -> float:
    t0 = time.perf_counter()
    if request.async_fn is not None:
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    return time.perf_counter() - t0


def prepare_request(request: AsyncRequest) -> AsyncRequest:
    """Run the request's host staging now (the blocking part) and return a
    request whose ``async_fn`` only writes."""
    if request.preload_fn is None:
        return request
    args = list(request.async_fn_args)
    args[1] = request.preload_fn()
    return request._replace(async_fn_args=tuple(args), preload_fn=None)
