"""The attention path before megascale_omni.models.packed_kernels /
packed_rope, kept as the reference for parity tests and the attention
benchmark: SDPA once per segment in a Python loop with ``repeat_interleave``
for grouped-query heads, and megatron's own THD RoPE (host reads per layer).

:func:`use_reference_attention` switches a built model to it in place (same
weights, same modules; only the attention classes change)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention

from megascale_omni.models.attention import PackedCoreAttention, host_bounds
from megascale_omni.models.packed_rope import PackedSelfAttention


class PerSegmentCoreAttention(PackedCoreAttention):
    """:class:`PackedCoreAttention` as it was: one SDPA call per segment."""

    def _attend_thd(self, query, key, value, params, causal, dropout_p):
        t = query.shape[0]
        bounds = host_bounds(params, params.cu_seqlens_q)
        parts = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, n, L, d]
            parts.append(self._attend(q, k, v, causal, dropout_p)[0].transpose(0, 1))
        return torch.cat(parts).reshape(t, -1)

    def _attend(self, q, k, v, causal, dropout_p):
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale)


def use_reference_attention(model: torch.nn.Module, reference: bool = True) -> int:
    """Switch every attention of ``model`` to the reference path (or, with
    ``reference=False``, back); returns how many core attentions were
    switched (callers assert it found them)."""
    swaps = [(PackedSelfAttention, SelfAttention), (PackedCoreAttention, PerSegmentCoreAttention)]
    if not reference:
        swaps = [(new, old) for old, new in swaps]
    switched = 0
    for module in model.modules():
        for old, new in swaps:
            if type(module) is old:
                module.__class__ = new
                switched += old in (PackedCoreAttention, PerSegmentCoreAttention)
    return switched
