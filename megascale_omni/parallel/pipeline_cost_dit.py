"""Pipeline cost model of the DiT (``model.family: dit``, models/dit/model.py).

One micro-batch is one bucket package: the images of one aspect-ratio bucket,
``dit.token_budget // n`` of them for a bucket of ``n`` tokens per image,
each with a caption of ``dit.max_text_length`` tokens. The model counts
``N = dit.token_budget`` image tokens per micro-batch (a full package) and
takes ``n`` from the bucket with the most tokens per image: the quadratic
attention terms and their activations are largest there, so the memory the
plan reports is the package that needs the most. The ``N / n`` images of
that package bring ``N / n * max_text_length`` caption tokens.
The step record evaluates the same components on the packages a step
really trained (``batch``): each package's images of its own bucket, padding
slots excluded.

Components, in pipeline order (see :class:`~megascale_omni.parallel.pipeline_cost.PipelineCostModel`):

- head (stage 0): ``patch_embedding`` (patch linear + 2-D positions),
  ``text_embedding`` (learned caption embedding, or none for precomputed
  states, + the text projection), ``condition`` (timestep MLP + pooled-caption MLP);
- layer: ``dit_block`` (adaLN modulation linear, self-attention over the
  image tokens, cross-attention to the caption, MLP);
- tail (last stage): ``dit_output`` (final adaLN + linear + MSE loss).

Context parallelism (``parallel.cp``): the costs are those of one CP rank,
which holds ``N / cp`` image tokens (``n / cp`` of each image). Everything
per image token (patch embedding, linears, MLP, output) scales by ``1 /
cp``; self-attention takes the local queries against all ``n`` keys of
their image (``1 / cp`` of the score FLOPs and probabilities); the caption
states, their cross-attention keys and values, and the condition are
computed whole on every CP rank. The ring's key/value traffic is not
counted (FLOPs and bytes only).

Every DiT weight trains (the DiT ignores ``model.freeze``; it refuses
``model.recompute`` other than ``none``); with ``dit.ema_decay > 0`` each parameter also keeps
an EMA copy in the weights' dtype. Activation bytes follow the same
accounting as :func:`~megascale_omni.parallel.pipeline_cost._transformer_layer`
(:mod:`megascale_omni.parallel.activations`) without recomputation.
"""

from __future__ import annotations

from typing import Optional

from megascale_omni.config.schema import JobConfig
from megascale_omni.parallel.activations import RECOMPUTE_NONE
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.parallel.pipeline_cost import (
    ComponentCost,
    PipelineCostModel,
    _dtype_bytes,
    _passes,
    _transformer_layer,
    memory_conventions,
    padded_vocab_size,
)

#: Component names of the DiT cost model.
PATCH_EMBEDDING, TEXT_EMBEDDING, CONDITION, DIT_BLOCK, DIT_OUTPUT = (
    "patch_embedding", "text_embedding", "condition", "dit_block", "dit_output",
)
COMPONENTS = (PATCH_EMBEDDING, TEXT_EMBEDDING, CONDITION, DIT_BLOCK, DIT_OUTPUT)
#: Width of the sinusoidal timestep features fed to the timestep MLP. Defined
#: here, where the MLP is counted; models/dit/model.py builds it with this
#: constant (parallel/ may not import models/).
TIME_FEATURES = 128
#: Modulation vectors of a block: (shift, scale, gate) for each of its 3 branches.
BLOCK_MODULATION = 9


def _linear(tokens: float, n_in: int, n_out: int, passes: float, tp: int) -> tuple[float, int]:
    """(forward+backward FLOPs, parameters) of a biased ``n_in -> n_out``
    linear on ``tokens`` rows, sharded over ``tp`` ranks."""
    return passes * 2.0 * tokens * n_in * n_out / tp, (n_in * n_out + n_out) // tp


