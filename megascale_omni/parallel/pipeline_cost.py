"""Per-component training cost of a pipelined model: time and memory.

The pipeline partitioner needs, for one micro-batch on one TP rank:

- the forward+backward time of every component that a pipeline stage can
  hold: the vision encoder, the projector, the token embedding, one
  language-model decoder layer, and the output layer + loss;
- the bytes each component pins for the whole run (weights, gradients,
  optimizer state) and the activation bytes it keeps from forward to
  backward for each micro-batch in flight.

Time comes from FLOPs (this module) or from a measured profile
(``tools/profile_layers.py``, loaded by :func:`load_profile`). Only ratios of
times matter to the partitioner, so the FLOP model needs no device peak.
Pure Python: the planner runs before any process group or model exists.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

from megascale_omni.config.errors import ConfigError
from megascale_omni.config.schema import JobConfig

#: Component names, in pipeline order. ``lm_layer`` is the cost of *one*
#: decoder layer; the others appear once in the model.
VISION, PROJECTOR, EMBEDDING, LM_LAYER, OUTPUT = "vision", "projector", "embedding", "lm_layer", "output"
#: Profile JSON format version written by tools/profile_layers.py.
PROFILE_VERSION = 1


@dataclass(frozen=True)
class ComponentCost:
    """Cost of one component for one micro-batch on one TP rank.

    ``flops``: forward+backward FLOPs. ``seconds``: measured forward+backward
    seconds, or None without a profile. ``params``/``trainable_params``:
    parameter counts. ``activation_bytes``: bytes kept from forward to backward.
    """

    flops: float
    params: int
    trainable_params: int
    activation_bytes: float
    seconds: Optional[float] = None


@dataclass(frozen=True)
class PipelineCostModel:
    """Costs of every component plus the memory conventions of the run.

    ``head``/``tail`` name the components fixed to the first model chunk
    (pp rank 0, virtual stage 0) and the last one (last pp rank, last virtual
    stage). ``unit`` is ``"s"`` when every time is measured, else ``"FLOP"``.
    """

    components: Mapping[str, ComponentCost]
    head: tuple[str, ...]
    tail: tuple[str, ...]
    #: Bytes per trainable parameter: weights + gradient + optimizer state.
    bytes_per_trainable_param: float
    #: Bytes per frozen parameter: weights only.
    bytes_per_frozen_param: float
    #: Micro-batches per step on one DP rank (bounds the activations in flight).
    num_microbatches: int
    unit: str = "FLOP"
    #: Where the times came from (for the plan table).
    source: str = "FLOP model"
    shape: Mapping[str, object] = field(default_factory=dict)

    def time(self, name: str) -> float:
        """Forward+backward time of one component for one micro-batch
        (seconds when ``unit == 's'``, FLOPs otherwise)."""
        c = self.components[name]
        return c.seconds if self.unit == "s" else c.flops

    def static_bytes(self, name: str) -> float:
        """Weights + gradients + optimizer state of one component, bytes."""
        c = self.components[name]
        frozen = c.params - c.trainable_params
        return c.trainable_params * self.bytes_per_trainable_param + frozen * self.bytes_per_frozen_param

    def activation_bytes(self, name: str) -> float:
        return self.components[name].activation_bytes

    @property
    def layer_time(self) -> float:
        return self.time(LM_LAYER)

    @property
    def head_time(self) -> float:
        return sum(self.time(n) for n in self.head)

    @property
    def tail_time(self) -> float:
        return sum(self.time(n) for n in self.tail)


# ---------------------------------------------------------------- the model


def _dtype_bytes(cfg: JobConfig, cuda: bool) -> int:
    precision = cfg.train.precision
    return 4 if precision == "fp32" or (precision == "auto" and not cuda) else 2


def _passes(trainable: bool, grad_flows: bool) -> float:
    """Forward-equivalents per micro-batch: backward costs one forward for
    input gradients and one for weight gradients."""
    return 1.0 + (1.0 if grad_flows else 0.0) + (1.0 if trainable else 0.0)


def _transformer_layer(
    tokens: float, seq: int, sequences: float, hidden: int, ffn: int, heads: int, groups: int,
    dtype_bytes: int, recompute: bool, trainable: bool, grad_flows: bool, tp: int,
) -> ComponentCost:
    """One pre-norm transformer layer (attention + 2-matrix MLP) on ``tokens``
    = ``sequences * seq`` positions, split over ``tp`` ranks. ``grad_flows``:
    backward passes through it (something before it trains)."""
    head_dim = hidden // heads
    qkv = hidden * (hidden + 2 * groups * head_dim)
    matmul_params = qkv + hidden * hidden + 2 * hidden * ffn
    # 2 FLOPs per multiply-add; QK^T and attention-times-V are 2*s*s*h each.
    forward = 2.0 * tokens * matmul_params + 4.0 * sequences * seq * seq * hidden
    backward = trainable or grad_flows
    passes = _passes(trainable, grad_flows) + (1.0 if recompute and backward else 0.0)
    params = matmul_params + (hidden + 2 * groups * head_dim) + hidden + ffn + hidden + 4 * hidden
    if not backward:
        act_elems = 0.0
    elif recompute:
        # Only the layer input survives; one layer's full set is rebuilt at a time.
        act_elems = tokens * hidden
    else:
        # Inputs of both norms, QKV, the projection, fc1; Q, K, V; fc1 and
        # GELU outputs; softmax probabilities (and their pre-mask scores).
        act_elems = 8.0 * tokens * hidden + 2.0 * tokens * ffn + 2.0 * sequences * heads * seq * seq
    return ComponentCost(
        flops=passes * forward / tp,
        params=params // tp,
        trainable_params=params // tp if trainable else 0,
        activation_bytes=act_elems * dtype_bytes / tp,
    )


def padded_vocab_size(cfg: JobConfig) -> int:
    """Vocabulary rows of the embedding/output layer. ``model.vocab_size: 0``
    (LLaVA: taken from the tokenizer at start-up) counts as one multiple of
    ``make_vocab_size_divisible_by``, since no tokenizer is read before start-up."""
    return cfg.model.padded_vocab_size(cfg.model.vocab_size)


def flop_cost_model(cfg: JobConfig, cuda: bool = False, world_size: Optional[int] = None) -> PipelineCostModel:
    """Analytical cost model of ``cfg``'s model for one micro-batch.

    ``cuda`` decides what ``train.precision: auto`` means (bf16 vs fp32).
    ``world_size`` (default tp*pp*cp, i.e. DP=1) sets DP, which divides
    optimizer state under ``parallel.use_distributed_optimizer`` and the
    number of micro-batches per step.
    """
    m, v, par, train = cfg.model, cfg.vision, cfg.parallel, cfg.train
    tp = par.tp
    dp = max((world_size or par.model_parallel_size) // par.model_parallel_size, 1)
    nbytes = _dtype_bytes(cfg, cuda)
    b, s, h = train.micro_batch_size, m.seq_length, m.hidden_size
    tokens = float(b * s)
    vocab = padded_vocab_size(cfg)
    lm_trainable = not m.freeze
    comps: dict[str, ComponentCost] = {}
    head: tuple[str, ...] = (EMBEDDING,)
    head_trains = False
    if m.family == "llava":
        images = b * v.images_per_sequence
        p = v.tokens_per_image
        vtokens = images * p
        # Images enter with no gradient: backward reaches the ViT only if it trains.
        layer = _transformer_layer(
            vtokens, p, images, v.hidden_size, v.ffn_size, v.num_attention_heads, v.num_attention_heads,
            nbytes, m.recompute, not v.freeze, not v.freeze, tp,
        )
        patch_params = 3 * v.patch_size**2 * v.hidden_size + p * v.hidden_size + 2 * v.hidden_size
        patch_flops = 2.0 * vtokens * 3 * v.patch_size**2 * v.hidden_size * _passes(not v.freeze, False)
        comps[VISION] = ComponentCost(
            flops=v.num_layers * layer.flops + patch_flops,
            params=v.num_layers * layer.params + patch_params,
            trainable_params=0 if v.freeze else v.num_layers * layer.params + patch_params,
            activation_bytes=0.0 if v.freeze else v.num_layers * layer.activation_bytes + 2.0 * vtokens * v.hidden_size * nbytes,
        )
        ph = v.projector_hidden_size or h
        proj_params = v.hidden_size * ph + ph + ph * h + h
        proj_trains = not v.freeze_projector
        comps[PROJECTOR] = ComponentCost(
            flops=_passes(proj_trains, not v.freeze) * 2.0 * vtokens * (v.hidden_size * ph + ph * h) / tp,
            params=proj_params // tp,
            trainable_params=proj_params // tp if proj_trains else 0,
            activation_bytes=vtokens * (v.hidden_size + 2 * ph) * nbytes / tp if proj_trains or not v.freeze else 0.0,
        )
        # Gradient reaches the LM's input when the projector or ViT trains.
        head_trains = proj_trains or not v.freeze
        head = (VISION, PROJECTOR, EMBEDDING)
    emb_params = vocab * h // tp + (s * h if m.position_embedding_type == "learned_absolute" else 0)
    comps[EMBEDDING] = ComponentCost(
        flops=3.0 * tokens * h,  # gather + add; negligible next to matmuls
        params=emb_params,
        trainable_params=emb_params if lm_trainable else 0,
        activation_bytes=tokens * h * nbytes,
    )
    comps[LM_LAYER] = _transformer_layer(
        tokens, s, float(b), h, m.ffn_size, m.num_attention_heads, m.query_groups, nbytes, m.recompute,
        # Input gradients flow through every layer when earlier layers, the
        # embedding or the ViT/projector train.
        lm_trainable, lm_trainable or head_trains, tp,
    )
    out_params = vocab * h // tp + 2 * h
    comps[OUTPUT] = ComponentCost(
        # Output projection (3 passes) + softmax/cross-entropy (~5 ops per logit).
        flops=(3.0 * 2.0 * tokens * h * vocab + 5.0 * tokens * vocab) / tp,
        params=out_params,
        trainable_params=out_params if lm_trainable else 0,
        # Final-norm input, output-layer input, fp32 logits and their softmax.
        activation_bytes=2.0 * tokens * h * nbytes + 2.0 * tokens * vocab / tp * 4,
    )
    if nbytes == 2:  # bf16 weights + fp32 main grad + fp32 master + Adam m, v
        weights, grads, optim = 2.0, 4.0, 12.0
    else:  # fp32 weights + grad + Adam m, v
        weights, grads, optim = 4.0, 4.0, 8.0
    if par.use_distributed_optimizer:
        optim /= dp
    num_mb = max(train.global_batch_size // (train.micro_batch_size * dp), 1)
    return PipelineCostModel(
        components=comps,
        head=head,
        tail=(OUTPUT,),
        bytes_per_trainable_param=weights + grads + optim,
        bytes_per_frozen_param=weights,
        num_microbatches=num_mb,
        shape=profile_shape(cfg),
    )


# -------------------------------------------------------------- the profile


def profile_shape(cfg: JobConfig) -> dict[str, object]:
    """Every setting a measured profile depends on; a profile only applies to
    a config with the same shape."""
    m, v, par = cfg.model, cfg.vision, cfg.parallel
    shape: dict[str, object] = {
        "family": m.family,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.query_groups,
        "ffn_hidden_size": m.ffn_size,
        "seq_length": m.seq_length,
        "micro_batch_size": cfg.train.micro_batch_size,
        "recompute": m.recompute,
        "freeze": m.freeze,
        "tp": par.tp,
        "precision": cfg.train.precision,
    }
    if m.family == "llava":
        shape.update(
            vision_layers=v.num_layers,
            vision_hidden_size=v.hidden_size,
            vision_ffn_hidden_size=v.ffn_size,
            image_size=v.image_size,
            patch_size=v.patch_size,
            projector_hidden_size=v.projector_hidden_size or m.hidden_size,
            vision_freeze=v.freeze,
        )
    return shape


def load_profile(path: str, model: PipelineCostModel, cfg: JobConfig) -> PipelineCostModel:
    """``model`` with times replaced by a profile from tools/profile_layers.py.

    The profile stores seconds per micro-batch for every component except the
    vision encoder and projector, which are stored per image and scaled by
    ``micro_batch_size * vision.images_per_sequence`` here. Raises ConfigError
    if the file is missing, malformed or measured for another model shape.
    """
    field_name = "parallel.pipeline_profile"
    if not os.path.isfile(path):
        raise ConfigError(field_name, path, "file not found; write one with `python tools/profile_layers.py --config ...`")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        version, shape, seconds = data["version"], data["shape"], data["seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(field_name, path, "is not a profile written by tools/profile_layers.py; re-run it") from None
    if version != PROFILE_VERSION:
        raise ConfigError(field_name, path, f"has format version {version}, expected {PROFILE_VERSION}; re-run the profiler")
    expected = profile_shape(cfg)
    diff = [f"{k}={shape.get(k)!r} (config: {expected[k]!r})" for k in expected if shape.get(k) != expected[k]]
    if diff:
        raise ConfigError(
            field_name, path,
            f"was measured for another model shape: {', '.join(diff)}; re-run tools/profile_layers.py with this config",
        )
    images = cfg.train.micro_batch_size * cfg.vision.images_per_sequence
    comps = {}
    for name, c in model.components.items():
        key = f"{name}_per_image" if name in (VISION, PROJECTOR) else name
        if key not in seconds:
            raise ConfigError(field_name, path, f"has no time for {key!r}; re-run tools/profile_layers.py")
        t = float(seconds[key]) * (images if name in (VISION, PROJECTOR) else 1.0)
        comps[name] = ComponentCost(c.flops, c.params, c.trainable_params, c.activation_bytes, seconds=t)
    return PipelineCostModel(
        components=comps,
        head=model.head,
        tail=model.tail,
        bytes_per_trainable_param=model.bytes_per_trainable_param,
        bytes_per_frozen_param=model.bytes_per_frozen_param,
        num_microbatches=model.num_microbatches,
        unit="s",
        source=f"profile {path} ({data.get('device', 'unknown device')})",
        shape=model.shape,
    )
