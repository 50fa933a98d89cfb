"""Cross-section checks that need the world size.

Called on every rank *before* any process group exists, so a bad layout
fails in milliseconds with the same message on every rank.
"""

from __future__ import annotations

from megascale_omni.config.errors import ConfigError
from megascale_omni.config.schema import JobConfig


def data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    """DP size of one replica group: ``world_size // (tp * pp * cp)``."""
    return world_size // cfg.parallel.model_parallel_size


def validate_job(cfg: JobConfig, world_size: int) -> None:
    """Raise ConfigError for the first setting that cannot run on ``world_size`` ranks."""
    par, model, train = cfg.parallel, cfg.model, cfg.train
    mp = par.model_parallel_size
    if world_size % mp:
        raise ConfigError(
            "parallel",
            f"tp={par.tp} pp={par.pp} cp={par.cp}",
            f"world size {world_size} is not divisible by tp*pp*cp={mp}; "
            f"launch a multiple of {mp} processes or change the degrees",
        )
    # Everything megatron splits across TP ranks.
    for name, value in (
        ("model.num_attention_heads", model.num_attention_heads),
        ("model.num_query_groups", model.query_groups),
        ("model.hidden_size", model.hidden_size),
        ("model.ffn_hidden_size", model.ffn_size),
        ("model.make_vocab_size_divisible_by", model.make_vocab_size_divisible_by),
    ):
        _require_divisible_by_tp(name, value, par.tp)
    chunks = par.pp * (par.vpp or 1)
    if model.num_layers < chunks:
        raise ConfigError(
            "model.num_layers",
            model.num_layers,
            f"needs at least pp*vpp={chunks} layers (one per model chunk); add layers or lower pp/vpp",
        )
    if model.num_layers % chunks:
        raise ConfigError(
            "model.num_layers",
            model.num_layers,
            f"must be divisible by pp*vpp={chunks} for a uniform pipeline split",
        )
    if par.cp > 1:
        # megatron would build CP groups, but our data path does not yet
        # split sequences across CP ranks; refusing beats training wrongly.
        raise ConfigError("parallel.cp", par.cp, "context parallelism is not supported yet; set parallel.cp: 1")
    if par.sequence_parallel and model.seq_length % par.tp:
        raise ConfigError(
            "model.seq_length", model.seq_length, f"must be divisible by parallel.tp={par.tp} with sequence_parallel"
        )
    dp = world_size // mp
    per_step = train.micro_batch_size * dp
    if cfg.elastic.enabled:
        _validate_elastic(cfg)
    elif train.global_batch_size % per_step:
        raise ConfigError(
            "train.global_batch_size",
            train.global_batch_size,
            f"must be divisible by micro_batch_size*dp = {train.micro_batch_size}*{dp} = {per_step}; "
            f"use {max(per_step, train.global_batch_size // per_step * per_step)} or change micro_batch_size",
        )
    if model.family == "llava":
        _validate_llava(cfg)


def _validate_elastic(cfg: JobConfig) -> None:
    """Elastic jobs split the global batch at micro-batch granularity among
    a participant count that changes while training (see docs/elastic.md)."""
    train = cfg.train
    if train.global_batch_size % train.micro_batch_size:
        raise ConfigError(
            "train.global_batch_size", train.global_batch_size,
            f"must be a multiple of train.micro_batch_size={train.micro_batch_size} with elastic.enabled "
            "(replicas receive whole micro-batches)",
        )
    if cfg.parallel.use_distributed_optimizer:
        raise ConfigError(
            "parallel.use_distributed_optimizer", True,
            "is not supported with elastic.enabled (a joining replica heals whole optimizer state from a peer); "
            "set it to false",
        )
    if cfg.checkpoint.enabled:
        raise ConfigError(
            "checkpoint.dir", cfg.checkpoint.dir,
            "is not supported with elastic.enabled yet (replicas heal from live peers); leave checkpoint.dir empty",
        )


def _require_divisible_by_tp(name: str, value: int, tp: int) -> None:
    if value % tp:
        raise ConfigError(
            name, value, f"must be divisible by parallel.tp={tp} (megatron splits it across TP ranks); "
            f"use a multiple of {tp} or a smaller tp",
        )


def _validate_llava(cfg: JobConfig) -> None:
    vision, par = cfg.vision, cfg.parallel
    _require_divisible_by_tp("vision.num_attention_heads", vision.num_attention_heads, par.tp)
    _require_divisible_by_tp("vision.ffn_hidden_size", vision.ffn_size, par.tp)
    if par.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel", True, "LLaVA packing supports tp/pp/vpp/dp; set it to false"
        )
    if cfg.model.freeze and vision.freeze and vision.freeze_projector:
        raise ConfigError("model.freeze", True, "with vision.freeze and vision.freeze_projector nothing would train")


def validate_platform(cfg: JobConfig, cuda: bool) -> None:
    """Settings that need CUDA (every rank, after the device is known and
    before any process group starts)."""
    if cuda:
        return
    if cfg.train.precision == "bf16":
        raise ConfigError("train.precision", "bf16", "needs CUDA; on CPU use fp32 (or auto)")
    if cfg.parallel.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel", True,
            "needs transformer-engine layer norms (CUDA); megatron's torch LayerNorm rejects it on CPU",
        )
