"""Typed configuration of a training job: :class:`JobConfig` and the
sections of how training is laid out and fed (parallel, train, data).

Each section is a dataclass; every field carries its meaning in the
docstring-style comment above it. Sections validate their own fields in
``__post_init__`` (cheap, local checks); checks that need several sections or
the world size live in :mod:`megascale_omni.config.validate`. The model
sections are in :mod:`.model_sections`, the runtime ones (logging, control,
checkpoint, elastic) in :mod:`.runtime_sections`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from megascale_omni.config.constraints import check_fields, checked
from megascale_omni.config.errors import ConfigError, require_positive
from megascale_omni.config.model_sections import DitConfig, ModelConfig, VisionConfig
from megascale_omni.config.moe_section import MoeConfig
from megascale_omni.config.preflight_section import PreflightConfig
from megascale_omni.config.runtime_sections import (
    OUTPUT_DIR_PLACEHOLDER,
    CheckpointConfig,
    ControlConfig,
    ElasticConfig,
    LoggingConfig,
    WatchdogConfig,
)

__all__ = [
    "CheckpointConfig", "ControlConfig", "DataConfig", "DitConfig", "ElasticConfig", "JobConfig",
    "LoggingConfig", "ModelConfig", "MoeConfig", "OUTPUT_DIR_PLACEHOLDER", "ParallelConfig", "PlatformConfig", "PreflightConfig",
    "TrainConfig",
    "VisionConfig", "WatchdogConfig",
]


@dataclass
class ParallelConfig:
    """Parallel degrees inside one replica group (megatron vocabulary).

    ``dp`` is derived: ``world_size // (tp * pp * cp)``.
    """

    #: Tensor-parallel size.
    tp: int = checked(1, gt=0)
    #: Pipeline-parallel size.
    pp: int = checked(1, gt=0)
    #: Context-parallel size: every sequence is split over ``cp`` ranks
    #: (load-balanced, 2*cp chunks) and attention runs as ring attention
    #: (docs/context_parallel.md).
    cp: int = checked(1, gt=0)
    #: transformer-engine's CP communication (``p2p`` ring, ``a2a``,
    #: ``allgather`` (TE's ``all_gather``; not with packed THD batches, so
    #: DiT only), ``a2a+p2p`` (needs ``hierarchical_cp_sizes``)); the local
    #: layer spec always runs the p2p ring.
    cp_comm_type: Literal["p2p", "a2a", "allgather", "a2a+p2p"] = "p2p"
    #: ``a2a+p2p`` only: ``[a2a size, p2p size]`` with product ``cp``; megatron
    #: builds these hierarchical CP groups (``hierarchical_context_parallel_sizes``).
    hierarchical_cp_sizes: Optional[list[int]] = None
    #: Expert-parallel size: the routed experts of every MoE layer are split
    #: over ``ep`` ranks and tokens travel to them by ``moe.token_dispatcher``
    #: (megatron ``expert_model_parallel_size``). ``ep * expert_tp`` must
    #: divide ``world_size / pp``; ``moe.num_experts`` divisible by ``ep``.
    ep: int = checked(1, gt=0)
    #: Tensor-parallel size inside each expert (megatron
    #: ``expert_tensor_parallel_size``); ``null`` = ``tp``, megatron's default.
    expert_tp: Optional[int] = checked(None, gt=0)
    #: What one rank sends per second through the MoE token exchange over
    #: its expert group (all-to-all, or the allgather dispatcher's all-gather
    #: and reduce-scatter), GB/s (1e9 bytes/s). Planning only: the pipeline
    #: planner turns the dispatch bytes of an MoE layer into time with it
    #: (docs/moe.md). Default 50: one 400 Gb/s InfiniBand NIC per GPU, the
    #: link of an expert group that spans nodes (DeepEP's README measures
    #: 43-58 GB/s over a ConnectX-7 400 Gb/s NIC on H800); an expert group
    #: inside one H100/H800 NVLink node reaches ~150.
    alltoall_bandwidth_gbs: float = checked(50.0, gt=0)
    #: Virtual pipeline stages (model chunks) per pipeline rank; ``None`` = no interleaving.
    vpp: Optional[int] = None
    #: Shard optimizer state across DP ranks (megatron DistributedOptimizer).
    use_distributed_optimizer: bool = False
    #: Reduce gradient buckets during backward as they fill (megatron DDP
    #: overlap), instead of once after it. ``null`` = on with CUDA and DP > 1
    #: (Megatron-LM's GPU default), off on CPU; ``true`` also works on gloo.
    overlap_grad_reduce: Optional[bool] = None
    #: With the distributed optimizer, all-gather the updated parameters
    #: bucket by bucket during the next forward (megatron DDP
    #: ``overlap_param_gather``: each bucket is awaited in a forward pre-hook)
    #: instead of synchronously inside ``optimizer.step()``. ``null`` = on
    #: with CUDA, the distributed optimizer and DP > 1 (Megatron-LM's GPU
    #: default), off on CPU; ``true`` also works on gloo and turns
    #: ``overlap_grad_reduce`` on when that is ``null``: megatron buckets
    #: parameters only when it reduces gradients during backward, and with a
    #: single bucket per buffer the first forward module awaits the whole
    #: gather.
    overlap_param_gather: Optional[bool] = None
    #: Elements per DDP bucket (gradient reduction and parameter gather) of
    #: the first model chunk; ``null`` = megatron's default, max(40M, 1M x DP).
    #: Buckets exist only with ``overlap_grad_reduce``: without it every
    #: buffer is one bucket.
    ddp_bucket_size: Optional[int] = checked(None, gt=0)
    #: Megatron sequence parallelism: the residual stream between the TP
    #: matmuls (norms, dropout, residual adds) is split along the sequence
    #: over the TP ranks, dividing those activations by tp (docs/memory.md).
    #: Needs tp > 1 and ``model.seq_length`` divisible by tp * cp; GPT and
    #: LLaVA, on CPU (local spec) and GPU.
    sequence_parallel: bool = False
    #: Transformer layers (LM layers, DiT blocks) per pipeline stage.
    #: ``uniform``: megatron's even split (``num_layers`` divisible by
    #: pp*vpp). ``auto``: the split that minimises the slowest stage under the
    #: family's cost model (or the measured ``pipeline_profile``) within
    #: ``pipeline_memory_gib``; stage 0 also runs the ViT, projector and
    #: embedding (DiT: its embedders), the last stage the output layer and
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
    pipeline_memory_gib: Optional[float] = checked(None, gt=0)

    def __post_init__(self) -> None:
        check_fields(self, "parallel")
        if self.vpp is not None:
            if self.vpp < 2:
                raise ConfigError("parallel.vpp", self.vpp, "must be >= 2, or null to disable interleaving")
            if self.pp < 2:
                raise ConfigError("parallel.vpp", self.vpp, "interleaving needs parallel.pp >= 2; set vpp: null")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError(
                "parallel.overlap_param_gather", True,
                "needs parallel.use_distributed_optimizer=true (megatron gathers parameters only for the "
                "distributed optimizer's shards); set use_distributed_optimizer=true or overlap_param_gather=false",
            )
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel", True, "needs parallel.tp > 1; set it to false")
        self._check_hierarchical_cp()

    def _check_hierarchical_cp(self) -> None:
        sizes = self.hierarchical_cp_sizes
        if self.cp_comm_type != "a2a+p2p" or self.cp == 1:
            if sizes is not None:
                raise ConfigError(
                    "parallel.hierarchical_cp_sizes", sizes,
                    "applies to parallel.cp_comm_type: a2a+p2p with parallel.cp > 1 only; set it to null",
                )
            return
        hint = f"set [a2a size, p2p size], both > 1 with product parallel.cp={self.cp}"
        if sizes is None:
            raise ConfigError("parallel.hierarchical_cp_sizes", None, f"a2a+p2p needs hierarchical CP groups: {hint}")
        if len(sizes) != 2 or any(not isinstance(n, int) or n < 2 for n in sizes) or sizes[0] * sizes[1] != self.cp:
            raise ConfigError("parallel.hierarchical_cp_sizes", sizes, hint)

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def expert_tp_size(self) -> int:
        """``expert_tp`` resolved (``tp`` when null, as megatron does)."""
        return self.expert_tp or self.tp


@dataclass
class TrainConfig:
    """Optimisation and schedule."""

    #: Seed for init, data order and dropout. Below 2**31: megatron, torch
    #: and the data plans add per-rank and per-stream offsets to it, and
    #: numpy's legacy generator takes 32-bit seeds.
    seed: int = checked(1234, ge=0, lt=2**31)
    #: Optimizer steps to run.
    steps: int = checked(10, gt=0)
    #: Samples (or packed sequences) per optimizer step, summed over DP ranks.
    global_batch_size: int = checked(8, gt=0)
    #: Samples per micro-batch on one DP rank.
    micro_batch_size: int = checked(2, gt=0)
    #: Peak learning rate.
    lr: float = checked(1.0e-3, gt=0)
    #: Final learning rate of the decay.
    min_lr: float = checked(1.0e-4, ge=0)
    #: Linear warm-up steps.
    lr_warmup_steps: int = checked(0, ge=0)
    #: ``cosine``, ``linear`` or ``constant``.
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    #: Decoupled weight decay.
    weight_decay: float = checked(0.01, ge=0)
    #: Adam's first-moment decay.
    adam_beta1: float = checked(0.9, ge=0, lt=1)
    #: Adam's second-moment decay (Hugging Face Trainer's default is 0.999).
    adam_beta2: float = checked(0.95, ge=0, lt=1)
    #: Adam's epsilon, added to the root of the second moment.
    adam_eps: float = checked(1.0e-8, gt=0)
    #: Global gradient-norm clip; 0 disables.
    clip_grad: float = checked(1.0, ge=0)
    #: Parameter and compute dtype. ``auto`` = bf16 on CUDA, fp32 on CPU;
    #: ``bf16`` also runs on CPU (slowly). bf16 keeps fp32 gradient buffers,
    #: fp32 master weights in the optimizer and an fp32 loss.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    #: Evaluate every N steps (0 = only at the end, if an eval split exists).
    eval_interval: int = checked(0, ge=0)
    #: Which evaluation runs, by the family's registry names: ``auto`` (the
    #: first that applies to the data: LLaVA ``shapes`` for the word-level
    #: shapes set, else ``chat``), ``none``, or one of the family's: gpt
    #: ``loss``, llava ``shapes`` / ``chat``, dit ``colors``.
    evaluator: str = "auto"
    #: Held-out samples a LLaVA evaluation scores: the first N usable samples
    #: of the ``val/`` split (0 = the whole split).
    eval_samples: int = checked(0, ge=0)
    #: LLaVA evaluations: also score with images shuffled across samples (the
    #: control: what the model reads from the pixels), a second pass.
    eval_shuffled_images: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "train")
        if self.min_lr > self.lr:
            raise ConfigError("train.min_lr", self.min_lr, f"must be <= train.lr={self.lr}")


@dataclass
class BlendSource:
    """One training dataset of ``data.blend``."""

    #: Dataset directory holding a ``train/`` split (shards + index.json).
    path: str = ""
    #: Relative share of training samples (any positive scale).
    weight: float = 1.0


@dataclass
class BlendStage:
    """One stage of ``data.blend_schedule``: the blend's weights from ``step`` on."""

    #: First global step (0-based, the step counter a checkpoint records) of the stage.
    step: int = 0
    #: One weight per ``data.blend`` source, in its order (>= 0, not all 0; any scale).
    weights: list[float] = field(default_factory=list)


