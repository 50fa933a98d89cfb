"""Config sections of what is trained: the language model, the vision tower
and projector (LLaVA), and the diffusion transformer (DiT).

Every field carries its meaning in the comment above it; ``__post_init__``
does the cheap, local checks (cross-section checks: :mod:`.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from megascale_omni.config.constraints import check_fields, checked
from megascale_omni.config.errors import ConfigError

#: Upper bounds that catch a typo'd size (an extra zero or two) before any memory is spent.
MAX_SEQ_LENGTH = 1 << 20
MAX_VOCAB_SIZE = 1 << 24


@dataclass
class ModelConfig:
    """Language-model (decoder) shape. Vision/DiT sections extend this."""

    #: Which trainer this config is for: ``gpt`` (smoke), ``llava`` or ``dit``.
    family: Literal["gpt", "llava", "dit"] = "gpt"
    #: Number of transformer layers of the language model.
    num_layers: int = checked(4, gt=0)
    #: Model width (hidden size), elements.
    hidden_size: int = checked(64, gt=0)
    #: Attention heads; must divide ``hidden_size`` and be divisible by TP.
    num_attention_heads: int = checked(4, gt=0)
    #: GQA groups; ``None`` means multi-head attention (groups = heads).
    num_query_groups: Optional[int] = checked(None, gt=0)
    #: Width of one attention head (megatron ``kv_channels``, HF ``head_dim``);
    #: ``None`` means ``hidden_size / num_attention_heads``. Qwen3-30B-A3B: 128 at hidden 2048, 32 heads.
    kv_channels: Optional[int] = checked(None, gt=0)
    #: MLP width; ``None`` means ``4 * hidden_size``.
    ffn_hidden_size: Optional[int] = checked(None, gt=0)
    #: Vocabulary size. For LLaVA it is taken from the tokenizer when 0.
    vocab_size: int = checked(256, ge=0, le=MAX_VOCAB_SIZE)
    #: Pad the vocabulary to a multiple of this (must be divisible by TP).
    #: Independent of TP so every layout builds the same output layer.
    make_vocab_size_divisible_by: int = checked(128, gt=0)
    #: Tokens per sequence fed to the language model.
    seq_length: int = checked(64, gt=0, le=MAX_SEQ_LENGTH, note="tokens per sequence")
    #: ``learned_absolute`` or ``rope``.
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    #: ``LayerNorm`` or ``RMSNorm``.
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    #: Epsilon of every norm of the language model.
    norm_epsilon: float = checked(1e-5, gt=0)
    #: MLP activation: ``gelu`` (GPT-2 style) or ``swiglu`` (Llama/Qwen/Mistral:
    #: ``down(silu(gate(x)) * up(x))``, megatron's gated linear unit).
    activation: Literal["gelu", "swiglu"] = "gelu"
    #: Biases on every linear layer (attention and MLP). Llama/Qwen/Mistral: false.
    add_bias_linear: bool = True
    #: Bias on the fused QKV projection even when ``add_bias_linear`` is false (Qwen2).
    add_qkv_bias: bool = False
    #: RMS/LayerNorm over each head's query and key before RoPE (megatron
    #: ``qk_layernorm``; Qwen3's ``q_norm``/``k_norm``). Language model only.
    qk_layernorm: bool = False
    #: RoPE base (HF ``rope_theta``); only with ``position_embedding_type: rope``.
    rotary_base: float = checked(10000.0, gt=0)
    #: RoPE frequency scaling: ``none``; ``linear`` (positions divided by
    #: ``rope_scaling_factor``); ``llama3`` (Llama-3.1 banded scaling with
    #: low/high frequency factors 1/4 and 8192 original positions).
    rope_scaling: Literal["none", "linear", "llama3"] = "none"
    #: Factor of ``rope_scaling`` (ignored for ``none``).
    rope_scaling_factor: float = checked(1.0, gt=0)
    #: Dropout after attention/MLP blocks (0 makes layouts bitwise comparable).
    hidden_dropout: float = checked(0.0, ge=0, lt=1)
    #: Dropout on attention probabilities.
    attention_dropout: float = checked(0.0, ge=0, lt=1)
    #: Std of the normal weight initialisation.
    init_method_std: float = checked(0.02, ge=0)
    #: Tie the input embedding and the output layer.
    share_embeddings_and_output_weights: bool = False
    #: Layer implementation: ``auto`` picks transformer-engine on CUDA when installed.
    layer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    #: Freeze the language model (LLaVA stage-1 "train the projector only").
    freeze: bool = False
    #: Activation recomputation of every LM and ViT layer (docs/memory.md).
    #: ``none``: keep every activation. ``selective``: recompute the attention
    #: core (scores, softmax, attention over V) in backward (megatron
    #: ``recompute_granularity=selective``, ``recompute_modules=[core_attn]``);
    #: drops the activation term that grows with the sequence, for a few
    #: percent more FLOPs. ``full``: keep only each layer's input and rerun
    #: the layer's forward in backward (``recompute_granularity=full``,
    #: ``recompute_method=uniform``, ``recompute_num_layers=1``). The
    #: booleans of older configs still work: ``true`` is ``full``, ``false``
    #: is ``none``.
    recompute: Union[bool, Literal["none", "selective", "full"]] = "none"

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if isinstance(self.recompute, bool):  # configs written before selective recompute existed
            self.recompute = "full" if self.recompute else "none"
        if self.family == "gpt" and self.vocab_size == 0:
            raise ConfigError("model.vocab_size", 0, "must be > 0 for the gpt family (it has no tokenizer to take it from)")
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
        uses_rope = self.position_embedding_type == "rope"
        if uses_rope and self.head_dim % 2:
            field = "model.kv_channels" if self.kv_channels else "model.hidden_size"
            raise ConfigError(
                field, self.kv_channels or self.hidden_size,
                f"rope rotates pairs of channels: the head dim ({'kv_channels' if self.kv_channels else ''}"
                f"{'' if self.kv_channels else 'hidden_size / num_attention_heads'} = {self.head_dim}) must be even",
            )
        if not uses_rope and (self.rope_scaling != "none" or self.rotary_base != 10000.0):
            raise ConfigError(
                "model.position_embedding_type", self.position_embedding_type,
                "model.rotary_base / model.rope_scaling only apply to rope; set position_embedding_type: rope",
            )

    def padded_vocab_size(self, vocab: int) -> int:
        """Rows of the embedding/output layer for a ``vocab``-token vocabulary:
        rounded up to ``make_vocab_size_divisible_by`` (at least one multiple),
        whatever the TP size, so every layout builds the same layer."""
        multiple = self.make_vocab_size_divisible_by
        return -(-max(vocab, 1) // multiple) * multiple

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``kv_channels``, else ``hidden_size / num_attention_heads``)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads


@dataclass
class VisionConfig:
    """ViT encoder + projector of a LLaVA model (ignored by other families)."""

    #: Square input resolution, pixels (what the data pipeline resizes to).
    image_size: int = checked(32, gt=0)
    #: Patch side, pixels. The grid is ``image_size // patch_size`` patches a
    #: side, as HF's stride-``patch_size`` conv computes it: with 384 / 14
    #: (SigLIP-so400m) a 27 x 27 grid whose last 6 pixel rows/columns are unused.
    patch_size: int = checked(8, gt=0)
    #: Transformer layers of the tower (as published; see ``feature_layer`` for how many are built).
    num_layers: int = checked(2, gt=0)
    #: Width of the tower.
    hidden_size: int = checked(64, gt=0)
    #: Attention heads of the tower.
    num_attention_heads: int = checked(4, gt=0)
    #: ViT MLP width; ``None`` = 4 * hidden_size.
    ffn_hidden_size: Optional[int] = checked(None, gt=0)
    #: Hidden width of the 2-layer MLP projector; ``None`` = LM hidden size.
    projector_hidden_size: Optional[int] = checked(None, gt=0)
    #: Tower architecture: ``clip`` (pre-norm ``ln_pre`` after the patch
    #: embedding, bias-free patch conv) or ``siglip`` (patch conv with bias,
    #: no pre-norm, no class token).
    model_type: Literal["clip", "siglip"] = "clip"
    #: Prepend CLIP's class token (OpenAI CLIP towers have one). Its output is
    #: dropped before the projector (LLaVA's ``default`` feature selection).
    class_token: bool = False
    #: MLP activation: ``gelu`` (exact), ``gelu_tanh`` (SigLIP) or ``quick_gelu`` (OpenAI CLIP).
    activation: Literal["gelu", "gelu_tanh", "quick_gelu"] = "gelu"
    #: Epsilon of the tower's norms.
    norm_epsilon: float = checked(1e-5, gt=0)
    #: Which layer's output feeds the projector: -1 the last of ``num_layers``,
    #: -2 the penultimate (LLaVA-1.5), ... Layers after it are not built.
    feature_layer: int = -1
    #: Projector: ``mlp`` (linear, GELU, linear; LLaVA-1.5) or ``linear``.
    projector_type: Literal["mlp", "linear"] = "mlp"
    #: Freeze the ViT (typical for both LLaVA stages with a pretrained encoder).
    freeze: bool = False
    #: Freeze the projector.
    freeze_projector: bool = False
    #: Factor on ``train.lr`` and ``train.min_lr`` for the ViT's parameters
    #: (same warm-up and decay); the projector and LM keep ``train.lr``.
    lr_mult: float = checked(1.0, gt=0)
    #: Images per packed ``model.seq_length`` row that the pipeline cost model
    #: assumes when the training data's ``index.json`` is not on this host or
    #: ``data.path`` is null (the ViT's share of pipeline stage 0 grows with
    #: it; ``data.default_video_fraction`` of them become clips, docs/video.md).
    #: The embedded shapes dataset averages 9.8 at seq_length 256 / 16 tokens per image.
    images_per_sequence: float = checked(9.8, ge=0)
    #: Video frames: each frame's projected features (``grid`` x ``grid``) are
    #: resized bilinearly to ``ceil(grid / video_pool_stride)`` a side before the
    #: LM sees them, as LLaVA-OneVision does with 2 (SigLIP-384: 27 x 27 -> 14 x 14,
    #: 196 tokens a frame); ``1``: every patch feature.
    video_pool_stride: int = checked(2, gt=0)
    #: Append one learned ``image_newline`` embedding (width of the LM) after
    #: each image's features and after each video's frames, as
    #: LLaVA-OneVision lays out multi-image and video inputs; false: LLaVA-1.5
    #: (no such parameter). Not with ``data.image_mode: anyres`` (OneVision's
    #: per-row newlines of unpadded tiles are not built).
    image_newline: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "vision")
        if self.model_type == "siglip" and self.class_token:
            raise ConfigError("vision.class_token", True, "SigLIP towers have no class token; set it to false")
        if not -self.num_layers <= self.feature_layer <= -1:
            raise ConfigError(
                "vision.feature_layer", self.feature_layer,
                f"must be in [-{self.num_layers}, -1] (-1: the last of vision.num_layers={self.num_layers})",
            )
        if self.patch_size > self.image_size:
            raise ConfigError(
                "vision.patch_size", self.patch_size,
                f"must be <= vision.image_size={self.image_size} (the tower needs at least one patch a side)",
            )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "vision.hidden_size",
                self.hidden_size,
                f"must be divisible by vision.num_attention_heads={self.num_attention_heads}",
            )

    @property
    def grid(self) -> int:
        """Patches a side: ``floor(image_size / patch_size)``."""
        return self.image_size // self.patch_size

    @property
    def covered_size(self) -> int:
        """Pixels a side the patches cover (``grid * patch_size`` <= ``image_size``);
        the tower ignores the bottom/right border beyond it."""
        return self.grid * self.patch_size

    @property
    def tokens_per_image(self) -> int:
        """Features of one tower input (an image view or a video frame), before pooling."""
        return self.grid**2

    @property
    def newline_tokens(self) -> int:
        """Tokens the ``image_newline`` adds after each image and each video (0 or 1)."""
        return int(self.image_newline)

    @property
    def frame_grid(self) -> int:
        """Side of one video frame's features after pooling: ``ceil(grid / video_pool_stride)``."""
        return -(-self.grid // self.video_pool_stride)

    @property
    def image_tokens(self) -> int:
        """LM placeholders of one (single-view) image: its features, then the newline if any."""
        return self.tokens_per_image + self.newline_tokens

    def video_tokens(self, frames: int) -> int:
        """LM placeholders of one video of ``frames`` frames: its pooled frames,
        then the newline if any. The one rule the data plan and the model share."""
        return frames * self.frame_grid**2 + self.newline_tokens

    @property
    def layers_built(self) -> int:
        """Tower layers that run: those up to and including ``feature_layer``."""
        return self.num_layers + self.feature_layer + 1

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
    patch_size: int = checked(2, gt=0)
    #: Channels of the training tensor: 3 for RGB pixels, 4 for SD-style VAE latents.
    in_channels: int = checked(3, gt=0)
    #: Aspect-ratio bucket table, ``[height, width]`` pairs; each side a multiple of patch_size.
    buckets: list[list[int]] = field(default_factory=_default_buckets)
    #: Latent tokens per micro-batch ("package"): a bucket of N tokens gets
    #: ``token_budget // N`` images, so small images come in large batches.
    token_budget: int = checked(512, gt=0)
    #: ``learned``: captions are tokenized and embedded by the model;
    #: ``precomputed``: shards carry text-encoder states of width ``text_dim``.
    text_encoder: Literal["learned", "precomputed"] = "learned"
    #: Width of the caption embeddings (``0`` = ``model.hidden_size`` for learned).
    text_dim: int = checked(0, ge=0)
    #: Caption tokens kept (longer captions are truncated), including <bos>.
    max_text_length: int = checked(8, gt=0)
    #: Training timestep distribution: ``logit_normal`` (sigmoid of a normal,
    #: concentrates on mid-noise levels) or ``uniform`` on (0, 1).
    timestep_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    #: Mean of the normal whose sigmoid is the sampled time (``logit_normal`` only).
    logit_mean: float = 0.0
    #: Standard deviation of that normal (``logit_normal`` only).
    logit_std: float = checked(1.0, gt=0)
    #: Probability of training a sample with the empty caption (enables CFG).
    caption_dropout: float = checked(0.1, ge=0, lt=1)
    #: EMA decay of the weights used for sampling; 0 disables EMA.
    ema_decay: float = checked(0.999, ge=0, lt=1, note="(0 disables EMA)")
    #: Euler steps of the ODE sampler.
    sample_steps: int = checked(25, gt=0)
    #: Classifier-free guidance scale (1 = no guidance).
    guidance_scale: float = checked(4.0, ge=0)
    #: Images sampled per colour prompt and resolution in evaluation.
    eval_samples_per_prompt: int = checked(4, gt=0)
    #: ``[height, width]`` resolutions sampled in evaluation. ``[]``: no
    #: evaluation (logged once at start; the tests' way to skip sampling).
    eval_resolutions: list[list[int]] = field(default_factory=lambda: [[16, 16], [16, 32]])

    def __post_init__(self) -> None:
        check_fields(self, "dit")
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
