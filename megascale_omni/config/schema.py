"""Typed configuration of a training job.

Each section is a dataclass; every field carries its meaning in the
docstring-style comment above it. Sections validate their own fields in
``__post_init__`` (cheap, local checks); checks that need several sections or
the world size live in :mod:`megascale_omni.config.validate`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from megascale_omni.config.errors import ConfigError


def _positive(section: str, name: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{section}.{name}", value, f"must be {bound}")


@dataclass
class ModelConfig:
    """Language-model (decoder) shape. Vision/DiT sections extend this."""

    #: Which trainer this config is for: ``gpt`` (smoke), ``llava`` or ``dit``.
    family: Literal["gpt", "llava", "dit"] = "gpt"
    #: Number of transformer layers of the language model.
    num_layers: int = 4
    #: Model width (hidden size), elements.
    hidden_size: int = 64
    #: Attention heads; must divide ``hidden_size`` and be divisible by TP.
    num_attention_heads: int = 4
    #: GQA groups; ``None`` means multi-head attention (groups = heads).
    num_query_groups: Optional[int] = None
    #: MLP width; ``None`` means ``4 * hidden_size``.
    ffn_hidden_size: Optional[int] = None
    #: Vocabulary size. For LLaVA it is taken from the tokenizer when 0.
    vocab_size: int = 256
    #: Pad the vocabulary to a multiple of this (must be divisible by TP).
    #: Independent of TP so every layout builds the same output layer.
    make_vocab_size_divisible_by: int = 128
    #: Tokens per sequence fed to the language model.
    seq_length: int = 64
    #: ``learned_absolute`` or ``rope``.
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    #: ``LayerNorm`` or ``RMSNorm``.
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    #: Dropout after attention/MLP blocks (0 makes layouts bitwise comparable).
    hidden_dropout: float = 0.0
    #: Dropout on attention probabilities.
    attention_dropout: float = 0.0
    #: Std of the normal weight initialisation.
    init_method_std: float = 0.02
    #: Tie the input embedding and the output layer.
    share_embeddings_and_output_weights: bool = False
    #: Layer implementation: ``auto`` picks transformer-engine on CUDA when installed.
    layer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    #: Freeze the language model (LLaVA stage-1 "train the projector only").
    freeze: bool = False
    #: Full activation recomputation of every LM and ViT layer (megatron
    #: ``recompute_granularity=full``): keeps only each layer's input between
    #: forward and backward, at the price of a second forward in backward.
    recompute: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            _positive("model", name, getattr(self, name))
        _positive("model", "vocab_size", self.vocab_size, allow_zero=self.family != "gpt")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "model.hidden_size",
                self.hidden_size,
                f"must be divisible by model.num_attention_heads={self.num_attention_heads}",
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                "model.num_query_groups",
                self.num_query_groups,
                f"must divide model.num_attention_heads={self.num_attention_heads}",
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name}", getattr(self, name), "must be in [0, 1)")

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass
class VisionConfig:
    """ViT encoder + projector of a LLaVA model (ignored by other families)."""

    #: Square input resolution, pixels.
    image_size: int = 32
    #: Patch side, pixels; tokens per image = (image_size / patch_size) ** 2.
    patch_size: int = 8
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    #: ViT MLP width; ``None`` = 4 * hidden_size.
    ffn_hidden_size: Optional[int] = None
    #: Hidden width of the 2-layer MLP projector; ``None`` = LM hidden size.
    projector_hidden_size: Optional[int] = None
    #: Freeze the ViT (typical for both LLaVA stages with a pretrained encoder).
    freeze: bool = False
    #: Freeze the projector.
    freeze_projector: bool = False
    #: Images per packed ``model.seq_length`` row that the pipeline cost model
    #: assumes (the ViT's share of pipeline stage 0 grows with it). The
    #: embedded shapes dataset averages 9.8 at seq_length 256 / 16 tokens per image.
    images_per_sequence: float = 9.8

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "num_layers", "hidden_size", "num_attention_heads"):
            _positive("vision", name, getattr(self, name))
        _positive("vision", "images_per_sequence", self.images_per_sequence, allow_zero=True)
        if self.image_size % self.patch_size:
            raise ConfigError(
                "vision.image_size", self.image_size, f"must be divisible by vision.patch_size={self.patch_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "vision.hidden_size",
                self.hidden_size,
                f"must be divisible by vision.num_attention_heads={self.num_attention_heads}",
            )

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


def _default_buckets() -> list[list[int]]:
    return [[16, 16], [12, 20], [20, 12], [24, 24], [16, 32], [32, 16]]


@dataclass
class DitConfig:
    """DiT-specific settings (ignored by other families). The transformer
    shape (layers, width, heads, MLP) comes from ``model``.

    Sizes are in *latent* pixels: image pixels for pixel-space training (the
    embedded shapes data), VAE latent pixels for latent shards made by
    ``tools/make_dit_latents.py``.
    """

    #: Side of a square patch; one patch is one transformer token.
    patch_size: int = 2
    #: Channels of the training tensor: 3 for RGB pixels, 4 for SD-style VAE latents.
    in_channels: int = 3
    #: Aspect-ratio bucket table, ``[height, width]`` pairs; each side a multiple of patch_size.
    buckets: list[list[int]] = field(default_factory=_default_buckets)
    #: Latent tokens per micro-batch ("package"): a bucket of N tokens gets
    #: ``token_budget // N`` images, so small images come in large batches.
    token_budget: int = 512
    #: ``learned``: captions are tokenized and embedded by the model;
    #: ``precomputed``: shards carry text-encoder states of width ``text_dim``.
    text_encoder: Literal["learned", "precomputed"] = "learned"
    #: Width of the caption embeddings (``0`` = ``model.hidden_size`` for learned).
    text_dim: int = 0
    #: Caption tokens kept (longer captions are truncated), including <bos>.
    max_text_length: int = 8
    #: Training timestep distribution: ``logit_normal`` (sigmoid of a normal,
    #: concentrates on mid-noise levels) or ``uniform`` on (0, 1).
    timestep_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    #: Probability of training a sample with the empty caption (enables CFG).
    caption_dropout: float = 0.1
    #: EMA decay of the weights used for sampling; 0 disables EMA.
    ema_decay: float = 0.999
    #: Euler steps of the ODE sampler.
    sample_steps: int = 25
    #: Classifier-free guidance scale (1 = no guidance).
    guidance_scale: float = 4.0
    #: Images sampled per colour prompt and resolution in evaluation.
    eval_samples_per_prompt: int = 4
    #: ``[height, width]`` resolutions sampled in evaluation.
    eval_resolutions: list[list[int]] = field(default_factory=lambda: [[16, 16], [16, 32]])

    def __post_init__(self) -> None:
        for name in ("patch_size", "in_channels", "token_budget", "max_text_length", "sample_steps",
                     "eval_samples_per_prompt"):
            _positive("dit", name, getattr(self, name))
        _positive("dit", "text_dim", self.text_dim, allow_zero=True)
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ConfigError("dit.caption_dropout", self.caption_dropout, "must be in [0, 1)")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError("dit.ema_decay", self.ema_decay, "must be in [0, 1) (0 disables EMA)")
        _positive("dit", "logit_std", self.logit_std)
        if not self.buckets:
            raise ConfigError("dit.buckets", self.buckets, "needs at least one [height, width] bucket")
        for name in ("buckets", "eval_resolutions"):
            for i, hw in enumerate(getattr(self, name)):
                if len(hw) != 2 or min(hw) <= 0 or hw[0] % self.patch_size or hw[1] % self.patch_size:
                    raise ConfigError(
                        f"dit.{name}[{i}]", hw,
                        f"must be [height, width], positive multiples of dit.patch_size={self.patch_size}",
                    )
        # Fail at start, not at the first large-image step: every bucket must
        # fit at least one image into a micro-batch.
        p = self.patch_size
        for i, (h, w) in enumerate(self.buckets):
            tokens = (h // p) * (w // p)
            if tokens > self.token_budget:
                raise ConfigError(
                    "dit.token_budget", self.token_budget,
                    f"bucket dit.buckets[{i}]={h}x{w} has {tokens} tokens (patch {p}) and cannot fit; "
                    f"raise dit.token_budget to >= {tokens} or remove that bucket",
                )


@dataclass
class ParallelConfig:
    """Parallel degrees inside one replica group (megatron vocabulary).

    ``dp`` is derived: ``world_size // (tp * pp * cp)``.
    """

    #: Tensor-parallel size.
    tp: int = 1
    #: Pipeline-parallel size.
    pp: int = 1
    #: Context-parallel size.
    cp: int = 1
    #: Virtual pipeline stages (model chunks) per pipeline rank; ``None`` = no interleaving.
    vpp: Optional[int] = None
    #: Shard optimizer state across DP ranks (megatron DistributedOptimizer).
    use_distributed_optimizer: bool = False
    #: Megatron sequence parallelism (requires tp > 1).
    sequence_parallel: bool = False
    #: Language-model layers per pipeline stage. ``uniform``: megatron's even
    #: split (``num_layers`` divisible by pp*vpp). ``auto``: the split that
    #: minimises the slowest stage under the cost model (or the measured
    #: ``pipeline_profile``) within ``pipeline_memory_gib``; stage 0 also runs
    #: the ViT, projector and embedding, the last stage the output layer and
    #: loss. A list gives the counts explicitly, one per model chunk in
    #: megatron's layout order (virtual stage 0 of pp ranks 0..pp-1, then
    #: virtual stage 1, ...), each >= 1, summing to ``model.num_layers``.
    pipeline_partition: Union[Literal["uniform", "auto"], list[int]] = "uniform"
    #: JSON written by ``tools/profile_layers.py`` with measured per-component
    #: times; ``null`` uses the FLOP cost model.
    pipeline_profile: Optional[str] = None
    #: Memory capacity of one pipeline rank, GiB (weights, gradients,
    #: optimizer state and in-flight activations as the cost model estimates
    #: them); ``null`` leaves memory unchecked.
    pipeline_memory_gib: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp"):
            _positive("parallel", name, getattr(self, name))
        if self.pipeline_memory_gib is not None:
            _positive("parallel", "pipeline_memory_gib", self.pipeline_memory_gib)
        if self.vpp is not None:
            if self.vpp < 2:
                raise ConfigError("parallel.vpp", self.vpp, "must be >= 2, or null to disable interleaving")
            if self.pp < 2:
                raise ConfigError("parallel.vpp", self.vpp, "interleaving needs parallel.pp >= 2; set vpp: null")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel", True, "needs parallel.tp > 1; set it to false")

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp


@dataclass
class TrainConfig:
    """Optimisation and schedule."""

    #: Seed for init, data order and dropout.
    seed: int = 1234
    #: Optimizer steps to run.
    steps: int = 10
    #: Samples (or packed sequences) per optimizer step, summed over DP ranks.
    global_batch_size: int = 8
    #: Samples per micro-batch on one DP rank.
    micro_batch_size: int = 2
    #: Peak learning rate.
    lr: float = 1.0e-3
    #: Final learning rate of the decay.
    min_lr: float = 1.0e-4
    #: Linear warm-up steps.
    lr_warmup_steps: int = 0
    #: ``cosine``, ``linear`` or ``constant``.
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    #: Decoupled weight decay.
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    #: Global gradient-norm clip; 0 disables.
    clip_grad: float = 1.0
    #: ``auto`` = bf16 on CUDA, fp32 on CPU.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    #: Evaluate every N steps (0 = only at the end, if an eval split exists).
    eval_interval: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size"):
            _positive("train", name, getattr(self, name))
        _positive("train", "lr", self.lr)
        _positive("train", "min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            raise ConfigError("train.min_lr", self.min_lr, f"must be <= train.lr={self.lr}")
        for name in ("lr_warmup_steps", "eval_interval"):
            _positive("train", name, getattr(self, name), allow_zero=True)
        _positive("train", "clip_grad", self.clip_grad, allow_zero=True)


@dataclass
class DataConfig:
    """Where training data comes from."""

    #: Dataset directory; ``null`` uses the embedded default for the model family.
    path: Optional[str] = None
    #: Tokenizer file or directory; ``null`` uses the dataset's ``tokenizer.json``.
    tokenizer: Optional[str] = None
    #: Size of the embedded shapes dataset generated when ``path`` is null.
    default_num_train: int = 20000
    default_num_val: int = 500
    #: Abort when skipped (bad) samples exceed this fraction of samples seen.
    max_bad_sample_fraction: float = 0.01

    def __post_init__(self) -> None:
        _positive("data", "default_num_train", self.default_num_train)
        _positive("data", "default_num_val", self.default_num_val)
        if not 0.0 <= self.max_bad_sample_fraction <= 1.0:
            raise ConfigError("data.max_bad_sample_fraction", self.max_bad_sample_fraction, "must be in [0, 1]")


@dataclass
class LoggingConfig:
    """Where metrics and logs go."""

    #: Run directory for JSONL metrics, TensorBoard events and checkpoints by default.
    output_dir: str = "runs/default"
    #: Log one line every N steps.
    log_interval: int = 1
    #: Write TensorBoard event files under ``output_dir/tensorboard``.
    tensorboard: bool = True
    #: Python logging level.
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: Show a progress bar on the logging rank.
    progress_bar: bool = True

    def __post_init__(self) -> None:
        _positive("logging", "log_interval", self.log_interval)


#: Stands for ``logging.output_dir`` in ``checkpoint.dir``/``checkpoint.local_dir``.
OUTPUT_DIR_PLACEHOLDER = "{output_dir}"


@dataclass
class ControlConfig:
    """Control socket of the replica group (served by its rank 0).

    See ``docs/control-protocol.md``. There is deliberately no inline token
    field: the resolved config is written to ``output_dir/config.yaml``.
    """

    #: Serve the control socket and apply commands at step boundaries.
    enabled: bool = True
    #: Unix socket path; ``null`` = ``<logging.output_dir>/control.sock``. Mode 0600.
    socket_path: Optional[str] = None
    #: Also listen on TCP at this port (0 = any free port); ``null`` = no TCP.
    #: TCP requests must carry the token (``token_file`` or ``token_env``).
    tcp_port: Optional[int] = None
    #: TCP bind address; loopback by default. Anything else exposes the job to the network.
    tcp_host: str = "127.0.0.1"
    #: File holding the shared secret for TCP clients (first line; >= 16 characters).
    token_file: Optional[str] = None
    #: Environment variable holding the token when ``token_file`` is null.
    token_env: str = "MEGASCALE_CONTROL_TOKEN"
    #: While paused, ranks meet in one small collective every this many
    #: seconds (keeps them far from the collective timeout), and rank 0
    #: notices ``resume`` at most this late.
    pause_poll_s: float = 0.5
    #: Concurrent client connections; more are answered ``busy`` and closed.
    max_connections: int = 16
    #: Close a client connection idle for this long, seconds.
    idle_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.tcp_port is not None and not 0 <= self.tcp_port <= 65535:
            raise ConfigError("control.tcp_port", self.tcp_port, "must be in [0, 65535] (0 = any free port) or null")
        if not self.token_env:
            raise ConfigError("control.token_env", self.token_env, "must name an environment variable")
        _positive("control", "pause_poll_s", self.pause_poll_s)
        _positive("control", "max_connections", self.max_connections)
        _positive("control", "idle_timeout_s", self.idle_timeout_s)


@dataclass
class CheckpointConfig:
    """Sharded async checkpoints: where, when, how many (see docs/checkpoints.md)."""

    #: Persistent checkpoint directory; empty disables checkpointing.
    #: ``{output_dir}`` in it (and in ``local_dir``) stands for
    #: ``logging.output_dir``, e.g. ``{output_dir}/checkpoints``.
    dir: str = ""
    #: Optional fast node-local directory: saves land here first and are
    #: replicated to ``dir`` in the background. Must be visible to every rank
    #: of the job (one node, or a shared fast file system).
    local_dir: str = ""
    #: Save every N optimizer steps (0 = off).
    interval: int = 0
    #: Also save when this many minutes passed since the last save (0 = off).
    interval_minutes: float = 0.0
    #: Complete checkpoints kept per tier; older ones are pruned.
    keep_last: int = 3
    #: Training blocks only for the host copy; a background writer does the rest.
    async_save: bool = True
    #: Save when training finishes.
    save_at_end: bool = True
    #: ``auto`` = newest complete checkpoint of either tier (fresh start if
    #: none), ``none`` = always fresh, or a checkpoint directory path.
    resume: str = "auto"
    #: Verify file checksums (sha256) before loading, not only sizes.
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        _positive("checkpoint", "interval", self.interval, allow_zero=True)
        _positive("checkpoint", "interval_minutes", self.interval_minutes, allow_zero=True)
        _positive("checkpoint", "keep_last", self.keep_last)
        if self.local_dir and not self.dir:
            raise ConfigError(
                "checkpoint.local_dir", self.local_dir,
                "the fast tier needs a persistent tier: set checkpoint.dir as well",
            )
        if self.local_dir and self.dir and os.path.abspath(self.local_dir) == os.path.abspath(self.dir):
            raise ConfigError("checkpoint.local_dir", self.local_dir, "must differ from checkpoint.dir")
        if not self.resume:
            raise ConfigError("checkpoint.resume", self.resume, "use auto, none or a checkpoint path")

    @property
    def enabled(self) -> bool:
        return bool(self.dir)


@dataclass
class ElasticConfig:
    """Elastic data parallelism across replica groups through torchft (see docs/elastic.md).

    One torchrun job is one replica group (a full model copy: tp x pp x cp,
    optionally an inner dp). Replica groups find each other through a torchft
    lighthouse; gradients are summed across the current participants and the
    optimizer steps only when the quorum commits.
    """

    #: Join the lighthouse's quorum instead of training alone.
    enabled: bool = False
    #: Lighthouse address, ``http://host:port`` (``torchft_lighthouse --bind``).
    lighthouse: str = ""
    #: This replica group's id: letters, digits, ``-`` and ``_``; unique among live groups.
    replica_id: str = ""
    #: Fewest participating replica groups with which a step may commit.
    min_replicas: int = 1
    #: Seconds a step waits for the quorum (covers a join or a dead peer's heartbeat timeout).
    quorum_timeout_s: float = 120.0
    #: Seconds for each cross-replica collective and peer state transfer before the step is abandoned.
    timeout_s: float = 60.0
    #: Directory for the sample ledger (JSONL per replica and inner DP rank); empty disables it.
    ledger_dir: str = ""
    #: Start as a warm standby: build everything, serve the control socket, but
    #: stay out of the quorum until ``omni-ctl join`` (or exit 0 on ``drain``).
    standby: bool = False

    def __post_init__(self) -> None:
        _positive("elastic", "min_replicas", self.min_replicas)
        _positive("elastic", "quorum_timeout_s", self.quorum_timeout_s)
        _positive("elastic", "timeout_s", self.timeout_s)
        if not self.enabled:
            return
        if not re.fullmatch(r"https?://[^\s/:]+:[0-9]+/?", self.lighthouse):
            raise ConfigError(
                "elastic.lighthouse", self.lighthouse,
                "must be the lighthouse address http://host:port (printed by torchft_lighthouse)",
            )
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.replica_id):
            raise ConfigError(
                "elastic.replica_id", self.replica_id,
                "must be 1-64 letters, digits, '-' or '_' and unique per replica group, e.g. replica_id=r1",
            )


@dataclass
class JobConfig:
    """A whole training job: one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    dit: DitConfig = field(default_factory=DitConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def __post_init__(self) -> None:
        # Checkpoints follow the run directory when a config says so, so
        # overriding logging.output_dir never resumes another run's checkpoints.
        ckpt, out = self.checkpoint, self.logging.output_dir
        ckpt.dir = ckpt.dir.replace(OUTPUT_DIR_PLACEHOLDER, out)
        ckpt.local_dir = ckpt.local_dir.replace(OUTPUT_DIR_PLACEHOLDER, out)