#: Frames of each clip of the embedded shapes dataset (``data.default_video_fraction``):
#: enough for a motion, a colour change half way and two events in order. The demo
#: generator and the pipeline planner both read it here.
DEFAULT_CLIP_FRAMES = 4


@dataclass
class DataConfig:
    """Where training data comes from."""

    #: Dataset directory; ``null`` uses the embedded default for the model family.
    path: Optional[str] = None
    #: Tokenizer file or directory; ``null`` uses the dataset's ``tokenizer.json``.
    tokenizer: Optional[str] = None
    #: Size of the embedded shapes dataset generated when ``path`` is null.
    default_num_train: int = checked(20000, gt=0)
    #: Size of the embedded shapes dataset's val split.
    default_num_val: int = checked(500, gt=0)
    #: LLaVA: share of the embedded shapes dataset (both splits) that is
    #: synthetic video clips whose questions need the frame order (a shape
    #: that moves, a colour that changes, two events in order; docs/video.md).
    default_video_fraction: float = checked(0.0, ge=0, le=1)
    #: Abort when skipped (bad) samples exceed this fraction of samples seen.
    max_bad_sample_fraction: float = checked(0.01, ge=0, le=1)
    #: How LLaVA conversations become tokens. ``words``: the word-level
    #: tokenizer of the shapes demo (one token per word, ``<bos>`` user words,
    #: answer words ``<eos>``). ``chat``: a Hugging Face tokenizer directory
    #: (``tokenizer`` above, else the dataset directory) whose chat template
    #: renders the turns in order; loss on the assistant tokens only.
    format: Literal["words", "chat"] = "words"
    #: ``chat`` format: vocabulary token used for image placeholders (each
    #: ``<image>`` marker in a user turn becomes ``vision.tokens_per_image`` of them).
    image_token: str = "<image>"
    #: Vocabulary token of video placeholders (``chat`` and ``words`` formats):
    #: each ``<video>`` marker of a user turn becomes ``vision.video_tokens(frames)``
    #: of them. Needed only when the data has videos.
    video_token: str = "<video>"
    #: Image preprocessing: ``exact`` (images already ``vision.image_size``
    #: square, scaled to [-1, 1]), ``resize_crop`` (CLIP: resize the short side,
    #: centre crop) or ``pad_square`` (LLaVA-1.5: pad to a square with the mean
    #: colour, then resize); both normalise with the tower's mean/std; or
    #: ``anyres`` (LLaVA-NeXT: an overview plus the tiles of the best grid of
    #: ``image_grid_pinpoints``, each a tower input of ``vision.tokens_per_image``
    #: tokens; needs image sizes in ``index.json``, written by the current tools).
    image_mode: Literal["exact", "resize_crop", "pad_square", "anyres"] = "exact"
    #: The tower's ``preprocessor_config.json`` (or its directory) for
    #: ``image_mode`` other than ``exact``; ``null``: the tokenizer directory's
    #: one when present (``tools/hf_import.py`` copies it there), else a plain
    #: resize to ``vision.image_size`` with mean = std = 0.5.
    image_processor: Optional[str] = None
    #: LLaVA: frames read per ``<video>`` of a sample, uniformly spread over
    #: the frames ingestion stored (``tools/ingest_llava.py --video-frames``
    #: chose those, docs/video.md); ``0``: every stored frame. Each frame is
    #: one tower input preprocessed by ``image_mode`` (anyres: its overview),
    #: pooled by ``vision.video_pool_stride`` (docs/video.md).
    video_frames: int = checked(8, ge=0)
    #: LLaVA: vision-tower tokens (image views and video frames, each
    #: ``vision.tokens_per_image``) one micro-batch may hold, so a long clip
    #: cannot blow the tower's activation memory. The plan packs each row
    #: with at most this / ``train.micro_batch_size`` of them and defers a
    #: sample a row has no room for to another row (counted as
    #: ``vision_deferred`` in the step record); a sample over a row's share
    #: on its own is excluded from the plan and counted as a bad sample, with
    #: its reason in the log (docs/video.md). ``0``: no budget.
    max_vision_tokens_per_microbatch: int = checked(0, ge=0)
    #: LLaVA: train on several datasets mixed by weight, e.g.
    #: ``[{path: data/instruct, weight: 0.8}, {path: data/text_only, weight: 0.2}]``:
    #: their ``train/`` splits, in the step-indexed plan (docs/data.md). The
    #: tokenizer and the ``val/`` split still come from ``path``. Empty: ``path``'s train split.
    blend: list[BlendSource] = field(default_factory=list)
    #: LLaVA: change the blend's weights during training, e.g. ``[{step: 2000,
    #: weights: [0.6, 0.4]}, {step: 5000, weights: [0.3, 0.7]}]`` (steps strictly
    #: increasing): from each stage's ``step`` on its weights replace the
    #: ``blend`` weights, at the first blended epoch that starts there or later
    #: (``blend_epoch_size``). Part of the sample plan: a resume continues the
    #: mix where it was (docs/data.md). Empty: the ``blend`` weights throughout.
    blend_schedule: list[BlendStage] = field(default_factory=list)
    #: LLaVA blends: samples per blended epoch, the unit the mix is exact over
    #: and changes by (a schedule's stage starts at an epoch's first step); a
    #: trailing partial global batch of each epoch is not trained.
    #: ``0``: every usable sample of the sources.
    blend_epoch_size: int = checked(0, ge=0)
    #: LLaVA: worker processes that read, decode and collate the micro-batches
    #: of the next steps while the current one trains (in plan order; each
    #: training process starts its own). ``0``: built in the training process
    #: between steps (docs/data.md has the measured trade-off).
    num_workers: int = checked(0, ge=0)
    #: With ``num_workers`` > 0: steps built ahead of the one training,
    #: rounded up to a multiple of ``num_workers``.
    prefetch_steps: int = checked(2, gt=0)
    #: LLaVA: pad every sample (with loss-free padding at its end) to a
    #: multiple of this many tokens before packing; context parallelism needs
    #: a multiple of ``2 * parallel.cp``. ``0``: 8 at every layout (serves
    #: cp 1, 2 and 4), so a run packs the same rows, and each step holds the
    #: same samples, whatever its layout; cp 8 and more need an explicit
    #: value. Part of the sample plan: a resume must keep it (docs/checkpoints.md).
    pad_to_multiple_of: int = checked(0, ge=0)

    def __post_init__(self) -> None:
        check_fields(self, "data")
        for i, source in enumerate(self.blend):
            if not source.path.strip():
                raise ConfigError(f"data.blend[{i}].path", source.path, "must name a dataset directory")
            require_positive("data", f"blend[{i}].weight", source.weight)
        self._check_blend_schedule()
        if not self.image_token.strip():
            raise ConfigError("data.image_token", self.image_token, "must name a token of the tokenizer")

    def _check_blend_schedule(self) -> None:
        """ConfigError (one line, naming the stage's field) for a schedule
        without a blend, steps not increasing, or a weight row that does not
        give every source a weight >= 0 with a positive sum."""
        if self.blend_schedule and not self.blend:
            raise ConfigError("data.blend_schedule", f"{len(self.blend_schedule)} stages",
                              "changes the weights of data.blend, which is empty; list the blend's sources")
        previous = -1
        for i, stage in enumerate(self.blend_schedule):
            name = f"data.blend_schedule[{i}]"
            if isinstance(stage.step, bool) or not isinstance(stage.step, int) or stage.step <= previous:
                raise ConfigError(f"{name}.step", stage.step, "must be an int >= 0" if i == 0 else
                                  f"must be an int > {previous}, the step of the stage before (steps strictly increase)")
            previous = stage.step
            w = stage.weights
            if len(w) != len(self.blend):
                raise ConfigError(f"{name}.weights", w, f"needs one weight per data.blend source ({len(self.blend)})")
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < float("inf") for x in w):
                raise ConfigError(f"{name}.weights", w, "must be finite numbers >= 0 (0 pauses a source)")
            if not sum(w) > 0:
                raise ConfigError(f"{name}.weights", w, "must not all be 0 (some source must supply the samples)")


@dataclass
class PlatformConfig:
    """Where the job runs."""

    #: ``auto``: CUDA + NCCL when a GPU is present, else CPU + gloo. ``cuda``:
    #: a GPU is required (a host without one exits 2 before anything starts).
    #: ``cpu``: the CPU path even on a GPU host.
    device: Literal["auto", "cuda", "cpu"] = "auto"


@dataclass
class JobConfig:
    """A whole training job: one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    dit: DitConfig = field(default_factory=DitConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    platform: PlatformConfig = field(default_factory=PlatformConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)

    def __post_init__(self) -> None:
        # Checkpoints follow the run directory when a config says so, so
        # overriding logging.output_dir never resumes another run's checkpoints.
        ckpt, out = self.checkpoint, self.logging.output_dir
        ckpt.dir = ckpt.dir.replace(OUTPUT_DIR_PLACEHOLDER, out)
        ckpt.local_dir = ckpt.local_dir.replace(OUTPUT_DIR_PLACEHOLDER, out)
