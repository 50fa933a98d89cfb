"""One rank of a model replica reads each step's micro-batches; the others receive them.

The ranks that train on the same micro-batches are the tp x pp ranks of one
(dp, cp) coordinate: megatron's model-parallel group. Only its TP rank 0 of
pipeline stage 0, the group's first rank (the *reader*), runs the task's
``build`` (reads shards, decodes and preprocesses images, collates); the
rest never read a sample. What each rank receives:

* every rank of the model-parallel group: the token-level entries of every
  micro-batch (``tokens``, ``labels``, masks, ``position_ids``,
  ``cu_seqlens``, ...), bit for bit what the reader built;
* the TP ranks of pipeline stage 0 only: also the pixel entries
  (``images``, ``videos``). Later stages have no vision tower and get no pixels, so
  they neither decode nor receive them.

A sample whose image does not decode is skipped on the reader, and the
rows every stage receives are the reader's rows: the skip decision is made
once, so every stage lays out the same rows and every rank applies the same
skip counts (the reader's ``seen``/``skipped`` deltas travel with the
batches). A fatal data error on the reader (a
:class:`~megascale_omni.data.errors.DataQualityError`: a shard gone or
failing its checksum) travels with them too and is raised on every rank of
the group, so each ends with the same one-line ``data error:`` and exit 3
instead of waiting for a batch; any other failure of ``build`` is raised on
the reader and as a ``RuntimeError`` naming it everywhere else.

Why not megatron's ``tensor_parallel.broadcast_data``: it serves the TP
group only, one dtype per call, and has no channel for an error or for skip
counts. Here one pickled header (specs, counts, error) and two byte buffers
(token-level entries over the model-parallel group, images over the stage-0
TP group) cross per step, whatever the dtypes.

Context parallelism is unchanged: every CP rank has a reader of its own
(the model-parallel group excludes CP) and builds the whole micro-batch,
which :meth:`~megascale_omni.models.model_spec.ModelSpec.cp_local` then cuts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megascale_omni.data.errors import DataQualityError
from megascale_omni.data.health import SkipCounter
from megascale_omni.data.step_buffer import layout, pack_step, views

#: Entries of a micro-batch that only the first pipeline stage uses (the vision tower's input).
IMAGE_KEYS = ("images", "videos")

#: Reasons a :class:`SkipCounter` keeps (the rest are only counted).
_MAX_REASONS = 20


@dataclass(frozen=True)
class ReplicaDataGroups:
    """Who reads and which groups carry the batches, for one rank.

    Attributes:
        reads: this rank builds the micro-batches (TP rank 0 of pipeline stage 0).
        first_stage: this rank is on pipeline stage 0 (it needs the images).
        mp_group, mp_src, mp_size: megatron's model-parallel (tp x pp) group,
            the reader's global rank in it, its size.
        tp_group, tp_src, tp_size: this rank's TP group and its rank 0 (global).
    """

    reads: bool
    first_stage: bool
    mp_group: Any
    mp_src: int
    mp_size: int
    tp_group: Any
    tp_src: int
    tp_size: int

    @classmethod
    def from_parallel_state(cls) -> "ReplicaDataGroups":
        """This rank's groups from megatron's ``parallel_state`` (every rank, after
        :func:`~megascale_omni.parallel.initialize_parallel`)."""
        from megatron.core import parallel_state as mpu

        first_stage = mpu.get_pipeline_model_parallel_rank() == 0
        reads = first_stage and mpu.get_tensor_model_parallel_rank() == 0
        mp_src = mpu.get_model_parallel_src_rank()
        if reads != (dist.get_rank() == mp_src):
            raise RuntimeError(f"rank {dist.get_rank()}: the model-parallel group's first rank {mp_src} is not "
                               "TP rank 0 of pipeline stage 0")
        return cls(
            reads=reads, first_stage=first_stage,
            mp_group=mpu.get_model_parallel_group(), mp_src=mp_src,
            mp_size=mpu.get_tensor_model_parallel_world_size() * mpu.get_pipeline_model_parallel_world_size(),
            tp_group=mpu.get_tensor_model_parallel_group(), tp_src=mpu.get_tensor_model_parallel_src_rank(),
            tp_size=mpu.get_tensor_model_parallel_world_size(),
        )

    @classmethod
    def alone(cls) -> "ReplicaDataGroups":
        """A rank that is its own model replica's only reader (tp = pp = 1, no collectives)."""
        return cls(True, True, None, 0, 1, None, 0, 1)


