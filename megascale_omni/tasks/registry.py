"""Each model family declared once: its three parts, cost model, supported
features and family-specific config checks (in the spirit of torchtitan's
``TrainSpec``).

A family names a :class:`~megascale_omni.data.module.DataModule`, a
:class:`~megascale_omni.models.model_spec.ModelSpec` and its
evaluators (:class:`~megascale_omni.evaluation.base.Evaluator`) as ``"module:Class"``
strings; :meth:`ModelFamily.build_task` composes them into the
:class:`~megascale_omni.tasks.base.Task` the Trainer sees. A new dataset or
evaluation is a new part and a line here, not an edit of a task.
Validation, the pipeline planner, the tools and the entry points ask a
:class:`ModelFamily`; nothing else branches on ``model.family``. This module
imports no megatron code: a config error exits before megatron loads, and
the parts are imported only when a task is built.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

from megascale_omni.checkpoint.layout import check_resume_path
from megascale_omni.config import ConfigError, JobConfig, validate_job
from megascale_omni.config.validate import (
    require_cp_seq_length,
    require_divisible_by_tp,
    sequence_multiple,
    validate_paths,
)

#: Features a family may support; a config that uses one its family lacks exits 2.
FEATURES = {
    "vpp": ("parallel.vpp", "null"),
    "explicit_partition": ("parallel.pipeline_partition", "uniform"),
    "sequence_parallel": ("parallel.sequence_parallel", "false"),
    "context_parallel": ("parallel.cp", "1"),
    "elastic": ("elastic.enabled", "false"),
    "data_blend": ("data.blend", "[]"),
    "data_workers": ("data.num_workers", "0"),
    "moe": ("moe.num_experts", "0"),
    "qk_layernorm": ("model.qk_layernorm", "false"),
    "kv_channels": ("model.kv_channels", "null"),
}


@dataclass(frozen=True)
class ModelFamily:
    """What one model family provides (see :data:`FAMILIES`)."""

    name: str
    #: ``"module:Class"`` of its :class:`~megascale_omni.data.module.DataModule`.
    data: str
    #: ``"module:Class"`` of its :class:`~megascale_omni.models.model_spec.ModelSpec`.
    model: str
    #: Subset of :data:`FEATURES` keys this family trains correctly.
    features: frozenset[str]
    #: ``"module:function"`` of its pipeline cost model, a
    #: :data:`~megascale_omni.parallel.pipeline_cost.CostModelFn` ``(cfg, cuda,
    #: world_size) -> PipelineCostModel`` of one micro-batch; None: no ``auto``
    #: split and no memory check.
    cost_model: Optional[str] = None
    #: ``"module:function"`` timing its components on this device for a measured
    #: pipeline profile (tools/profile_layers.py); None: FLOP cost model only.
    profiler: Optional[str] = None
    #: Family-specific config checks (raise ConfigError), after the generic ones.
    check: Optional[Callable[[JobConfig], None]] = None
    #: Why a missing feature is missing, by feature (appended to the error).
    notes: tuple[tuple[str, str], ...] = ()
    #: ``(train.evaluator name, "module:Class")`` of its evaluators; ``auto``
    #: takes the first whose ``applies(cfg, data)``, ``none`` evaluates nothing.
    evaluators: tuple[tuple[str, str], ...] = ()
    #: ``"module:function"`` ``cfg -> dataset directory`` building the embedded
    #: default dataset when ``data.path`` is null (the demo), or None.
    default_dataset: Optional[str] = None
    #: ``"module:function"`` ``(cfg) -> int``: the vocabulary size of that default
    #: dataset's tokenizer, known without building it (None: not checked up front).
    default_vocab: Optional[str] = None
    #: ``"module:function"`` ``(cfg, default_vocab) -> None``: the static check
    #: of the family's input files (dataset, tokenizer, what must fit them),
    #: raising ConfigError; run by :meth:`validate`, so omni-run refuses a bad
    #: input before any worker starts. Reads small files only.
    check_inputs: Optional[str] = None

    def parts(self) -> tuple[type, type]:
        """The (DataModule, ModelSpec) classes (imports them)."""
        return _resolve(self.data), _resolve(self.model)

    def evaluator_class(self, cfg: JobConfig, data) -> type:
        """The evaluator ``train.evaluator`` names for ``data`` (imports it)."""
        from megascale_omni.evaluation.base import Evaluator

        choice = cfg.train.evaluator
        if choice == "none":
            return Evaluator
        if choice != "auto":
            return _resolve(dict(self.evaluators)[choice])
        for _, target in self.evaluators:
            cls = _resolve(target)
            if cls.applies(cfg, data):
                return cls
        return Evaluator

    def cost_model_fn(self, cfg: JobConfig) -> Callable:
        """This family's cost model function (ConfigError, about ``cfg``'s
        partition, if it declares none)."""
        if self.cost_model is None:
            raise ConfigError(
                "parallel.pipeline_partition", cfg.parallel.pipeline_partition,
                f"model.family={self.name} has no pipeline cost model; use uniform or explicit counts",
            )
        return _resolve(self.cost_model)

    def build_cost_model(self, cfg: JobConfig, cuda: bool = False, world_size: Optional[int] = None):
        """This family's pipeline cost model of ``cfg``, with the measured
        times of ``parallel.pipeline_profile`` if set (ConfigError if it has none)."""
        from megascale_omni.parallel.pipeline_plan import build_cost_model

        return build_cost_model(cfg, self.cost_model_fn(cfg), cuda=cuda, world_size=world_size)

    def profiler_fn(self) -> Optional[Callable]:
        """``(cfg, device, vocab_size, repeats) -> seconds per component``, or None."""
        return None if self.profiler is None else _resolve(self.profiler)

    def build_task(self, cfg: JobConfig, platform, dims):
        """The family's :class:`~megascale_omni.tasks.base.Task` on this rank:
        its data module, model spec and evaluator, in that order (every rank;
        builds datasets, not the model)."""
        from megascale_omni.tasks.base import Task

        data_cls, model_cls = self.parts()
        default = None if self.default_dataset is None else _resolve(self.default_dataset)
        data = data_cls(cfg, platform, dims, default_dataset=default)
        model = model_cls(cfg, platform, dims, data)
        evaluator = self.evaluator_class(cfg, data)(cfg, platform, dims, data, model)
        return Task(data, model, evaluator)

    def validate(self, cfg: JobConfig, world_size: int, host_inputs: bool = True) -> None:
        """Every check ``cfg`` must pass to run this family on ``world_size``
        ranks (every rank, before any process group). Raises ConfigError.

        ``host_inputs=False`` leaves out what only the host that runs the job
        can answer (data, tokenizer and resume paths, writable directories):
        for planning a job on another machine (tools/plan_pipeline.py)."""
        if cfg.model.family != self.name:
            raise ConfigError(
                "model.family", cfg.model.family,
                f"this entry point trains model.family={self.name}; use the {cfg.model.family} entry point "
                f"({ENTRY_POINTS.get(cfg.model.family, '?')}) or a {self.name} config",
            )
        validate_job(cfg, world_size)
        for feature in _features_used(cfg):
            if feature not in self.features:
                field, off = FEATURES[feature]
                note = dict(self.notes).get(feature, "")
                value = _get(cfg, field)
                raise ConfigError(
                    field, value,
                    f"model.family={self.name} does not support {feature.replace('_', ' ')}"
                    f"{' (' + note + ')' if note else ''}; set {field}: {off}",
                )
        if cfg.parallel.pipeline_partition == "auto" and cfg.parallel.pp > 1 and self.cost_model is None:
            raise ConfigError(
                "parallel.pipeline_partition", "auto",
                f"model.family={self.name} has no pipeline cost model; use uniform or explicit counts",
            )
        names = [name for name, _ in self.evaluators]
        if cfg.train.evaluator not in ("auto", "none", *names):
            raise ConfigError("train.evaluator", cfg.train.evaluator,
                              f"model.family={self.name} evaluates with one of {['auto', *names, 'none']}")
        if self.check is not None:
            self.check(cfg)
        if cfg.parallel.pipeline_profile:
            # Read and matched against this model now (pure Python, no
            # megatron), not when the workers plan their pipeline.
            self.build_cost_model(cfg, world_size=world_size)
        if not host_inputs:
            return
        validate_paths(cfg)
        if self.check_inputs is not None:
            _resolve(self.check_inputs)(cfg, None if self.default_vocab is None else _resolve(self.default_vocab))
        if cfg.checkpoint.enabled and cfg.checkpoint.resume not in ("auto", "none"):
            check_resume_path(cfg.checkpoint.resume)

    def plan_pipeline(self, cfg: JobConfig, cuda: bool, world_size: int):
        """The pipeline plan of ``cfg`` under this family's cost model, or None
        for families without one (uniform and explicit splits then build as
        configured). Raises ConfigError for an infeasible plan."""
        from megascale_omni.parallel.pipeline_plan import plan_if_needed

        cost_model = None if self.cost_model is None else _resolve(self.cost_model)
        return plan_if_needed(cfg, cost_model, cuda=cuda, world_size=world_size)


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _get(cfg: JobConfig, dotted: str):
    section, _, name = dotted.partition(".")
    return getattr(getattr(cfg, section), name)


def _features_used(cfg: JobConfig) -> list[str]:
    par = cfg.parallel
    used = []
    if par.vpp is not None:
        used.append("vpp")
    if isinstance(par.pipeline_partition, list) and par.pp > 1:
        used.append("explicit_partition")
    if par.sequence_parallel:
        used.append("sequence_parallel")
    if par.cp > 1:
        used.append("context_parallel")
    if cfg.elastic.enabled:
        used.append("elastic")
    if cfg.data.blend:
        used.append("data_blend")
    if cfg.data.num_workers:
        used.append("data_workers")
    if cfg.moe.enabled:
        used.append("moe")
    if cfg.model.qk_layernorm:
        used.append("qk_layernorm")
    if cfg.model.kv_channels is not None:
        used.append("kv_channels")
    return used


# ------------------------------------------------------------ family checks


def _check_gpt(cfg: JobConfig) -> None:
    require_cp_seq_length(cfg)


def _check_llava(cfg: JobConfig) -> None:
    vision, par = cfg.vision, cfg.parallel
    require_cp_seq_length(cfg)
    sequence_multiple(cfg)  # the default padding serves parallel.cp up to 4
    require_divisible_by_tp("vision.num_attention_heads", vision.num_attention_heads, par.tp)
    require_divisible_by_tp("vision.ffn_hidden_size", vision.ffn_size, par.tp)
    if cfg.model.freeze and vision.freeze and vision.freeze_projector:
        raise ConfigError("model.freeze", True, "with vision.freeze and vision.freeze_projector nothing would train")


def _check_dit(cfg: JobConfig) -> None:
    dit, par = cfg.dit, cfg.parallel
    if cfg.train.micro_batch_size != 1:
        raise ConfigError(
            "train.micro_batch_size", cfg.train.micro_batch_size,
            "DiT micro-batches are bucket packages sized by dit.token_budget; set train.micro_batch_size: 1 "
            "(train.global_batch_size counts packages per step)",
        )
    # The patch output projection is a column-parallel linear over C * p * p outputs.
    require_divisible_by_tp("dit.in_channels * dit.patch_size**2", dit.in_channels * dit.patch_size**2, par.tp)
    if dit.text_encoder == "precomputed" and dit.text_dim == 0:
        raise ConfigError("dit.text_dim", 0, "precomputed text embeddings need their width; set dit.text_dim")
    if cfg.model.recompute != "none":
        raise ConfigError("model.recompute", cfg.model.recompute,
                          "the DiT blocks are not wired to megatron's recomputation; set model.recompute: none")
    if par.cp > 1:
        _check_dit_context_parallel(cfg)


def _check_dit_context_parallel(cfg: JobConfig) -> None:
    """Context parallelism cuts every image into ``2 * cp`` equal chunks of
    tokens: each bucket, and each resolution the end-of-training evaluation
    samples under the training layout, needs a multiple of ``2 * cp`` tokens."""
    dit, chunks = cfg.dit, 2 * cfg.parallel.cp
    p = dit.patch_size
    for field, sizes, what in (("dit.buckets", dit.buckets, "bucket"),
                               ("dit.eval_resolutions", dit.eval_resolutions, "resolution")):
        for i, (height, width) in enumerate(sizes):
            rows, cols = height // p, width // p
            if (rows * cols) % chunks:
                r, c = _nearest_grid(rows, cols, chunks)
                raise ConfigError(
                    f"{field}[{i}]", f"{height}x{width}",
                    f"has {rows * cols} tokens ({rows}x{cols} patches of dit.patch_size={p}), not a multiple of "
                    f"2*parallel.cp={chunks}: context parallelism cuts every image into 2*cp equal chunks; "
                    f"use a {what} such as {r * p}x{c * p} ({r * c} tokens) or remove it",
                )


def _nearest_grid(rows: int, cols: int, multiple: int) -> tuple[int, int]:
    """The patch grid with one side of ``rows x cols`` changed whose token
    count is a multiple of ``multiple``: fewest tokens changed, then the
    closest aspect ratio, then the first (rows changed before columns)."""
    candidates = [(r, cols) for r in range(1, rows + multiple + 1)] + [(rows, c) for c in range(1, cols + multiple + 1)]
    fits = [(r, c) for r, c in candidates if (r * c) % multiple == 0]
    return min(fits, key=lambda g: (abs(g[0] * g[1] - rows * cols), round(abs(math.log(g[1] / g[0] * rows / cols)), 9)))


#: Every model family, by ``model.family``.
FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        ModelFamily(
            name="gpt",
            data="megascale_omni.data.tokens_module:TokensData",
            model="megascale_omni.models.gpt_spec:GptModelSpec",
            evaluators=(("loss", "megascale_omni.evaluation.lm_loss:HeldOutLoss"),),
            features=frozenset({"vpp", "explicit_partition", "sequence_parallel", "context_parallel", "elastic", "moe",
                                "qk_layernorm", "kv_channels"}),
            cost_model="megascale_omni.parallel.pipeline_cost:lm_cost_model",
            profiler="megascale_omni.models.component_profile:profile_gpt_components",
            check=_check_gpt,
            notes=(
                ("data_workers", "its tokens are synthetic, generated in the training process"),
            ),
        ),
        ModelFamily(
            name="llava",
            data="megascale_omni.data.llava.module:ConversationData",
            model="megascale_omni.models.llava_spec:LlavaModelSpec",
            evaluators=(
                ("shapes", "megascale_omni.demo.llava_eval:ShapesEvaluator"),
                ("chat", "megascale_omni.evaluation.chat:ChatEvaluator"),
            ),
            default_dataset="megascale_omni.demo.defaults:llava_shapes",
            default_vocab="megascale_omni.demo.vocabulary:word_tokenizer_size",
            check_inputs="megascale_omni.data.llava.preflight:check_inputs",
            features=frozenset(
                {"vpp", "explicit_partition", "sequence_parallel", "context_parallel", "elastic", "data_blend",
                 "data_workers", "moe", "qk_layernorm", "kv_channels"}
            ),
            cost_model="megascale_omni.parallel.pipeline_cost:llava_cost_model",
            profiler="megascale_omni.models.component_profile:profile_llava_components",
            check=_check_llava,
        ),
        ModelFamily(
            name="dit",
            data="megascale_omni.data.dit.module:DitImageData",
            model="megascale_omni.models.dit.spec:DitModelSpec",
            evaluators=(("colors", "megascale_omni.demo.dit_eval:DitColorEvaluator"),),
            default_dataset="megascale_omni.demo.defaults:dit_shapes",
            check_inputs="megascale_omni.data.dit.preflight:check_inputs",
            features=frozenset({"explicit_partition", "context_parallel", "elastic"}),
            cost_model="megascale_omni.parallel.pipeline_cost_dit:dit_cost_model",
            check=_check_dit,
            notes=(
                ("vpp", "the DiT stage is one chunk per pp rank"),
                ("sequence_parallel", "the adaLN modulation is not sequence-parallel"),
                ("data_workers", "its batcher is not wired to the worker loader yet"),
                ("moe", "its blocks have dense MLPs only"),
                ("qk_layernorm", "its attention has no q/k norms"),
                ("kv_channels", "its heads are hidden_size / num_attention_heads wide"),
            ),
        ),
    )
}

#: The script that trains each family.
ENTRY_POINTS = {"gpt": "python -m megascale_omni.smoke", "llava": "pretrain_llava.py", "dit": "pretrain_dit.py"}


def get_family(name: str) -> ModelFamily:
    """The declaration of ``model.family`` ``name`` (ConfigError if unknown)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError("model.family", name, f"must be one of {sorted(FAMILIES)}") from None


def family_of(cfg: JobConfig) -> ModelFamily:
    return get_family(cfg.model.family)


def estimate_memory_per_gpu(cfg: JobConfig, cuda: bool = True, world_size: Optional[int] = None):
    """Predicted bytes per GPU of every pipeline rank of ``cfg`` under its
    family's cost model: a tuple of
    :class:`~megascale_omni.parallel.memory.StageMemory` (weights, gradients,
    optimizer state, activations; ``.total``), see
    :func:`megascale_omni.parallel.memory.estimate_memory_per_gpu`. ``cuda``:
    ``train.precision: auto`` means bf16; ``world_size``: GPUs of one replica
    group (None: DP 1). Any caller, before any process group; ConfigError if
    the family has no cost model."""
    from megascale_omni.parallel.memory import estimate_memory_per_gpu as estimate

    return estimate(cfg, family_of(cfg).cost_model_fn(cfg), cuda=cuda, world_size=world_size)
