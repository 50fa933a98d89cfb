"""Which layer implementation to build: megatron local modules or transformer-engine.

Specs separate *which* implementation from *how* a block is wired. On CPU we
always use megatron's local modules; on CUDA ``auto`` picks transformer-engine
when it imports. transformer-engine is never imported on a CPU run.

The language model's attention consumes packed sequences as THD
(:mod:`megascale_omni.models.attention`): the local spec's core attention is
our :class:`~megascale_omni.models.attention.PackedCoreAttention`; TE's
attention reads the same ``PackedSeqParams`` natively.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megascale_omni.config.errors import ConfigError
from megascale_omni.models.attention import PackedCoreAttention
from megascale_omni.models.packed_rope import PackedSelfAttention

logger = logging.getLogger(__name__)


def resolve_layer_impl(requested: str) -> str:
    """Map ``model.layer_impl`` to ``local`` or ``transformer_engine`` for this host."""
    te_available = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    if requested == "auto":
        return "transformer_engine" if te_available else "local"
    if requested == "transformer_engine" and not te_available:
        raise ConfigError(
            "model.layer_impl",
            requested,
            "transformer-engine needs CUDA and `pip install megascale-omni[gpu]`; use auto or local",
        )
    return requested


#: ``parallel.cp_comm_type`` -> transformer-engine's name for it (TE raises
#: on ``allgather``).
_TE_CP_COMM_TYPE = {"p2p": "p2p", "a2a": "a2a", "allgather": "all_gather", "a2a+p2p": "a2a+p2p"}


def te_cp_comm_type(cp_comm_type: str) -> str:
    """``parallel.cp_comm_type`` as ``TransformerConfig.cp_comm_type``
    (transformer-engine's vocabulary); the local spec ignores it."""
    try:
        return _TE_CP_COMM_TYPE[cp_comm_type]
    except KeyError:
        raise ConfigError(
            "parallel.cp_comm_type", cp_comm_type, f"must be one of {', '.join(_TE_CP_COMM_TYPE)}"
        ) from None


def gpt_layer_spec(impl: str, normalization: str, num_experts: Optional[int] = None,
                   moe_grouped_gemm: bool = False, qk_layernorm: bool = False) -> ModuleSpec:
    """Transformer-layer spec for the language model (``impl`` already resolved).
    With ``num_experts`` its MLP is megatron's ``MoELayer`` (docs/moe.md):
    ``SequentialMLP`` experts with the local spec, ``TEGroupedMLP`` with
    transformer-engine and ``moe_grouped_gemm``.

    Both specs keep megatron's ``causal`` self-attention; with THD batches
    megatron's ``TEDotProductAttention`` runs it as ``padding_causal`` over
    ``cu_seqlens``, and the local spec's core attention is swapped for
    :class:`~megascale_omni.models.attention.PackedCoreAttention` (megatron's
    ``DotProductAttention`` rejects ``PackedSeqParams``) and its
    self-attention for :class:`~megascale_omni.models.packed_rope.PackedSelfAttention`
    (RoPE on THD without host reads per layer). ``qk_layernorm`` adds
    megatron's per-head query/key norms (Qwen3).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization, num_experts=num_experts,
                                                    qk_layernorm=qk_layernorm)
    # A fresh spec per call: replacing the submodule touches nothing shared.
    spec.submodules.self_attention.module = PackedSelfAttention
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    return spec


class SequenceParallelTorchNorm:
    """The local spec's LayerNorm/RMSNorm (``torch.nn``, as megatron's
    ``WrappedTorchNorm`` builds it) that also runs under sequence parallelism.

    ``WrappedTorchNorm`` refuses ``sequence_parallel``, although a norm needs
    nothing from it but one tag: under SP every TP rank normalises its own
    ``s / tp`` tokens with a replicated weight, so each rank's weight
    gradient is a partial sum, and megatron's ``finalize_model_grads``
    all-reduces over TP the gradients of parameters tagged
    ``sequence_parallel`` (what apex's and TE's norms tag). Without SP the tag
    is False and this is ``WrappedTorchNorm``'s module.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        norm_cls = torch.nn.LayerNorm if config.normalization == "LayerNorm" else torch.nn.RMSNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def gpt_decoder_spec(impl: str, normalization: str, config, vp_stage: Optional[int]):
    """The decoder spec of one GPT model chunk (every rank, per chunk):
    :func:`gpt_layer_spec`, and under the local spec a block spec whose
    norms (both per layer and the final one) are
    :class:`SequenceParallelTorchNorm`, so ``parallel.sequence_parallel``
    runs on CPU. It lists this chunk's layers (``vp_stage`` of this pp rank),
    as megatron's own block specs do. TE's layer norms handle SP themselves.

    An MoE model (``config.num_moe_experts``) gets megatron's MoE MLP in the
    layers ``moe.layer_freq`` names and the dense MLP elsewhere
    (:func:`~megascale_omni.models.moe.chunk_layer_pattern`; docs/moe.md)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megascale_omni.models.moe import chunk_layer_pattern

    def layer(num_experts: Optional[int] = None) -> ModuleSpec:
        spec = gpt_layer_spec(impl, normalization, num_experts, config.moe_grouped_gemm, config.qk_layernorm)
        if impl != "transformer_engine":
            spec.submodules.input_layernorm = SequenceParallelTorchNorm
            spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
            if config.qk_layernorm:
                # Per-head norms whose weight every head shares: under TP each rank's
                # gradient is a partial sum, which finalize_model_grads all-reduces by
                # name (``q_layernorm``/``k_layernorm``); megatron's WrappedTorchNorm
                # would refuse sequence parallelism.
                attention = spec.submodules.self_attention.submodules
                attention.q_layernorm = attention.k_layernorm = SequenceParallelTorchNorm
        return spec

    if config.num_moe_experts:
        dense, routed = layer(), layer(config.num_moe_experts)
        layers = [routed if is_moe else dense for is_moe in chunk_layer_pattern(config, vp_stage)]
    elif impl == "transformer_engine":
        return layer()
    else:
        layers = [layer()] * get_num_layers_to_build(config, vp_stage=vp_stage)
    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TENorm)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelTorchNorm)


def vit_layer_spec(impl: str) -> ModuleSpec:
    """Transformer-layer spec of the vision tower: bidirectional self-attention
    over each image's tokens (images are never packed; no mask is passed).

    megatron's local ViT spec declares ``causal`` attention and expects an
    all-False dense mask to make it bidirectional, which its fused bf16
    causal softmax ignores; ours declares ``no_mask`` and uses
    :class:`~megascale_omni.models.attention.PackedCoreAttention`, as the
    language model does. The TE spec already declares ``no_mask``.
    """
    from megatron.core.models.vision import vit_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    if impl == "transformer_engine":
        return vit_layer_specs.get_vit_layer_with_transformer_engine_spec()
    spec = vit_layer_specs.get_vit_layer_with_local_spec()
    attention = spec.submodules.self_attention  # a fresh spec per call
    attention.params = {**attention.params, "attn_mask_type": AttnMaskType.no_mask}
    attention.submodules.core_attention = PackedCoreAttention
    return spec


def dit_layer_specs(impl: str, context_parallel: bool = False) -> tuple[ModuleSpec, ModuleSpec, ModuleSpec]:
    """``(self_attention, cross_attention, mlp)`` specs of a DiT block.

    The adaLN modulation sits between the norm and the first linear of each
    branch, so the fused norm+linear modules of transformer-engine's GPT spec
    cannot be used; the unfused TE linears and TE attention can.

    ``context_parallel``: the image tokens are split over the CP group. The
    local spec's self-attention core is then
    :class:`~megascale_omni.models.attention.PackedCoreAttention`, which runs
    ring attention (megatron's ``DotProductAttention`` refuses CP); without
    CP it stays ``DotProductAttention``, so CP1 numerics do not change. TE
    attention does its own CP from the config's ``context_parallel_size``
    and ``cp_comm_type``.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import (
        CrossAttention,
        CrossAttentionSubmodules,
        SelfAttention,
        SelfAttentionSubmodules,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    column, row, core = ColumnParallelLinear, RowParallelLinear, DotProductAttention
    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TEDotProductAttention,
            TERowParallelLinear,
        )

        column, row, core = TEColumnParallelLinear, TERowParallelLinear, TEDotProductAttention
    self_core = PackedCoreAttention if context_parallel and impl != "transformer_engine" else core
    self_attention = ModuleSpec(
        module=SelfAttention,
        # Image tokens attend to each other in both directions.
        params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=SelfAttentionSubmodules(
            linear_qkv=column, core_attention=self_core, linear_proj=row, q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )
    cross_attention = ModuleSpec(
        module=CrossAttention,
        # Caption padding is masked with a [b, 1, 1, text_len] mask.
        params={"attn_mask_type": AttnMaskType.arbitrary},
        submodules=CrossAttentionSubmodules(linear_q=column, linear_kv=column, core_attention=core, linear_proj=row),
    )
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row))
    return self_attention, cross_attention, mlp
