"""RoPE for packed THD batches without host reads per layer.

megatron's unfused THD RoPE (``apply_rotary_pos_emb(..., cu_seqlens=...)``)
reads ``cu_seqlens`` to the host (``.tolist()``, ``.item()``) and splits the
sequence segment by segment in every layer, which on a GPU stalls the host
once per layer. Here each token's RoPE position is computed once per
micro-batch on the device from ``cu_seqlens`` (searchsorted, no sync), and
every layer rotates its query and key by one gather of the frequency table.

Positions are megatron's (and transformer-engine's): restarting at 0 in every
segment of ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``); under context
parallelism a rank's local tokens are chunks ``r`` and ``2 cp - 1 - r`` of
each segment (:mod:`megascale_omni.parallel.context`), so their positions
are those chunks' offsets.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention, _yarn_get_concentration_factor_from_config

from megascale_omni.models.attention import derived


def thd_rope_positions(cu_seqlens: torch.Tensor, tokens: int, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """RoPE position of each of this rank's ``tokens`` local tokens, ``[tokens]``
    int64 on ``cu_seqlens.device``, computed there (no host read).

    ``cu_seqlens``: ``[n + 1]`` global segment boundaries (the padded ones
    under CP, each segment a multiple of ``2 * cp_size``)."""
    cu = cu_seqlens.to(torch.int64)
    local = torch.arange(tokens, device=cu.device)
    cu_local = cu // cp_size
    # Empty segments repeat a boundary; right=True puts a token in the last segment starting at or before it.
    segment = torch.searchsorted(cu_local, local, right=True) - 1
    offset = local - cu_local[segment]
    if cp_size == 1:
        return offset
    chunk = (cu[segment + 1] - cu[segment]) // (2 * cp_size)
    first = offset < chunk
    return torch.where(first, cp_rank * chunk + offset, (2 * cp_size - 1 - cp_rank) * chunk + offset - chunk)


class PackedSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` whose RoPE on THD batches is a per-token
    gather (:func:`thd_rope_positions`) instead of megatron's per-segment
    split; everything else, and non-THD or fused-RoPE inputs, unchanged.

    ``forward`` hands megatron no ``rotary_pos_emb`` and keeps the table
    and the ``PackedSeqParams`` on the module for the duration of that call;
    ``get_query_key_value_tensors`` (which ``forward`` calls once) rotates
    query and key ``[t, 1, n, d]`` by the table gathered at each token's
    position (``[t, 1, 1, d]``; positions cached per micro-batch).
    """

    _rope: Optional[tuple[tuple[torch.Tensor, torch.Tensor], PackedSeqParams]] = None

    def forward(self, hidden_states, *args, rotary_pos_emb=None, packed_seq_params=None, **kwargs):
        if (
            rotary_pos_emb is None
            or packed_seq_params is None
            or packed_seq_params.qkv_format != "thd"
            or self.config.apply_rope_fusion
            or kwargs.get("inference_context") is not None
        ):
            return super().forward(
                hidden_states, *args, rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params, **kwargs
            )
        freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
        self._rope = (freqs, packed_seq_params)
        try:
            return super().forward(hidden_states, *args, rotary_pos_emb=None, packed_seq_params=packed_seq_params,
                                   **kwargs)
        finally:
            self._rope = None

    def _positions(self, params: PackedSeqParams, tokens: int) -> torch.Tensor:
        cp = self.pg_collection.cp
        cp_size, cp_rank = (cp.size(), cp.rank()) if cp is not None else (1, 0)
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        return derived(params, ("rope_positions", tokens, cp_size, cp_rank, cu.device),
                       lambda: thd_rope_positions(cu, tokens, cp_size, cp_rank))

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._rope is None:
            return out
        freqs, params = self._rope
        positions = self._positions(params, out[0].shape[0])
        mscale = _yarn_get_concentration_factor_from_config(self.config)
        query, key = (
            _apply_rotary_pos_emb_bshd(
                x, f.index_select(0, positions), rotary_interleaved=self.config.rotary_interleaved, mscale=mscale
            )
            for x, f in zip(out[:2], freqs)
        )
        return (query, key, *out[2:])
