"""Attention over the packed segments of a THD micro-batch with torch's own
kernels: no transformer-engine, no flash-attn package.

One call covers many segments:

* CUDA, fp16/bf16, head dim a multiple of 8 up to 256: torch's bundled
  varlen flash kernel (``aten::_flash_attention_forward`` with
  ``cu_seqlens``; autograd through its registered backward). One call per
  layer; grouped-query attention is native (no repeated K/V).
* everything else (CPU, fp32): segments are gathered into batches
  ``[c, n, L, d]`` (:class:`SegmentBatches`), one
  ``scaled_dot_product_attention(..., enable_gqa=True)`` call per batch.
  On CUDA, segments of similar length share a batch, padded at the end of
  each row (a causal row never sees its padding, so no mask is needed;
  padded query rows are computed and dropped, no gradient flows from them):
  fewer kernel launches for some padded work. On CPU, which has no launch
  cost to save and pays for every padded FLOP, a batch holds segments of one
  length only (measured: 3 padded calls took 1.35x the time of 8 unpadded
  ones for 8 causal segments of 61..437 tokens, 8 heads / 2 groups, forward
  + backward). Bidirectional batches never pad.

Why not FlexAttention: torch 2.13 has no FlexAttention backward on CPU, and
its CPU forward needs ``torch.compile``. Why not nested (jagged) tensors:
SDPA on them has no CPU training kernel and refuses broadcast GQA heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

#: On CUDA a batch of similar-length causal segments may cost at most this
#: much more attention work (sum of ``L^2``) than the segments alone.
CUDA_PADDING_WORK = 1.5


@dataclass(frozen=True)
class _Batch:
    """Segments padded into one ``[count, length]`` SDPA batch."""

    count: int
    length: int
    #: ``[count * length]`` token rows to read (padding slots repeat a real row of their segment).
    gather: torch.Tensor
    #: ``[real tokens]`` slots of ``gather`` that hold real tokens, in order.
    real: torch.Tensor
    #: Rows ``[start, start + count * length)`` in order: read by slicing, not gathering.
    start: int | None


class SegmentBatches:
    """How the segments of one micro-batch are grouped into padded SDPA
    batches; built once per micro-batch from host boundaries (no device
    reads) and reused by every layer.

    ``bounds``: segment boundaries as ints, 0 to ``t``; ``causal``: the
    attention the batches serve; ``pad``: let causal segments of similar
    length share a padded batch (default: on CUDA only)."""

    def __init__(self, bounds: Sequence[int], causal: bool, device: torch.device, pad: Optional[bool] = None):
        pad = causal and (device.type == "cuda" if pad is None else pad)
        segments = sorted(
            ((end - start, start) for start, end in zip(bounds[:-1], bounds[1:]) if end > start), key=lambda s: -s[0]
        )
        groups: list[list[tuple[int, int]]] = []
        for length, start in segments:
            group = groups[-1] if groups else None
            if group is not None and self._joins(group, length, pad):
                group.append((length, start))
            else:
                groups.append([(length, start)])
        self.batches: list[_Batch] = []
        order: list[int] = []
        for group in groups:
            self.batches.append(self._batch(group, device))
            for length, start in group:
                order.extend(range(start, start + length))
        self.tokens = len(order)
        # Concatenated batch outputs are in `order`; this index puts them back in token order.
        inverse = [0] * self.tokens
        for position, token in enumerate(order):
            inverse[token] = position
        self.inverse = None if order == sorted(order) else torch.tensor(inverse, device=device)

    @staticmethod
    def _joins(group: list[tuple[int, int]], length: int, pad: bool) -> bool:
        longest = group[0][0]  # segments arrive longest first
        if not pad:
            return length == longest
        work = sum(n * n for n, _ in group) + length * length
        return (len(group) + 1) * longest * longest <= CUDA_PADDING_WORK * work

    @staticmethod
    def _batch(group: list[tuple[int, int]], device: torch.device) -> _Batch:
        count, longest = len(group), group[0][0]
        gather, real = [], []
        for row, (length, start) in enumerate(group):
            gather.extend(range(start, start + length))
            gather.extend([start + length - 1] * (longest - length))
            real.extend(range(row * longest, row * longest + length))
        starts = sorted(start for _, start in group)
        in_order = all(n == longest for n, _ in group) and starts == list(
            range(starts[0], starts[0] + count * longest, longest)
        )
        return _Batch(
            count, longest, torch.tensor(gather, device=device), torch.tensor(real, device=device),
            starts[0] if in_order else None,
        )

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float,
        dropout_p: float,
    ) -> torch.Tensor:
        """``[t, np, hn]`` query, ``[t, ng, hn]`` key/value -> ``[t, np, hn]``."""
        parts = []
        for batch in self.batches:
            rows = [self._rows(x, batch) for x in (query, key, value)]  # [c, n, L, d]
            out = F.scaled_dot_product_attention(
                *rows, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=True
            )
            out = out.transpose(1, 2).reshape(batch.count * batch.length, *query.shape[1:])
            parts.append(out if batch.start is not None else out.index_select(0, batch.real))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out if self.inverse is None else out.index_select(0, self.inverse)

    @staticmethod
    def _rows(x: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """``[t, n, d]`` -> ``[count, n, length, d]`` for ``batch``."""
        if batch.start is not None:
            flat = x[batch.start : batch.start + batch.count * batch.length]
        else:
            flat = x.index_select(0, batch.gather)
        return flat.view(batch.count, batch.length, *x.shape[1:]).transpose(1, 2)


def uses_varlen_flash(query: torch.Tensor) -> bool:
    """True where torch's varlen flash kernel takes ``query`` (CUDA, fp16/bf16, head dim % 8 == 0, <= 256)."""
    d = query.shape[-1]
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def varlen_flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    causal: bool, scale: float, dropout_p: float,
) -> torch.Tensor:
    """torch's varlen flash attention: ``[t, np, hn]`` query, ``[t, ng, hn]``
    key/value, ``cu_seqlens`` int32 ``[n + 1]`` on the device -> ``[t, np, hn]``."""
    return torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, causal, False, scale=scale
    )[0]
