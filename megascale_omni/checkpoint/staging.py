"""Host staging of a checkpoint's tensors into buffers allocated once.

An async save must copy every tensor it writes before training continues
(the optimizer step of the next iteration overwrites them). Allocating that
copy afresh at every save costs more than the copy itself: each fresh page
of a multi-GB host copy is faulted in and zeroed by the kernel, and on GPU a
fresh pinned buffer is a ``cudaHostAlloc``. :class:`HostStaging` allocates
the buffers at the first save and copies into them at every later save with
the same tensors (shapes, dtypes, order); the previous save's writer must be
done with them first, which the Checkpointer guarantees (at most one save
in flight). :meth:`HostStaging.reserve` allocates them ahead of the first
save, on a background thread, so no save pays for the allocation.

Without pinning, the buffers are shared memory: the writer process
(:mod:`megascale_omni.checkpoint.write_workers`) maps the same pages, so
handing a save over copies nothing. When
``/dev/shm`` has no room for them (a container's default is often 64 MB),
they are private memory instead: touching shared memory past its limit
raises SIGBUS rather than an error.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Optional

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, is_main_replica

logger = logging.getLogger(__name__)


def written_tensors(state: dict[str, Any]) -> list[ShardedBase]:
    """The sharded items of ``state`` with tensor data that this rank writes
    (main replicas: megatron's save drops the others)."""
    return [
        v for v in nested_values(state)
        if isinstance(v, ShardedBase) and isinstance(getattr(v, "data", None), torch.Tensor)
        and is_main_replica(v.replica_id)
    ]


class HostStaging:
    """Reusable host buffers for the tensors one rank writes (one per process).

    ``pin``: page-locked buffers, so device-to-host copies run at full
    bandwidth without a bounce buffer; defaults to True when CUDA is
    available. Otherwise shared memory (see the module docstring). Call :meth:`reserve` and :meth:`stage` from the training
    thread only.
    """

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: list[torch.Tensor] = []
        #: Buffers allocated so far: one per written tensor once, then none while the tensors repeat.
        self.allocations = 0
        self._reserving: Optional[threading.Thread] = None

    def reserve(self, state: dict[str, Any]) -> None:
        """Allocate buffers for the tensors of ``state`` that this rank writes
        and touch every page, on a background thread (returns at once).
        ``state`` is only read for shapes and dtypes, here."""
        self._join()
        specs = [(tuple(v.data.shape), v.data.dtype) for v in written_tensors(state)]
        self._reserving = threading.Thread(target=self._allocate, args=(specs,), name="ckpt-staging", daemon=True)
        self._reserving.start()

    def _allocate(self, specs: list[tuple]) -> None:
        try:
            shared = self._shared_fits(specs)
            buffers = [self._new(shape, dtype, shared) for shape, dtype in specs]
            for b in buffers:
                b.zero_()  # fault the pages in now, not during a save
        except RuntimeError as e:  # out of (pinned) memory: the first save allocates instead
            logger.warning("checkpoint: could not reserve host staging buffers (%s); the first save allocates", e)
            return
        self._buffers = buffers
        self.allocations += len(buffers)

    def _shared_fits(self, specs: list[tuple]) -> bool:
        """Whether unpinned buffers of ``specs`` fit in ``/dev/shm`` (with a quarter to spare)."""
        if self.pin:
            return False
        need = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs)
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return False
        fits = st.f_bavail * st.f_frsize >= need * 1.25
        if not fits:
            logger.warning("checkpoint: /dev/shm cannot hold %.1f MB of staging buffers; using private memory "
                           "(each copy after a save then faults its pages in again)", need / 2**20)
        return fits

    def _new(self, shape, dtype: torch.dtype, shared: bool) -> torch.Tensor:
        if self.pin:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        buf = torch.empty(shape, dtype=dtype)
        return buf.share_memory_() if shared else buf

    def _join(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def stage(self, state: dict[str, Any]) -> int:
        """Replace the data of every tensor this rank writes by its staging
        buffer, in place, once the copy has completed. Returns bytes copied.

        After this returns, training may overwrite parameters and optimizer
        state while the writer serialises the buffers; the next ``stage``
        overwrites the buffers, so the previous save must be written by then.
        """
        self._join()
        items = written_tensors(state)
        sources = [v.data.detach() for v in items]
        if [(b.shape, b.dtype) for b in self._buffers] != [(s.shape, s.dtype) for s in sources]:
            self._buffers = []  # free the old buffers before allocating new ones
            specs = [(s.shape, s.dtype) for s in sources]
            shared = self._shared_fits(specs)
            self._buffers = [self._new(shape, dtype, shared) for shape, dtype in specs]
            self.allocations += len(sources)
        on_device = False
        for item, src, buf in zip(items, sources, self._buffers):
            buf.copy_(src, non_blocking=self.pin)
            on_device = on_device or src.is_cuda
            item.data = buf
        if on_device:
            torch.cuda.current_stream().synchronize()
        return self.nbytes

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers)
