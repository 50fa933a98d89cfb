"""Packed sequences as THD: one batch format and one attention contract for
the local (CPU) and transformer-engine (GPU) layer specs.

Layout (megatron-core's ``thd`` convention). A collated micro-batch holds
``b`` packed rows of ``s`` tokens (``[b, s]``, see
:mod:`megascale_omni.data.packing`) and ``cu_seqlens``, the segment
boundaries of those rows flattened row-major. The language model sees it as
*one* sequence of ``t = b * s`` tokens:

* ``tokens``, ``position_ids``, ``labels``: ``[1, t]``; hidden states
  ``[t, 1, h]``; pipeline p2p buffers ``[t, 1, h]``
  (:func:`thd_pipeline_shape`).
* ``PackedSeqParams(qkv_format="thd", cu_seqlens_q = cu_seqlens_kv)``, int32
  ``[n + 1]`` from 0 to ``t``: one segment per sample, and one per non-empty
  padding tail of a row. Segments never cross a row boundary.

Why this layout: megatron's ``Attention`` squeezes the batch dimension for
``thd`` (query ``[t, np, hn]``) and rebuilds ``[t, 1, np * hn]`` after core
attention, so ``b`` must be 1; rows therefore become consecutive segments.
Making each padding tail a segment of its own means the segments tile
``[0, t)`` exactly, which is what megatron's unfused and fused THD RoPE
(``apply_rotary_pos_emb(..., cu_seqlens=...)``, positions restart at 0 in
every segment) and TE's ``padding_causal`` THD kernels expect without the
``cu_seqlens_*_padded`` variants. Padding tokens attend only to their own
tail and carry no loss. Learned absolute position embeddings read
``position_ids``, which restart at 0 at every sample and padding tail, so
both position schemes agree with the segments.

Who consumes ``PackedSeqParams``:

* local spec (CPU, and ``layer_impl: local`` on GPU): :class:`PackedCoreAttention`,
  causal attention inside each segment with torch's own kernels
  (:mod:`megascale_omni.models.packed_kernels`: one varlen flash call per
  layer on CUDA in fp16/bf16, else SDPA over batches of segments), and RoPE by a
  per-token gather (:class:`~megascale_omni.models.packed_rope.PackedSelfAttention`);
* transformer-engine spec: megatron's ``TEDotProductAttention``, which turns
  the spec's ``causal`` into ``padding_causal`` for ``thd`` (TE >= 1.7).

No dense ``[b, 1, s, s]`` mask exists anywhere on this path.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megascale_omni.models.packed_kernels import SegmentBatches, uses_varlen_flash, varlen_flash

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)
_BIDIRECTIONAL = (AttnMaskType.no_mask, AttnMaskType.padding)


@dataclass
class ThdPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` that also holds its boundaries as host ints, read
    from the device once per micro-batch: :class:`PackedCoreAttention` takes
    its segments from them at every layer instead of reading
    ``cu_seqlens_q`` back (a wait for the device per layer)."""

    #: ``cu_seqlens_q`` (= ``cu_seqlens_kv``, and the padded ones when set) as ints.
    host_cu_seqlens: Optional[tuple[int, ...]] = None
    #: What every layer derives from the boundaries (segment batches, RoPE
    #: positions), built by the first layer that needs it: one micro-batch's.
    derived: dict = field(default_factory=dict, repr=False, compare=False)


def derived(params: PackedSeqParams, key: tuple, build):
    """``build()`` computed once per micro-batch: cached in
    :attr:`ThdPackedSeqParams.derived` under ``key`` (other ``PackedSeqParams``: built every call)."""
    cache = getattr(params, "derived", None)
    if cache is None:
        return build()
    if key not in cache:
        cache[key] = build()
    return cache[key]


def packed_seq_params(cu_seqlens: torch.Tensor, with_padded: bool = False) -> ThdPackedSeqParams:
    """Self-attention ``PackedSeqParams`` for segments ``cu_seqlens``
    (``[n + 1]`` integer, 0 first, ``t`` last), on ``cu_seqlens.device``;
    the boundaries are read to the host once.

    ``with_padded`` also sets ``cu_seqlens_{q,kv}_padded`` to the same
    boundaries (segments already padded for context parallelism), which
    transformer-engine's THD context parallelism reads."""
    cu = cu_seqlens.to(torch.int32)
    bounds = cu.tolist()
    if cu.dim() != 1 or len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0, got {bounds}")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    padded = cu if with_padded else None
    return ThdPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
        cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded, host_cu_seqlens=tuple(bounds),
    )


def host_bounds(params: PackedSeqParams, cu: torch.Tensor) -> Sequence[int]:
    """``cu`` (one of ``params``' boundary tensors) as ints: the host copy
    :class:`ThdPackedSeqParams` carries, else read from ``cu``."""
    host = getattr(params, "host_cu_seqlens", None)
    return host if host is not None and cu is params.cu_seqlens_q else cu.tolist()


