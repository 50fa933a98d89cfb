"""Layout-invariant weight initialisation.

megatron initialises each rank's shard from that rank's RNG stream, so the
full weights of a TP2 model differ from the TP1 model with the same seed, and
PP stages draw in a different order than a single stage would. To compare
layouts numerically (and to make a run reproducible whatever its layout) we
initialise every parameter from its *global* identity instead:

    full = N(0, std) drawn from a generator seeded by (seed, checkpoint key)
    shard = full[global_offset : global_offset + local_shape]

megatron's ``sharded_state_dict`` already names every parameter by its
layout-independent checkpoint key, with the global shape and this rank's
offset, so it is the natural index.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.transformer.module import MegatronModule


def _key_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _norm_param_storage(module: torch.nn.Module) -> set[int]:
    """Storage pointers of every parameter owned by a normalisation module.

    Identified by module type name (LayerNorm, RMSNorm, megatron's
    WrappedTorchNorm/FusedLayerNorm, TE norms) rather than by parameter name,
    because names vary (``ln_pre``, ``input_layernorm``, ``final_layernorm``).
    """
    ptrs = set()
    for m in module.modules():
        if "norm" in type(m).__name__.lower():
            ptrs.update(p.data_ptr() for p in m.parameters(recurse=False))
    return ptrs


def _zero_init_storage(module: torch.nn.Module) -> set[int]:
    """Storage pointers of parameters tagged ``zero_init`` (e.g. DiT's adaLN-Zero
    modulation and output layers, which must start at exactly zero)."""
    return {p.data_ptr() for p in module.parameters() if getattr(p, "zero_init", False)}


def _full_init(
    key: str, shape: tuple[int, ...], seed: int, std: float, num_layers: int, stream: str, is_norm: bool
) -> torch.Tensor:
    """Full (unsharded) initial value of parameter ``key``; ``stream`` names
    the random stream (the key plus its layer index for stacked layers)."""
    leaf = key.rsplit(".", 1)[-1]
    # Fused TE linears carry their norm as "layer_norm_weight"/"layer_norm_bias".
    is_norm = is_norm or "norm" in leaf
    is_bias = leaf.endswith("bias")
    if is_norm and not is_bias:
        return torch.ones(shape)
    if is_bias or is_norm:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(_key_seed(seed, stream))
    # GPT-2 style: scale output projections of residual branches by depth.
    if key.endswith("linear_proj.weight") or key.endswith("linear_fc2.weight"):
        std = std / math.sqrt(2.0 * max(num_layers, 1))
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_layout_invariant(
    chunks: Iterable[MegatronModule], seed: int, std: float, num_layers: int
) -> int:
    """Overwrite every parameter of ``chunks`` from (seed, global key) (every rank).

    Norm weights become 1, biases 0, parameters tagged ``zero_init`` 0,
    matrices N(0, std) with output projections scaled by ``1/sqrt(2 * num_layers)``. Returns the number of
    tensors initialised. Call before wrapping in DDP so grad buffers are
    created from the final values.
    """
    count = 0
    for chunk in chunks:
        norm_ptrs = _norm_param_storage(chunk)
        zero_ptrs = _zero_init_storage(chunk)
        sharded, _ = extract_sharded_tensors_and_factories(chunk.sharded_state_dict())
        # Factories (e.g. SwiGLU's fc1, [gate; up] sharded as two halves per
        # TP rank) build sharded views of the local tensor.
        built = [factory.build() for factory in _iter_of(sharded, ShardedTensorFactory)]
        for sh in _iter_of([sharded, built], ShardedTensor):
            if sh.data is None or not sh.data.is_floating_point() or sh.key.endswith("_extra_state"):
                continue
            # Leading "prepend" axes index stacked layers: each layer is drawn
            # on its own so only one layer's full tensor is materialised.
            npre = sh.prepend_axis_num
            layer_key = sh.key + "".join(f"[{i}]" for i in sh.global_offset[:npre])
            if sh.data.data_ptr() in zero_ptrs:
                full = torch.zeros(tuple(sh.global_shape[npre:]))
            else:
                full = _full_init(
                    sh.key, tuple(sh.global_shape[npre:]), seed, std, num_layers,
                    stream=layer_key, is_norm=sh.data.data_ptr() in norm_ptrs,
                )
            index = tuple(
                slice(off, off + size) for off, size in zip(sh.global_offset[npre:], sh.data.shape)
            )
            sh.data.copy_(full[index].to(sh.data.dtype))
            count += 1
    return count


def _iter_of(tree, kind: type) -> Iterable:
    """Every ``kind`` instance in a nested dict/list state (depth first)."""
    if isinstance(tree, kind):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _iter_of(v, kind)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _iter_of(v, kind)
