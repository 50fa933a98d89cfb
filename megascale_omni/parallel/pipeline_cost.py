"""Per-component training cost of a pipelined model: time and memory.

The pipeline partitioner needs, for one micro-batch on one TP rank:

- the forward+backward time of every component that a pipeline stage can
  hold: the fixed head of the first stage (LLaVA: vision encoder, projector,
  token embedding), one repeated layer (a decoder layer), and the fixed tail
  of the last stage (output layer + loss);
- the bytes each component pins for the whole run (weights, gradients,
  optimizer state) and the activation bytes it keeps from forward to
  backward for each micro-batch in flight.

Context parallelism (``parallel.cp``): each CP rank holds ``seq_length / cp``
tokens of every language-model sequence, so the LM components' FLOPs and
activations per rank are ``1/cp`` of the whole sequence's (attention too:
a rank's queries attend over the whole sequence, ``1/cp`` of the score
matrix). Their weights are whole on every CP rank. LLaVA's ViT and projector
are not split: every CP rank of the first stage runs them on all images of
the micro-batch. Ring attention's communication is not modelled.

A model family declares which cost model describes it
(``megascale_omni.tasks.registry``): :func:`lm_cost_model` (GPT),
:func:`llava_cost_model` (ViT + projector + LM) or
:func:`megascale_omni.parallel.pipeline_cost_dit.dit_cost_model`; each is a
:data:`CostModelFn`. Time comes from FLOPs or from a measured profile
(``tools/profile_layers.py``, loaded by :func:`load_profile`). Only ratios of
times matter to the partitioner, so the FLOP model needs no device peak.
Pure Python: the planner runs before any process group or model exists.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from megascale_omni.config.errors import ConfigError
from megascale_omni.config.schema import JobConfig
from megascale_omni.parallel.activations import LayerShape, layer_activation_bytes, recompute_forward_flops
from megascale_omni.parallel.batch_shape import BatchShape, causal_pairs
from megascale_omni.parallel.moe_cost import dispatch_bytes, dispatch_seconds, mlp_widths
from megascale_omni.parallel.tower_mix import tower_mix

#: Component names, in pipeline order. ``lm_layer`` is the cost of *one*
#: decoder layer; the others appear once in the model.
VISION, PROJECTOR, EMBEDDING, LM_LAYER, OUTPUT = "vision", "projector", "embedding", "lm_layer", "output"
#: Profile JSON format version written by tools/profile_layers.py.
PROFILE_VERSION = 1


@dataclass(frozen=True)
class ComponentCost:
    """Cost of one component for one micro-batch on one TP (and CP) rank.

    ``flops``: forward+backward FLOPs. ``seconds``: measured forward+backward
    seconds, or None without a profile. ``params``/``trainable_params``:
    parameter counts. ``activation_bytes``: bytes kept from forward to backward.
    """

    flops: float
    params: int
    trainable_params: int
    activation_bytes: float
    seconds: Optional[float] = None
    #: Bytes this rank sends to other ranks for the MoE token dispatch
    #: (forward + backward, :func:`~megascale_omni.parallel.moe_cost.dispatch_bytes`); 0 for a dense component.
    dispatch_bytes: float = 0.0
    #: Those bytes in seconds at ``parallel.alltoall_bandwidth_gbs``
    #: (:func:`~megascale_omni.parallel.moe_cost.dispatch_seconds`).
    dispatch_seconds: float = 0.0


@dataclass(frozen=True)
class PipelineCostModel:
    """Costs of every component plus the memory conventions of the run.

    ``head``/``tail`` name the components fixed to the first model chunk
    (pp rank 0, virtual stage 0) and the last one (last pp rank, last virtual
    stage); ``layer`` the one repeated ``model.num_layers`` times, which the
    partitioner distributes. ``unit`` is ``"s"`` when every time is measured,
    else ``"FLOP"``.
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
    #: Every setting a measured profile of this model depends on (what
    #: tools/profile_layers.py records); None: the family has no profiler, so
    #: ``parallel.pipeline_profile`` cannot apply.
    shape: Optional[Mapping[str, object]] = None
    #: The repeated component (see ``layer_time``).
    layer: str = LM_LAYER
    #: What the nominal micro-batch holds beyond its rows, when the data
    #: decides it (LLaVA: :meth:`~megascale_omni.parallel.tower_mix.TowerMix.describe`); "" otherwise.
    inputs: str = ""

    def time(self, name: str) -> float:
        """Forward+backward time of one component for one micro-batch:
        seconds when ``unit == 's'``, its MoE token dispatch included;
        FLOPs otherwise, which cannot hold the dispatch's seconds
        (:func:`timed_at_peak` turns a FLOP model into seconds)."""
        c = self.components[name]
        return c.seconds + c.dispatch_seconds if self.unit == "s" else c.flops

    def static_bytes(self, name: str) -> float:
        """Weights + gradients + optimizer state of one component, bytes."""
        c = self.components[name]
        frozen = c.params - c.trainable_params
        return c.trainable_params * self.bytes_per_trainable_param + frozen * self.bytes_per_frozen_param

    def activation_bytes(self, name: str) -> float:
        return self.components[name].activation_bytes

    @property
    def layer_time(self) -> float:
        return self.time(self.layer)

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
    tokens: float, pairs: float, hidden: int, ffn: float, heads: int, groups: int,
    dtype_bytes: int, recompute: str, trainable: bool, grad_flows: bool, tp: int, gated: bool = False,
    cp: int = 1, sequence_parallel: bool = False, hidden_dropout: bool = False, attention_dropout: bool = False,
    fused_attention: bool = False, stored_ffn: Optional[float] = None, router: float = 0.0,
    head_dim: Optional[int] = None,
) -> ComponentCost:
    """One pre-norm transformer layer (attention + MLP) on ``tokens``
    positions whose attention scores ``pairs`` query-key pairs (both over the
    whole batch), split over ``tp`` ranks. ``grad_flows``: backward passes
    through it (something before it trains). ``gated``: a SwiGLU MLP (gate,
    up and down matrices instead of two). ``cp``: every sequence is split
    over that many context-parallel ranks; the cost is one rank's, whose
    queries are ``1 / cp`` of the tokens and score ``1 / cp`` of the pairs.
    ``recompute`` (``model.recompute``), ``sequence_parallel``, the
    dropouts and ``fused_attention`` (TE) set the activation bytes
    (:func:`~megascale_omni.parallel.activations.layer_activation_bytes`)
    and the FLOPs recomputed in backward. MoE layers (:func:`mlp_widths`):
    ``ffn`` is the MLP width a token passes through (its top-k experts and
    the shared ones), ``stored_ffn`` the width held per rank (None: ``ffn``),
    ``router`` the experts scored per token. ``head_dim``: width of a head
    (``model.kv_channels``; None: ``hidden / heads``)."""
    head_dim = head_dim or hidden // heads
    q_width = heads * head_dim  # = hidden unless model.kv_channels says otherwise
    qkv = hidden * (q_width + 2 * groups * head_dim)
    mlp = (3 if gated else 2) * hidden
    matmul_params = qkv + q_width * hidden + mlp * ffn + hidden * router
    tokens, pairs = tokens / cp, pairs / cp  # this CP rank's share
    # 2 FLOPs per multiply-add; QK^T and attention-times-V are 2*q_width per pair each.
    core_forward = 4.0 * pairs * q_width
    forward = 2.0 * tokens * matmul_params + core_forward
    backward = trainable or grad_flows
    flops = _passes(trainable, grad_flows) * forward
    if backward:
        flops += recompute_forward_flops(core_forward, forward, recompute)
    stored = ffn if stored_ffn is None else stored_ffn
    params = int(matmul_params + mlp * (stored - ffn) + (q_width + 2 * groups * head_dim) + hidden + stored + hidden
                 + 4 * hidden)
    shape = LayerShape(hidden, ffn, heads, groups * head_dim, gated, hidden_dropout, attention_dropout,
                       fused_attention)
    act = 0.0
    if backward:
        act = layer_activation_bytes(shape, tokens, pairs, dtype_bytes, tp, sequence_parallel, recompute)
    return ComponentCost(
        flops=flops / tp,
        params=params // tp,
        trainable_params=params // tp if trainable else 0,
        activation_bytes=act,
    )