class ThdInputs(NamedTuple):
    """A micro-batch as the language model consumes it (see the module docstring)."""

    tokens: torch.Tensor  #: ``[1, t]`` int64
    position_ids: torch.Tensor  #: ``[1, t]`` int64, restarting at every segment
    labels: Optional[torch.Tensor]  #: ``[1, t]`` int64, or None when the batch has none
    packed_seq_params: PackedSeqParams


def thd_inputs(batch: Mapping[str, torch.Tensor], cp_size: int = 1) -> ThdInputs:
    """Flatten a collated micro-batch (``tokens``, ``position_ids`` and
    optionally ``labels``: ``[b, s]``; ``cu_seqlens``: ``[n + 1]`` over the
    row-major flattening) into :class:`ThdInputs`.

    Under context parallelism the per-token tensors are already this CP
    rank's ``t / cp_size`` tokens (:func:`cp_shard_batch`) while
    ``cu_seqlens`` stays global."""
    tokens = batch["tokens"]
    t = tokens.numel()
    params = packed_seq_params(batch["cu_seqlens"], with_padded=cp_size > 1)
    end = params.host_cu_seqlens[-1]
    if end != t * cp_size:
        raise ValueError(f"cu_seqlens ends at {end} but the micro-batch has {t} x cp={cp_size} tokens")
    labels = batch.get("labels")
    return ThdInputs(
        tokens.reshape(1, t),
        batch["position_ids"].reshape(1, t),
        None if labels is None else labels.reshape(1, t),
        params,
    )


#: Per-token entries of a THD micro-batch, split along the sequence under CP.
THD_TOKEN_KEYS = ("tokens", "position_ids", "labels", "loss_mask", "eval_mask", "video_mask")


def cp_shard_batch(batch: Mapping[str, torch.Tensor], cp_size: int, cp_rank: int) -> dict[str, torch.Tensor]:
    """This CP rank's share of a collated THD micro-batch: the per-token
    tensors (:data:`THD_TOKEN_KEYS`) become ``[1, t / cp_size]`` in the
    load-balanced split of :mod:`megascale_omni.parallel.context`;
    ``cu_seqlens`` and everything else stay whole. Adds ``cp_index``
    (``[t / cp_size]``, the global positions kept). Every segment must be a
    multiple of ``2 * cp_size`` long (``data.pad_to_multiple_of``)."""
    from megascale_omni.parallel.context import cp_token_index, shard_tokens

    if cp_size == 1:
        return dict(batch)
    index = cp_token_index(batch["cu_seqlens"], cp_size, cp_rank)
    out = shard_tokens(batch, THD_TOKEN_KEYS, index)
    out["cp_index"] = index
    return out


def thd_pipeline_shape(seq_length: int, micro_batch_size: int) -> tuple[int, int]:
    """``(seq_length, micro_batch_size)`` to give megatron's schedules so that
    their p2p buffers ``[seq, batch, hidden]`` match THD activations ``[t, 1, h]``."""
    return seq_length * micro_batch_size, 1


