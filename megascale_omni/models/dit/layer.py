"""One DiT block: adaLN-Zero modulated self-attention, cross-attention to the
caption, and MLP, built from megatron-core modules (TP-sharded linears,
megatron attention)."""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

#: Modulation vectors per block: (shift, scale, gate) for each of the three branches.
_BRANCHES = 3


def mark_zero_init(module: torch.nn.Module) -> None:
    """Tag every parameter of ``module`` to be initialised to zero by
    :func:`megascale_omni.models.init.init_layout_invariant` (adaLN-Zero)."""
    for p in module.parameters():
        p.zero_init = True


def modulation_linear(config: TransformerConfig, in_size: int, out_size: int) -> ColumnParallelLinear:
    """Column-parallel linear whose output is gathered on every TP rank: the
    modulation vectors scale the full (unsharded) hidden state."""
    return ColumnParallelLinear(
        in_size, out_size, config=config, init_method=config.init_method, gather_output=True, bias=True,
        skip_bias_add=False,
    )


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """Affine-free LayerNorm: with adaLN the scale and shift come from the condition."""
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [s, b, h]`` with per-sample ``shift/scale [1, b, h]``."""
    return x * (1.0 + scale) + shift


def _with_bias(out_and_bias: tuple[torch.Tensor, Optional[torch.Tensor]]) -> torch.Tensor:
    out, bias = out_and_bias
    return out if bias is None else out + bias


class DiTLayer(MegatronModule):
    """adaLN-Zero DiT block (every rank of the stage that holds it).

    ``forward(x [N, B, h], cond [B, h], context [L, B, h], context_mask
    [B, 1, 1, L] bool, True = padding)`` returns ``[N, B, h]``. The modulation
    linear starts at zero, so every gate is 0 and the block is the identity
    at initialisation.

    Context parallelism (``config.context_parallel_size > 1``): ``x`` holds
    this CP rank's tokens; the self-attention spec attends over the CP group
    (:func:`~megascale_omni.models.specs.dit_layer_specs`), while the
    cross-attention is built with CP switched off, since every rank holds
    the whole caption and its local queries need nothing from other ranks.
    """

    def __init__(self, config: TransformerConfig, specs: tuple[ModuleSpec, ModuleSpec, ModuleSpec], layer_number: int):
        super().__init__(config=config)
        h = config.hidden_size
        self_spec, cross_spec, mlp_spec = specs
        self.adaln = modulation_linear(config, h, 3 * _BRANCHES * h)
        mark_zero_init(self.adaln)
        self.self_attention = build_module(
            self_spec, config=config, layer_number=layer_number, cp_comm_type=config.cp_comm_type
        )
        self.cross_attention = build_module(cross_spec, config=_without_cp(config), layer_number=layer_number)
        self.mlp = build_module(mlp_spec, config=config)

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor
    ) -> torch.Tensor:
        mod, _ = self.adaln(F.silu(cond).unsqueeze(0))  # [1, B, 9h]
        (s1, c1, g1, s2, c2, g2, s3, c3, g3) = mod.chunk(3 * _BRANCHES, dim=-1)
        y = modulate(layer_norm(x), s1, c1)
        x = x + g1 * _with_bias(self.self_attention(y, attention_mask=None))
        y = modulate(layer_norm(x), s2, c2)
        x = x + g2 * _with_bias(self.cross_attention(y, attention_mask=context_mask, key_value_states=context))
        y = modulate(layer_norm(x), s3, c3)
        return x + g3 * _with_bias(self.mlp(y))


def _without_cp(config: TransformerConfig) -> TransformerConfig:
    """``config`` with ``context_parallel_size`` 1 (megatron's attention then
    never touches the CP group; the CP group itself stays as it is)."""
    if config.context_parallel_size == 1:
        return config
    local = copy.copy(config)
    local.context_parallel_size = 1
    return local


class DiTLayerStack(MegatronModule):
    """This pipeline stage's blocks, registered under their *global* indices
    (``"0"``, ``"1"``, ... on stage 0; ``"2"``, ``"3"`` on stage 1 of a 4-layer
    PP2 model), so parameter keys, the layout-invariant init and checkpoints
    name a block the same way under any pipeline split."""

    def __init__(self, config: TransformerConfig, specs, first: int, count: int):
        super().__init__(config=config)
        for i in range(first, first + count):
            self.add_module(str(i), DiTLayer(config, specs, layer_number=i + 1))

    def forward(self, x, cond, context, context_mask):
        for layer in self.children():
            x = layer(x, cond, context, context_mask)
        return x
