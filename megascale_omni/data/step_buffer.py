"""One step's micro-batches as one contiguous byte buffer: for the hand-over
from a loader worker, and for the reader's broadcast to its model-parallel group.

A step is a list of micro-batch dicts holding a handful of tensors each (7
per LLaVA micro-batch). Sent as they are, each tensor travels on its own:
through a shared-memory segment of its own from a worker (created, its file
descriptor passed over a socket, mapped, later unmapped), or as a
collective of its own. :func:`pack_step` copies every tensor of the step
into one buffer (one segment, one pin on CUDA, one broadcast) and
:func:`unpack_step` gives back views of it with the same dtypes, shapes and
values; the non-tensor values of a micro-batch travel as they are. Where
the tensors' specs are known on both sides (:func:`layout`), a receiver
lays out the same buffer and reads it with :func:`views`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

#: Byte alignment of every tensor in the buffer (the widest dtype we carry, and a cache line).
ALIGN = 64

#: One tensor entry of a micro-batch: ``(key, dtype, shape)``.
Spec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class Slot:
    """Where tensor ``key`` of micro-batch ``index`` lies in the buffer."""

    index: int
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes


class PackedStep(NamedTuple):
    """A step's micro-batches: ``buffer`` (uint8 ``[nbytes]``) holds every
    tensor, ``slots`` say where; ``rest`` keeps each micro-batch's other
    values and ``keys`` its key order. (A named tuple: torch's loader pins
    the tensors inside one.)"""

    buffer: torch.Tensor
    slots: list[Slot]
    rest: list[dict[str, Any]]
    keys: list[tuple[str, ...]]


def tensor_specs(batches: Sequence[dict[str, Any]]) -> list[list[Spec]]:
    """The tensor entries of each micro-batch, in key order."""
    return [[(k, v.dtype, tuple(v.shape)) for k, v in batch.items() if isinstance(v, torch.Tensor)]
            for batch in batches]


def layout(specs: Sequence[Sequence[Spec]]) -> tuple[list[Slot], int]:
    """The slots of ``specs`` (per micro-batch) in one buffer, each aligned
    to :data:`ALIGN`, and the buffer's size in bytes: the same on every side
    that knows the specs."""
    slots, offset = [], 0
    for i, spec in enumerate(specs):
        for key, dtype, shape in spec:
            slots.append(Slot(i, key, dtype, tuple(shape), offset))
            offset += -(-torch.Size(shape).numel() * dtype.itemsize // ALIGN) * ALIGN
    return slots, offset


def views(buffer: torch.Tensor, slots: Sequence[Slot], num_batches: int) -> list[dict[str, torch.Tensor]]:
    """The tensors of ``slots`` as views of ``buffer`` (uint8), one dict per micro-batch."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(num_batches)]
    for slot in slots:
        nbytes = torch.Size(slot.shape).numel() * slot.dtype.itemsize
        out[slot.index][slot.key] = buffer[slot.offset:slot.offset + nbytes].view(slot.dtype).view(slot.shape)
    return out


def pack_step(batches: list[dict[str, Any]]) -> PackedStep:
    """Copy the tensors of ``batches`` (dense, any dtype) into one buffer."""
    slots, nbytes = layout(tensor_specs(batches))
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for i, target in enumerate(views(buffer, slots, len(batches))):
        for key, dst in target.items():
            dst.copy_(batches[i][key])
    rest = [{k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)} for batch in batches]
    return PackedStep(buffer, slots, rest, [tuple(batch) for batch in batches])


def unpack_step(packed: PackedStep) -> list[dict[str, Any]]:
    """The micro-batches :func:`pack_step` was given, tensors as views of
    ``packed.buffer``, keys in their original order."""
    values = views(packed.buffer, packed.slots, len(packed.rest))
    for batch, rest in zip(values, packed.rest):
        batch.update(rest)
    return [{k: batch[k] for k in keys} for batch, keys in zip(values, packed.keys)]