class PackedCoreAttention(MegatronModule):
    """Core attention of the local layer spec: causal (or bidirectional)
    attention inside each segment of ``PackedSeqParams``, never across, with
    torch's kernels (:mod:`megascale_omni.models.packed_kernels`).

    Same constructor as megatron's ``DotProductAttention``, so it drops into a
    ``SelfAttentionSubmodules(core_attention=...)`` spec. It holds no
    parameters and reads head counts from its inputs, so the same code runs
    for any TP degree (each rank sees its ``np / tp`` query heads and
    ``ng / tp`` key/value groups) and on any pipeline stage.

    Inputs (after megatron's ``Attention`` has applied RoPE):

    * THD (``packed_seq_params.qkv_format == "thd"``): query ``[t, np, hn]``,
      key/value ``[t, ng, hn]``; returns ``[t, np * hn]``.
    * no ``packed_seq_params``: query ``[s, b, np, hn]``, key/value
      ``[s, b, ng, hn]``, each batch row one segment; returns ``[s, b, np * hn]``.

    Grouped-query attention: query head ``i`` uses key/value group
    ``i // (np / ng)``, as in megatron. Attention dropout is applied in
    training mode, under megatron's TP-aware RNG tracker like
    ``DotProductAttention``. Dense attention masks are refused rather than
    ignored: segments come only from ``cu_seqlens``. Not supported (raise at
    construction): sliding windows, non-vanilla softmax, and attention
    dropout under context parallelism.

    Context parallelism (``config.context_parallel_size > 1``): inputs are
    this rank's tokens in the load-balanced split of
    :mod:`megascale_omni.parallel.context`, and attention runs as ring
    attention over the CP group (:mod:`megascale_omni.models.ring_attention`).
    For THD the ``PackedSeqParams`` stay *global*: ``cu_seqlens_q`` holds the
    real segment boundaries of the whole micro-batch and
    ``cu_seqlens_q_padded`` (optional) the padded ones, each a multiple of
    ``2 * cp``, transformer-engine's convention.

    Softmax scale: ``softmax_scale`` or ``1 / sqrt(kv_channels)``.
    megatron's ``apply_query_key_layer_scaling`` divides the scores by the
    layer number and multiplies them back inside its softmax, so the result
    is the same scale and it needs no handling here.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1 and (attention_dropout if attention_dropout is not None else config.attention_dropout):
            raise ValueError("ring attention (parallel.cp > 1) has no attention dropout; set attention_dropout: 0")
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        #: Run ring attention even when ``cp == 1`` (a ring of one rank): the
        #: context-parallel benchmark compares it with the plain path.
        self.force_ring = False
        if config.window_size is not None:
            raise ValueError("PackedCoreAttention does not implement sliding-window attention")
        if config.softmax_type != "vanilla":
            raise ValueError(f"PackedCoreAttention supports the vanilla softmax only, not {config.softmax_type!r}")
        if attn_mask_type not in _CAUSAL + _BIDIRECTIONAL:
            raise ValueError(f"PackedCoreAttention has no {attn_mask_type.name} masks; segments come from cu_seqlens")
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        self.causal = attn_mask_type in _CAUSAL
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("PackedCoreAttention takes no dense mask or bias; pass PackedSeqParams (cu_seqlens)")
        causal = self.causal if attn_mask_type is None else attn_mask_type in _CAUSAL
        dropout_p = self.dropout_p if self.training else 0.0
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        if self.cp_size > 1 or self.force_ring:
            return self._ring(query, key, value, packed_seq_params, causal)
        with rng:
            if packed_seq_params is None:
                s, b = query.shape[:2]
                # [s, b, n, d] -> [b, n, s, d]: every row is one segment.
                out = self._attend(*(x.permute(1, 2, 0, 3) for x in (query, key, value)), causal, dropout_p)
                return out.permute(2, 0, 1, 3).reshape(s, b, -1)
            return self._attend_thd(query, key, value, packed_seq_params, causal, dropout_p)

    def _ring(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Optional[PackedSeqParams],
        causal: bool,
    ) -> torch.Tensor:
        """Context parallelism: this rank's tokens in the load-balanced split
        (:mod:`megascale_omni.parallel.context`) attend over the CP group
        (:func:`~megascale_omni.models.ring_attention.ring_attention`).
        THD: ``[t / cp, n, d]`` -> ``[t / cp, n * d]``, segments from the
        global ``cu_seqlens_q`` (real) and ``cu_seqlens_q_padded``; ``[s / cp,
        b, n, d]`` -> ``[s / cp, b, n * d]``, each row one segment."""
        from megatron.core import parallel_state as mpu

        from megascale_omni.models.ring_attention import ring_attention
        from megascale_omni.parallel.context import LocalSegment, local_segments

        group = self.cp_group or mpu.get_context_parallel_group()
        if params is None:
            s, b = query.shape[:2]
            if s % 2:
                raise ValueError(f"ring attention: {s} local tokens per row, not the two chunks of a 2*cp split")
            segments = [LocalSegment(0, s // 2, s * self.cp_size)]
            heads_first = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, d]
            out = ring_attention(*heads_first, segments, causal=causal, scale=self.softmax_scale, group=group)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if params.qkv_format != "thd":
            raise ValueError(f"PackedCoreAttention reads qkv_format='thd' only, got {params.qkv_format!r}")
        padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        segments = local_segments(host_bounds(params, params.cu_seqlens_q), host_bounds(params, padded), self.cp_size)
        t = query.shape[0]
        heads_first = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, n, t, d]
        out = ring_attention(*heads_first, segments, causal=causal, scale=self.softmax_scale, group=group)
        return out[0].transpose(0, 1).reshape(t, -1)

    def _attend_thd(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams,
        causal: bool, dropout_p: float,
    ) -> torch.Tensor:
        """``[t, np, hn]`` query, ``[t, ng, hn]`` key/value -> ``[t, np * hn]``."""
        if params.qkv_format != "thd":
            raise ValueError(f"PackedCoreAttention reads qkv_format='thd' only, got {params.qkv_format!r}")
        cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
        if cu_kv is not cu_q and not torch.equal(cu_q, cu_kv):
            raise ValueError("PackedCoreAttention is self-attention: cu_seqlens_q must equal cu_seqlens_kv")
        t = query.shape[0]
        bounds = host_bounds(params, cu_q)
        if bounds[0] != 0 or bounds[-1] != t:
            raise ValueError(f"cu_seqlens span [{bounds[0]}, {bounds[-1]}) but the sequence has {t} tokens")
        if uses_varlen_flash(query):
            longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
            out = varlen_flash(query, key, value, cu_q.to(torch.int32), longest, causal, self.softmax_scale, dropout_p)
        else:
            batches = derived(params, ("segment_batches", causal, query.device),
                              lambda: SegmentBatches(bounds, causal, query.device))
            out = batches.attend(query, key, value, causal, self.softmax_scale, dropout_p)
        return out.reshape(t, -1)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float
    ) -> torch.Tensor:
        """SDPA on ``[n, np, L, hn]`` query and ``[n, ng, L, hn]`` key/value
        (grouped-query heads broadcast by the kernel, never repeated)."""
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale, enable_gqa=True
        )