def fused_attention(cfg: JobConfig, cuda: bool) -> bool:
    """Whether attention is transformer-engine's fused kernel, which keeps no
    score matrix: ``model.layer_impl`` other than ``local`` on CUDA (``auto``
    picks TE there when it is installed, which a GPU deployment has)."""
    return cuda and cfg.model.layer_impl != "local"


def padded_vocab_size(cfg: JobConfig) -> int:
    """Vocabulary rows of the embedding/output layer. ``model.vocab_size: 0``
    (LLaVA: taken from the tokenizer at start-up) counts as one multiple of
    ``make_vocab_size_divisible_by``, since no tokenizer is read before start-up."""
    return cfg.model.padded_vocab_size(cfg.model.vocab_size)


#: A family's analytical cost model: ``(cfg, cuda, world_size, batch=None) ->
#: PipelineCostModel`` of one micro-batch. ``cuda`` decides what
#: ``train.precision: auto`` means (bf16 vs fp32); ``world_size`` (None:
#: tp*pp*cp, i.e. DP=1) sets DP, which divides optimizer state under
#: ``parallel.use_distributed_optimizer`` and the micro-batches per step.
#: ``batch`` (a :class:`~megascale_omni.parallel.batch_shape.BatchShape`)
#: replaces the config's nominal micro-batch by the samples it describes:
#: how the step record counts the model FLOPs of a global batch
#: (:class:`megascale_omni.metrics.flops.StepFlops`).
CostModelFn = Callable[..., PipelineCostModel]


