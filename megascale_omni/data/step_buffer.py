"""One step's micro-batches as one contiguous byte buffer, for the hand-over from a loader worker.

A worker returns a step as a list of micro-batch dicts holding a handful
of tensors each (7 per LLaVA micro-batch). Sent as they are, each tensor
travels through its own shared-memory segment (created, its file
descriptor passed over a socket, mapped, later unmapped), which cost more
than building the step once building got cheap. :func:`pack_step` copies
every tensor of the step into one buffer (one segment, one pin on CUDA)
and :func:`unpack_step` gives back views of it with the same dtypes,
shapes and values; the non-tensor values of a micro-batch travel as they
are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

#: Byte alignment of every tensor in the buffer (the widest dtype we carry, and a cache line).
ALIGN = 64


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


def pack_step(batches: list[dict[str, Any]]) -> PackedStep:
    """Copy the tensors of ``batches`` (dense, any dtype) into one buffer."""
    slots, offset = [], 0
    for i, batch in enumerate(batches):
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                slots.append(Slot(i, key, value.dtype, tuple(value.shape), offset))
                offset += -(-value.numel() * value.element_size() // ALIGN) * ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8)
    for slot in slots:
        src = batches[slot.index][slot.key]
        nbytes = src.numel() * src.element_size()
        if nbytes:
            buffer[slot.offset:slot.offset + nbytes].view(src.dtype).view(src.shape).copy_(src)
    rest = [{k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)} for batch in batches]
    return PackedStep(buffer, slots, rest, [tuple(batch) for batch in batches])


def unpack_step(packed: PackedStep) -> list[dict[str, Any]]:
    """The micro-batches :func:`pack_step` was given, tensors as views of
    ``packed.buffer``, keys in their original order."""
    values: list[dict[str, Any]] = [dict(rest) for rest in packed.rest]
    for slot in packed.slots:
        nbytes = torch.Size(slot.shape).numel() * slot.dtype.itemsize
        values[slot.index][slot.key] = packed.buffer[slot.offset:slot.offset + nbytes].view(slot.dtype).view(slot.shape)
    return [{k: batch[k] for k in keys} for batch, keys in zip(values, packed.keys)]