class BatchBroadcast:
    """Runs a micro-batch builder on the reader and hands its result to every
    rank of the model-parallel group (see the module docstring).

    Args:
        groups: this rank's role and groups.
        device: where the collective buffers live (``platform.device``: NCCL
            groups need CUDA buffers); received tensors are returned on the
            host, like the reader's own.
        image_keys: entries only pipeline stage 0 receives.
    """

    def __init__(self, groups: ReplicaDataGroups, device: torch.device = torch.device("cpu"),
                 image_keys: Sequence[str] = IMAGE_KEYS):
        self.groups = groups
        self.device = device
        self.image_keys = tuple(image_keys)

    @property
    def reads(self) -> bool:
        """True on the rank that builds the batches (the only one that reads samples)."""
        return self.groups.reads

    def __call__(self, build: Callable[[], list[dict]], counter: SkipCounter) -> list[dict]:
        """``build()``'s micro-batches on every rank of the model-parallel group
        (every rank calls it; ``build`` runs on the reader only). The samples
        ``build`` read and skipped, counted in ``counter`` on the reader, are
        added to ``counter`` on the other ranks. Later pipeline stages get the
        micro-batches without :attr:`image_keys`."""
        g = self.groups
        if g.mp_size == 1:
            return build()
        header, batches, failure = None, [], None
        if g.reads:
            seen, skipped, reasons = counter.seen, counter.skipped, len(counter.reasons)
            error = None
            try:
                batches = build()
            except DataQualityError as err:
                error = err
            except Exception as err:  # any other failure: the other ranks must not wait for a batch
                failure = err
                error = RuntimeError(f"data: the reader (rank {dist.get_rank()}) failed building the micro-batches: "
                                     f"{type(err).__name__}: {err}")
            header = {
                "error": error, "seen": counter.seen - seen, "skipped": counter.skipped - skipped,
                "reasons": counter.reasons[reasons:],
                "specs": [[(k, v.dtype, tuple(v.shape)) for k, v in mb.items()] for mb in batches],
            }
        box = [header]
        dist.broadcast_object_list(box, src=g.mp_src, group=g.mp_group, device=self.device)
        header = box[0]
        if not g.reads:
            counter.seen += header["seen"]
            counter.skipped += header["skipped"]
            counter.reasons.extend(header["reasons"][: max(0, _MAX_REASONS - len(counter.reasons))])
        if header["error"] is not None:
            if failure is not None:
                raise failure
            raise header["error"]
        specs = header["specs"]
        token_specs = [[s for s in mb if s[0] not in self.image_keys] for mb in specs]
        image_specs = [[s for s in mb if s[0] in self.image_keys] for mb in specs]
        out: list[dict] = [{} for _ in specs]
        self._exchange(batches, token_specs, out, g.mp_src, g.mp_group, g.mp_size)
        if g.first_stage:
            self._exchange(batches, image_specs, out, g.tp_src, g.tp_group, g.tp_size)
        # Keep the builder's key order.
        return [{k: mb[k] for k, _, _ in spec if k in mb} for mb, spec in zip(out, specs)]

    def _exchange(self, batches: list[dict], specs: list[list[tuple]], out: list[dict], src: int, group,
                  size: int) -> None:
        """Broadcast the entries named by ``specs`` from ``src`` over ``group``
        (``size`` ranks) as one byte buffer; fills ``out`` (the reader keeps its own tensors)."""
        if self.groups.reads:
            for i, spec in enumerate(specs):
                out[i].update({k: batches[i][k] for k, _, _ in spec})
        if size == 1:
            return
        # One buffer laid out as a worker's hand-over is (step_buffer); the receivers derive
        # the layout from the specs and read their entries as views of it.
        slots, total = layout(specs)
        if self.groups.reads:
            if total:
                packed = pack_step([{k: batches[i][k] for k, _, _ in spec} for i, spec in enumerate(specs)])
                dist.broadcast(packed.buffer.to(self.device), src=src, group=group)
            return
        buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        if total:
            dist.broadcast(buf, src=src, group=group)
        for entries, received in zip(out, views(buf.cpu(), slots, len(specs))):
            entries.update(received)


def batch_broadcast(tp: int, pp: int, device: Optional[torch.device] = None) -> BatchBroadcast:
    """The :class:`BatchBroadcast` of this rank (every rank, after the parallel
    groups exist): collective-free when ``tp * pp == 1``."""
    groups = ReplicaDataGroups.alone() if tp * pp == 1 else ReplicaDataGroups.from_parallel_state()
    return BatchBroadcast(groups, device or torch.device("cpu"))
