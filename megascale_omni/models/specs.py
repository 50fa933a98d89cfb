"""Which layer implementation to build: megatron local modules or transformer-engine.

Specs separate *which* implementation from *how* a block is wired. On CPU we
always use megatron's local modules; on CUDA ``auto`` picks transformer-engine
when it imports. transformer-engine is never imported on a CPU run.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megascale_omni.config.errors import ConfigError

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


def gpt_layer_spec(impl: str, normalization: str) -> ModuleSpec:
    """Transformer-layer spec for the language model (``impl`` already resolved)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization)


def dit_layer_specs(impl: str) -> tuple[ModuleSpec, ModuleSpec, ModuleSpec]:
    """``(self_attention, cross_attention, mlp)`` specs of a DiT block.

    The adaLN modulation sits between the norm and the first linear of each
    branch, so the fused norm+linear modules of transformer-engine's GPT spec
    cannot be used; the unfused TE linears and TE attention can.
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
    self_attention = ModuleSpec(
        module=SelfAttention,
        # Image tokens attend to each other in both directions.
        params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=SelfAttentionSubmodules(
            linear_qkv=column, core_attention=core, linear_proj=row, q_layernorm=IdentityOp, k_layernorm=IdentityOp
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