def _mlp(tokens: float, n_in: int, ffn: int, h: int, passes: float, tp: int) -> tuple[float, int]:
    """(FLOPs, parameters) of megatron's 2-matrix MLP ``n_in -> ffn -> h``."""
    f1, p1 = _linear(tokens, n_in, ffn, passes, tp)
    f2, p2 = _linear(tokens, ffn, h, passes, tp)
    return f1 + f2, p1 + p2


def dit_package(cfg: JobConfig) -> tuple[float, int, float]:
    """``(image tokens N, tokens per image n, images N / n)`` of the micro-batch
    the cost model describes (see the module docstring)."""
    d = cfg.dit
    n = max((hh // d.patch_size) * (ww // d.patch_size) for hh, ww in d.buckets)
    tokens = float(d.token_budget)
    return tokens, n, tokens / n


def dit_cost_model(cfg: JobConfig, cuda: bool = False, world_size: Optional[int] = None,
                   batch: Optional[BatchShape] = None) -> PipelineCostModel:
    """:data:`~megascale_omni.parallel.pipeline_cost.CostModelFn` of a DiT for
    one bucket package of ``dit.token_budget`` image tokens and
    ``dit.max_text_length`` caption tokens per image (module docstring), or
    for every package of ``batch`` (their costs summed).
    No measured profile applies (``shape`` is None)."""
    nbytes = _dtype_bytes(cfg, cuda)
    if batch is None:
        components = _package_components(cfg, nbytes, *dit_package(cfg))
    else:
        parts = [_package_components(cfg, nbytes, float(n * k), n, float(k)) for n, k in batch.dit_packages]
        components = {name: _sum_costs([p[name] for p in parts]) for name in COMPONENTS}
    mem = memory_conventions(cfg, cuda, world_size)
    ema_bytes = mem.bytes_per_frozen_param if cfg.dit.ema_decay > 0 else 0.0
    return PipelineCostModel(
        components=components,
        head=(PATCH_EMBEDDING, TEXT_EMBEDDING, CONDITION),
        tail=(DIT_OUTPUT,),
        layer=DIT_BLOCK,
        bytes_per_trainable_param=mem.bytes_per_trainable_param + ema_bytes,
        bytes_per_frozen_param=mem.bytes_per_frozen_param + ema_bytes,
        num_microbatches=mem.num_microbatches,
    )


def _sum_costs(costs: list[ComponentCost]) -> ComponentCost:
    """One component over several packages: FLOPs and activations add, the weights are shared."""
    if not costs:
        return ComponentCost(0.0, 0, 0, 0.0)
    return ComponentCost(sum(c.flops for c in costs), costs[0].params, costs[0].trainable_params,
                         sum(c.activation_bytes for c in costs))


def _package_components(cfg: JobConfig, nbytes: int, package_tokens: float, n: int,
                        images: float) -> dict[str, ComponentCost]:
    """Every component's cost for one package of ``images`` images of ``n``
    tokens each (``package_tokens`` in all) on one TP and CP rank."""
    m, d, tp, cp = cfg.model, cfg.dit, cfg.parallel.tp, cfg.parallel.cp
    h, ffn, heads = m.hidden_size, m.ffn_size, m.num_attention_heads
    tokens = package_tokens / cp  # this CP rank's image tokens
    text_tokens = images * d.max_text_length
    patch_dim = d.in_channels * d.patch_size**2
    learned_text = d.text_encoder == "learned"
    text_dim = d.text_dim or h

    # Head. Noisy images and timesteps enter without gradient: their first
    # linears compute weight gradients only (2 passes), the rest 3.
    patch_flops, patch_params = _linear(tokens, patch_dim, h, _passes(True, False), tp)
    patch = ComponentCost(
        flops=patch_flops + tokens * h,  # + positions
        params=patch_params, trainable_params=patch_params,
        activation_bytes=tokens * (patch_dim + h) * nbytes,
    )
    emb_params = padded_vocab_size(cfg) * text_dim // tp if learned_text else 0
    proj_flops, proj_params = _linear(text_tokens, text_dim, h, _passes(True, learned_text), tp)
    text = ComponentCost(
        flops=proj_flops + (2.0 * text_tokens * text_dim if learned_text else 0.0),  # gather + its gradient
        params=emb_params + proj_params, trainable_params=emb_params + proj_params,
        # Projection input and the caption states (ctx) every block reads.
        activation_bytes=text_tokens * (text_dim + h) * nbytes,
    )
    # The timestep features need no gradient, but the MLP's second linear
    # does pass one back (the first linear's weights train).
    time_in_flops, time_in_params = _linear(images, TIME_FEATURES, ffn, _passes(True, False), tp)
    time_out_flops, time_out_params = _linear(images, ffn, h, _passes(True, True), tp)
    time_flops, time_params = time_in_flops + time_out_flops, time_in_params + time_out_params
    pooled_flops, pooled_params = _mlp(images, h, ffn, h, _passes(True, True), tp)
    cond_params = time_params + pooled_params
    condition = ComponentCost(
        flops=time_flops + pooled_flops + 2.0 * text_tokens * h,  # + masked caption mean
        params=cond_params, trainable_params=cond_params,
        activation_bytes=images * (TIME_FEATURES + 2 * h + 4 * ffn) * nbytes / tp,
    )

    # One block: self-attention + MLP as a pre-norm transformer layer without
    # norm weights (the adaLN norms are affine-free), plus cross-attention and
    # the modulation linear. Gradients flow through every block (the head trains).
    # Self-attention is bidirectional over each image's n tokens: n * n pairs per image.
    base = _transformer_layer(package_tokens, images * n * n, h, ffn, heads, heads, nbytes, RECOMPUTE_NONE, True, True, tp, cp=cp)
    passes = _passes(True, True)
    q_flops, q_params = _linear(tokens, h, h, passes, tp)
    kv_flops, kv_params = _linear(text_tokens, h, 2 * h, passes, tp)
    o_flops, o_params = _linear(tokens, h, h, passes, tp)
    # Scores and attention-times-values: each image's n tokens against its caption.
    cross_core = passes * 4.0 * tokens * d.max_text_length * h / tp
    mod_flops, mod_params = _linear(images, h, BLOCK_MODULATION * h, passes, tp)
    block_params = base.params - 4 * h // tp + q_params + kv_params + o_params + mod_params
    # Beyond the layer's own: the third norm's input, three modulated-norm
    # outputs and three gated branch outputs; the cross-attention's query
    # input, Q and projection input; K and V of the caption; its softmax.
    extra_elems = 10.0 * tokens * h + 2.0 * text_tokens * h + 2.0 * images * heads * (n / cp) * d.max_text_length
    block = ComponentCost(
        flops=base.flops + q_flops + kv_flops + o_flops + cross_core + mod_flops,
        params=block_params, trainable_params=block_params,
        activation_bytes=base.activation_bytes + extra_elems * nbytes / tp,
    )

    # Tail: final adaLN (shift, scale) + linear, then the per-token squared
    # error in fp32 (~3 ops per value forward and backward).
    ada_flops, ada_params = _linear(images, h, 2 * h, passes, tp)
    out_flops, out_params = _linear(tokens, h, patch_dim, passes, tp)
    out = ComponentCost(
        flops=ada_flops + out_flops + 6.0 * tokens * patch_dim,
        params=ada_params + out_params, trainable_params=ada_params + out_params,
        # Norm input, modulated norm, linear input; prediction and target in fp32.
        activation_bytes=3.0 * tokens * h * nbytes + 2.0 * tokens * patch_dim * 4,
    )
    return {PATCH_EMBEDDING: patch, TEXT_EMBEDDING: text, CONDITION: condition, DIT_BLOCK: block, DIT_OUTPUT: out}