@dataclass(frozen=True)
class MemoryConventions:
    """What one parameter and one step cost in memory, whatever the family."""

    #: Weights + gradient + optimizer state per trainable parameter, bytes.
    bytes_per_trainable_param: float
    #: Weights per parameter, bytes (frozen parameters keep only these).
    bytes_per_frozen_param: float
    #: Micro-batches per step on one DP rank.
    num_microbatches: int
    #: The gradient's share of ``bytes_per_trainable_param`` (megatron's main-grad buffer).
    grad_bytes_per_param: float = 4.0

    @property
    def optimizer_bytes_per_param(self) -> float:
        """Optimizer state per trainable parameter on this rank, bytes (after
        the distributed optimizer's sharding)."""
        return self.bytes_per_trainable_param - self.bytes_per_frozen_param - self.grad_bytes_per_param


def memory_conventions(cfg: JobConfig, cuda: bool, world_size: Optional[int]) -> MemoryConventions:
    """Bytes per parameter under ``train.precision`` and the distributed
    optimizer, and the micro-batches per step, of ``cfg`` on ``world_size`` ranks."""
    par, train = cfg.parallel, cfg.train
    dp = max((world_size or par.model_parallel_size) // par.model_parallel_size, 1)
    if _dtype_bytes(cfg, cuda) == 2:  # bf16 weights + fp32 main grad + fp32 master + Adam m, v
        weights, grads, optim = 2.0, 4.0, 12.0
    else:  # fp32 weights + grad + Adam m, v
        weights, grads, optim = 4.0, 4.0, 8.0
    if par.use_distributed_optimizer:
        optim /= dp * par.cp  # megatron shards it over the DP x CP group
    return MemoryConventions(
        bytes_per_trainable_param=weights + grads + optim,
        bytes_per_frozen_param=weights,
        num_microbatches=max(train.global_batch_size // (train.micro_batch_size * dp), 1),
        grad_bytes_per_param=grads,
    )


def _lm_components(cfg: JobConfig, nbytes: int, head_trains: bool,
                   batch: Optional[BatchShape] = None, cuda: bool = False) -> dict[str, ComponentCost]:
    """Token embedding, one decoder layer and the output layer + loss of the
    language model, on one of ``parallel.cp`` context-parallel ranks (``1/cp``
    of the tokens), for ``batch``'s causal segments, or (None) the planner's
    micro-batch of ``micro_batch_size`` rows of ``seq_length`` tokens with
    attention over each row's full square (the score matrix the local layer
    spec materialises: a bound on the time and memory of any packing).
    ``head_trains``: something before the embedding (a ViT or projector)
    trains, so input gradients flow through every layer."""
    m, tp, cp = cfg.model, cfg.parallel.tp, cfg.parallel.cp
    b, s, h = cfg.train.micro_batch_size, m.seq_length, m.hidden_size
    all_tokens, pairs = ((float(b * s), float(b * s * s)) if batch is None
                         else (float(batch.tokens), causal_pairs(batch.segments)))
    tokens = all_tokens / cp  # this CP rank's
    sp = cfg.parallel.sequence_parallel
    sp_share = 1.0 / tp if sp else 1.0  # what SP keeps of a hidden-state tensor
    vocab = padded_vocab_size(cfg)
    active_ffn, stored_ffn, router = mlp_widths(cfg)
    lm_trainable = not m.freeze
    emb_params = vocab * h // tp + (s * h if m.position_embedding_type == "learned_absolute" else 0)
    out_params = vocab * h // tp + 2 * h
    return {
        EMBEDDING: ComponentCost(
            flops=3.0 * tokens * h / tp,  # gather + add (vocab-parallel); negligible next to matmuls
            params=emb_params,
            trainable_params=emb_params if lm_trainable else 0,
            activation_bytes=tokens * h * nbytes * sp_share,
        ),
        LM_LAYER: dataclasses.replace(_transformer_layer(
            all_tokens, pairs, h, active_ffn, m.num_attention_heads, m.query_groups, nbytes, m.recompute,
            # Input gradients flow through every layer when earlier layers, the
            # embedding or the ViT/projector train.
            lm_trainable, lm_trainable or head_trains, tp, gated=m.activation == "swiglu", cp=cp,
            sequence_parallel=sp, hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0,
            fused_attention=fused_attention(cfg, cuda), stored_ffn=stored_ffn, router=router, head_dim=m.head_dim,
        ), dispatch_bytes=dispatch_bytes(cfg, tokens, nbytes),
            dispatch_seconds=dispatch_seconds(cfg, dispatch_bytes(cfg, tokens, nbytes))),
        OUTPUT: ComponentCost(
            # Output projection (forward, input grad, weight grad if it trains)
            # + softmax/cross-entropy (~5 ops per logit).
            flops=(_passes(lm_trainable, lm_trainable or head_trains) * 2.0 * tokens * h * vocab + 5.0 * tokens * vocab) / tp,
            params=out_params,
            trainable_params=out_params if lm_trainable else 0,
            # Final-norm input (SP: sharded), output-layer input (gathered),
            # fp32 logits and their softmax.
            activation_bytes=(1.0 + sp_share) * tokens * h * nbytes + 2.0 * tokens * vocab / tp * 4,
        ),
    }


def _vision_components(cfg: JobConfig, nbytes: int, batch: Optional[BatchShape] = None,
                       cuda: bool = False) -> dict[str, ComponentCost]:
    """LLaVA's ViT (patch embedding + layers) and projector for ``batch``'s
    tower inputs, or (None) the nominal micro-batch's
    (:func:`~megascale_omni.parallel.tower_mix.tower_mix`: time for the mean
    tower inputs, activations for the peak): all of them on every CP rank
    (images are not split by context parallelism)."""
    if batch is not None:
        return _tower_components(cfg, nbytes, batch.tower_inputs, cuda)
    mix = tower_mix(cfg)
    comps = _tower_components(cfg, nbytes, mix.mean, cuda)
    if mix.peak == mix.mean:
        return comps
    peak = _tower_components(cfg, nbytes, mix.peak, cuda)
    return {n: dataclasses.replace(c, activation_bytes=peak[n].activation_bytes) for n, c in comps.items()}


def _tower_components(cfg: JobConfig, nbytes: int, images: float, cuda: bool) -> dict[str, ComponentCost]:
    """ViT and projector on ``images`` tower inputs. The tower is
    bidirectional: every input's attention scores all ``P * P`` pairs of its ``P`` tokens."""
    m, v, tp = cfg.model, cfg.vision, cfg.parallel.tp
    p = v.tokens_per_image
    vtokens = images * p
    # Images enter with no gradient: backward reaches the ViT only if it trains.
    layer = _transformer_layer(
        vtokens, images * p * p, v.hidden_size, v.ffn_size, v.num_attention_heads, v.num_attention_heads,
        # The ViT has its own TransformerConfig: no sequence parallelism.
        nbytes, m.recompute, not v.freeze, not v.freeze, tp, fused_attention=fused_attention(cfg, cuda),
    )
    patch_params = 3 * v.patch_size**2 * v.hidden_size + p * v.hidden_size + 2 * v.hidden_size
    patch_flops = 2.0 * vtokens * 3 * v.patch_size**2 * v.hidden_size * _passes(not v.freeze, False)
    if v.projector_type == "mlp":  # vision -> ph -> LM hidden
        ph = v.projector_hidden_size or m.hidden_size
        proj_matmul = v.hidden_size * ph + ph * m.hidden_size
        proj_params = proj_matmul + ph + m.hidden_size
        proj_act = v.hidden_size + 2 * ph  # fc1 input, fc1 and GELU outputs
    else:  # one linear layer (megatron's "affine")
        proj_matmul = v.hidden_size * m.hidden_size
        proj_params = proj_matmul + m.hidden_size
        proj_act = v.hidden_size
    proj_trains = not v.freeze_projector
    return {
        VISION: ComponentCost(
            flops=v.layers_built * layer.flops + patch_flops,
            params=v.layers_built * layer.params + patch_params,
            trainable_params=0 if v.freeze else v.layers_built * layer.params + patch_params,
            activation_bytes=0.0 if v.freeze else v.layers_built * layer.activation_bytes + 2.0 * vtokens * v.hidden_size * nbytes,
        ),
        PROJECTOR: ComponentCost(
            flops=_passes(proj_trains, not v.freeze) * 2.0 * vtokens * proj_matmul / tp,
            params=proj_params // tp,
            trainable_params=proj_params // tp if proj_trains else 0,
            activation_bytes=vtokens * proj_act * nbytes / tp if proj_trains or not v.freeze else 0.0,
        ),
    }


def lm_cost_model(cfg: JobConfig, cuda: bool = False, world_size: Optional[int] = None,
                  batch: Optional[BatchShape] = None) -> PipelineCostModel:
    """:data:`CostModelFn` of a GPT language model: embedding, decoder layers,
    output layer + loss, for one micro-batch of ``micro_batch_size`` rows of
    ``seq_length`` tokens (or ``batch``)."""
    mem = memory_conventions(cfg, cuda, world_size)
    return PipelineCostModel(
        components=_lm_components(cfg, _dtype_bytes(cfg, cuda), head_trains=False, batch=batch, cuda=cuda),
        head=(EMBEDDING,),
        tail=(OUTPUT,),
        bytes_per_trainable_param=mem.bytes_per_trainable_param,
        bytes_per_frozen_param=mem.bytes_per_frozen_param,
        num_microbatches=mem.num_microbatches,
        shape=lm_profile_shape(cfg),
    )


def llava_cost_model(cfg: JobConfig, cuda: bool = False, world_size: Optional[int] = None,
                     batch: Optional[BatchShape] = None) -> PipelineCostModel:
    """:data:`CostModelFn` of LLaVA: the language model of :func:`lm_cost_model`
    with the ViT and projector in front of the embedding on the first stage
    (for one nominal micro-batch, or ``batch``)."""
    v = cfg.vision
    nbytes = _dtype_bytes(cfg, cuda)
    # Gradient reaches the LM's input when the projector or ViT trains.
    head_trains = not v.freeze_projector or not v.freeze
    mem = memory_conventions(cfg, cuda, world_size)
    return PipelineCostModel(
        components={**_vision_components(cfg, nbytes, batch, cuda),
                    **_lm_components(cfg, nbytes, head_trains, batch, cuda)},
        head=(VISION, PROJECTOR, EMBEDDING),
        tail=(OUTPUT,),
        bytes_per_trainable_param=mem.bytes_per_trainable_param,
        bytes_per_frozen_param=mem.bytes_per_frozen_param,
        num_microbatches=mem.num_microbatches,
        shape=llava_profile_shape(cfg),
        inputs=tower_mix(cfg).describe() if batch is None else "",
    )


def timed_at_peak(model: PipelineCostModel, peak_tflops: float) -> PipelineCostModel:
    """A FLOP-unit ``model`` in seconds: every component's FLOPs at
    ``peak_tflops`` (one device's peak, ``logging.peak_tflops``), so that
    seconds that are not FLOPs (the MoE token dispatch) add to them. At the
    peak the compute is faster than any real run, so the dispatch's share of
    a layer is an upper bound; a measured profile has no such bias."""
    if model.unit == "s":
        return model
    rate = peak_tflops * 1e12
    comps = {name: dataclasses.replace(c, seconds=c.flops / rate) for name, c in model.components.items()}
    return dataclasses.replace(model, components=comps, unit="s",
                               source=f"{model.source} at logging.peak_tflops={peak_tflops:g}")


# -------------------------------------------------------------- the profile


def lm_profile_shape(cfg: JobConfig) -> dict[str, object]:
    """Every setting a measured profile of a language model depends on; a
    profile only applies to a config with the same shape. ``parallel.cp`` is
    not part of it: a profile times whole sequences (:func:`load_profile`
    scales them to one CP rank's share)."""
    m, par = cfg.model, cfg.parallel
    return {
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


def llava_profile_shape(cfg: JobConfig) -> dict[str, object]:
    """:func:`lm_profile_shape` plus the ViT and projector settings."""
    v = cfg.vision
    return {
        **lm_profile_shape(cfg),
        "vision_layers": v.layers_built,
        "vision_hidden_size": v.hidden_size,
        "vision_ffn_hidden_size": v.ffn_size,
        "image_size": v.image_size,
        "patch_size": v.patch_size,
        "projector_hidden_size": v.projector_hidden_size or cfg.model.hidden_size,
        "vision_freeze": v.freeze,
    }


def load_profile(path: str, model: PipelineCostModel, cfg: JobConfig) -> PipelineCostModel:
    """``model`` with times replaced by a profile from tools/profile_layers.py.

    The profile stores seconds per micro-batch for every component except the
    vision encoder and projector, which are stored per image and scaled by
    the nominal micro-batch's mean tower inputs here
    (:func:`~megascale_omni.parallel.tower_mix.tower_mix`). The language
    model's times are for whole sequences; under context parallelism each
    rank computes ``1/cp`` of them (ring communication not counted), the
    ViT and projector all of theirs. Raises ConfigError
    if the file is missing, malformed or measured for another model shape, or
    if ``model`` has no profile shape (its family has no profiler).
    """
    field_name = "parallel.pipeline_profile"
    if model.shape is None:
        raise ConfigError(
            field_name, path,
            f"model.family={cfg.model.family} has no measured profile (tools/profile_layers.py does not time "
            f"its components); set parallel.pipeline_profile: null to plan with its FLOP cost model",
        )
    if not os.path.isfile(path):
        raise ConfigError(field_name, path, "file not found; write one with `python tools/profile_layers.py --config ...`")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        version, shape, seconds = data["version"], data["shape"], data["seconds"]
        if not (isinstance(shape, dict) and isinstance(seconds, dict)):
            raise TypeError("shape and seconds must be objects")
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(field_name, path, "is not a profile written by tools/profile_layers.py; re-run it") from None
    if version != PROFILE_VERSION:
        raise ConfigError(field_name, path, f"has format version {version}, expected {PROFILE_VERSION}; re-run the profiler")
    expected = model.shape
    diff = [f"{k}={shape.get(k)!r} (config: {expected[k]!r})" for k in expected if shape.get(k) != expected[k]]
    if diff:
        raise ConfigError(
            field_name, path,
            f"was measured for another model shape: {', '.join(diff)}; re-run tools/profile_layers.py with this config",
        )
    images = tower_mix(cfg).mean if VISION in model.components else 0.0
    comps = {}
    for name, c in model.components.items():
        key = f"{name}_per_image" if name in (VISION, PROJECTOR) else name
        if key not in seconds:
            raise ConfigError(field_name, path, f"has no time for {key!r}; re-run tools/profile_layers.py")
        measured = seconds[key]
        # json reads NaN and Infinity; a string, NaN or a negative time would
        # fail later with a traceback or plan nonsense.
        if isinstance(measured, bool) or not isinstance(measured, (int, float)) or not 0 <= measured < math.inf:
            raise ConfigError(
                field_name, path,
                f"seconds.{key}={measured!r} is not a measured time (finite seconds >= 0); "
                "re-run tools/profile_layers.py or fix that entry",
            )
        t = float(measured) * (images if name in (VISION, PROJECTOR) else 1.0 / cfg.parallel.cp)
        comps[name] = dataclasses.replace(c, seconds=t)
    return dataclasses.replace(
        model, components=comps, unit="s", source=f"profile {path} ({data.get('device', 'unknown device')})"
    )
