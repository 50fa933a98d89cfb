"""LLaVA on megatron-core: CLIP-style ViT + MLP projector + GPT language model.

We compose megatron's ``CLIPViTModel``, ``MultimodalProjector`` and
``GPTModel`` rather than using ``LLaVAModel`` because our data pipeline
already expands every ``<image>`` into ``tokens_per_image`` placeholder tokens
and packs several samples per sequence. The language sequence length is then
fixed before the model runs, which is what sequence packing (THD segments,
:mod:`megascale_omni.models.attention`) and pipeline p2p shapes need. The
model only has to *overwrite* the placeholder embeddings with projected image
features (and pooled video frame features, with LLaVA-OneVision's
``image_newline`` when ``vision.image_newline``:
:mod:`megascale_omni.models.vision_features`).

Pipeline placement: the ViT and projector live with the embedding on the
first virtual stage of PP rank 0 (``pre_process``); the output layer and loss
on the last virtual stage of the last PP rank (``post_process``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.activations import quick_gelu
from megatron.core.enums import ModelType
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule

from megascale_omni.config import JobConfig
from megascale_omni.models.gpt import build_gpt_model, common_config_kwargs, recompute_kwargs, transformer_config
from megascale_omni.models.specs import gpt_decoder_spec, resolve_layer_impl, vit_layer_spec
from megascale_omni.models.vision_features import image_sequence, video_sequence


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (SigLIP's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


VISION_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": gelu_tanh, "quick_gelu": quick_gelu}


def vision_transformer_config(cfg: JobConfig, dtype: torch.dtype) -> TransformerConfig:
    """ViT config: same TP as the LM, never pipelined (it sits on stage 0).
    Only the layers up to ``vision.feature_layer`` are built."""
    v = cfg.vision
    config = TransformerConfig(
        num_layers=v.layers_built,
        hidden_size=v.hidden_size,
        num_attention_heads=v.num_attention_heads,
        ffn_hidden_size=v.ffn_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=v.norm_epsilon,
        activation_func=VISION_ACTIVATIONS[v.activation],
        bias_activation_fusion=False,
        pipeline_model_parallel_size=1,
        **recompute_kwargs(cfg.model.recompute),
        **common_config_kwargs(cfg.parallel.tp, dtype, cfg.model.init_method_std),
    )
    config.vision_model_type = v.model_type
    return config


def projector_config(cfg: JobConfig, dtype: torch.dtype) -> TransformerConfig:
    """Projector: 2-layer exact-GELU MLP, vision hidden -> projector hidden -> LM
    hidden (``vision.projector_type: mlp``), or one linear layer (``linear``)."""
    v = cfg.vision
    return TransformerConfig(
        num_layers=1,
        hidden_size=cfg.model.hidden_size,
        # Unused by the MLP; must only satisfy TransformerConfig's TP checks.
        num_attention_heads=cfg.model.num_attention_heads,
        ffn_hidden_size=v.projector_hidden_size or cfg.model.hidden_size,
        pipeline_model_parallel_size=1,
        bias_activation_fusion=False,
        **common_config_kwargs(cfg.parallel.tp, dtype, cfg.model.init_method_std),
    )


class VisionTower(CLIPViTModel):
    """megatron's ``CLIPViTModel`` for any ``image_size``, also one that the
    patch size does not divide (SigLIP-so400m: 384 px, 14 px patches).

    megatron asserts ``img_h % patch_dim == 0``; HF's stride-``patch_size``
    conv without padding instead uses a ``floor(image_size / patch_size)``
    grid and never reads the last ``image_size % patch_size`` pixel rows and
    columns. We build megatron's tower for the covered size
    ``vision.covered_size`` and crop that unused bottom/right border off the
    input, which is exactly the set of pixels HF's conv reads, so the weights,
    the position table and the features are HF's. Cropping here (and not in
    the data pipeline) keeps the images at ``vision.image_size``, the size the
    tower's preprocessor config resizes to.

    ``forward`` input: ``[n, 3, image_size, image_size]``; output ``[n, c + grid**2, vh]``.
    """

    def __init__(self, cfg: JobConfig, dtype: torch.dtype, impl: str):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        v = cfg.vision
        super().__init__(
            vision_transformer_config(cfg, dtype),
            vit_layer_spec(impl),
            # The default resolves to TE or torch.nn.LayerNorm, which does
            # not accept megatron's ``config`` argument.
            ln_pre_impl=WrappedTorchNorm,
            ln_post_impl=WrappedTorchNorm,
            add_class_token=v.class_token,
            class_token_len=1 if v.class_token else 0,
            patch_dim=v.patch_size,
            img_h=v.covered_size,
            img_w=v.covered_size,
            model_subtype=v.model_type,
        )
        # LLaVA reads a layer's hidden states, before SigLIP's post-norm
        # (which only feeds SigLIP's pooling head): the norm is not built.
        self.ln_post = None

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(x[..., : self.img_h, : self.img_w], attention_mask)


class LlavaChunk(MegatronModule):
    """One pipeline model chunk of LLaVA (built on every rank).

    ``forward`` inputs (one micro-batch in THD layout, see
    :mod:`megascale_omni.models.attention`):
      tokens, position_ids: ``[1, t]`` int64; image placeholders hold
        ``image_token_id``, video placeholders ``video_token_id``.
      packed_seq_params: THD ``PackedSeqParams``; attention stays inside its segments.
      images: ``[n, 3, H, W]`` float, one row per image in token order; only
        read on the first stage.
      labels: ``[1, t]`` int64 (last stage), or None to return logits ``[1, t, vocab/tp]``.
      image_rows, video_rows: context parallelism only (``t`` is then this CP
        rank's share): the feature row of each local placeholder (:meth:`embed`).
      videos: ``[F, 3, H, W]`` float, every video's frames in token order;
        video_frames: ``[v]`` int64 frames per video (first stage only).
    """

    def __init__(
        self,
        cfg: JobConfig,
        lm_config: TransformerConfig,
        dtype: torch.dtype,
        *,
        vocab_size: int,
        image_token_id: int,
        pre_process: bool,
        post_process: bool,
        vp_stage: Optional[int],
        video_token_id: int = -1,
    ):
        super().__init__(config=lm_config)
        # The schedules look this up on the wrapped model.
        self.model_type = ModelType.encoder_or_decoder
        impl = resolve_layer_impl(cfg.model.layer_impl)
        self.pre_process = pre_process
        self.post_process = post_process
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.vision = cfg.vision
        self.class_tokens = 0
        self.vision_model: Optional[VisionTower] = None
        self.vision_projection: Optional[MultimodalProjector] = None
        self.image_newline: Optional[torch.nn.Parameter] = None
        if pre_process:
            v = cfg.vision
            self.class_tokens = 1 if v.class_token else 0
            self.vision_model = VisionTower(cfg, dtype, impl)
            self.vision_projection = MultimodalProjector(
                projector_config(cfg, dtype),
                MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                projector_type="mlp" if v.projector_type == "mlp" else "affine",
                input_size=v.hidden_size,
            )
            if v.image_newline:
                # Replicated over TP like the position table: every TP rank
                # computes the same gradient (the embedding's, see _scatter).
                self.image_newline = torch.nn.Parameter(
                    torch.zeros(cfg.model.hidden_size, dtype=lm_config.params_dtype))
        self.language_model = build_gpt_model(
            cfg.model, lm_config, gpt_decoder_spec(impl, cfg.model.normalization, lm_config, vp_stage),
            vocab_size=vocab_size,
            max_sequence_length=cfg.model.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            # Image features replace placeholders anywhere in the sequence:
            # embed() splices them into the whole sequence, then scatters it.
            scatter_embedding=False,
        )

    # finalize_model_grads looks these up on the wrapped model to sync tied
    # embeddings and position embeddings across pipeline stages.
    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook: activations from the previous stage go to the LM."""
        self.language_model.set_input_tensor(input_tensor)

    def vision_features(
        self, images: Optional[torch.Tensor], videos: Optional[torch.Tensor], video_frames: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(image sequence ``[n * image_tokens, h]``, video sequence
        ``[sum_v video_tokens(f_v), h]``) (:mod:`~megascale_omni.models.vision_features`):
        images and frames go through the tower and projector together, one
        ``[c + p]``-token sequence each, attended bidirectionally (the spec's
        no_mask), as in CLIP; the class token never reaches the LM."""
        n = 0 if images is None else images.shape[0]
        pixels = torch.cat([x for x in (images, videos) if x is not None and x.shape[0]])
        feats = self.vision_model(pixels, attention_mask=None)[:, self.class_tokens :]  # [n + F, p, vh]
        feats = self.vision_projection(feats.transpose(0, 1).contiguous()).transpose(0, 1)  # [n + F, p, h]
        v = self.vision
        return (image_sequence(feats[:n], self.image_newline),
                video_sequence(feats[n:], video_frames, v.grid, v.frame_grid, self.image_newline))

    def embed(
        self, tokens: torch.Tensor, position_ids: torch.Tensor, images: Optional[torch.Tensor],
        image_rows: Optional[torch.Tensor] = None, videos: Optional[torch.Tensor] = None,
        video_frames: Optional[torch.Tensor] = None, video_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """First stage: token embeddings with image and video features
        written over their placeholder positions. ``tokens``, ``position_ids``:
        ``[b, s]`` (``b = 1`` for THD). Returns ``[s, b, h]``, or under
        sequence parallelism this TP rank's ``[s / tp, b, h]`` slice of it (the
        splice needs the whole sequence, so the scatter comes after it).

        ``image_rows`` / ``video_rows`` (context parallelism): ``tokens`` are
        this CP rank's share and hold only some placeholders; entry ``i`` is
        the row of the image (video) sequence of :meth:`vision_features`, over
        *all* images (videos), that the ``i``-th local placeholder takes."""
        emb = self.language_model.embedding(input_ids=tokens, position_ids=position_ids)  # [s, b, h]
        frames = [] if video_frames is None else [int(f) for f in video_frames]
        n_images = 0 if images is None else images.shape[0]
        slots = {"image": tokens == self.image_token_id,
                 "video": tokens == self.video_token_id if self.video_token_id >= 0 else torch.zeros_like(tokens,
                                                                                                   dtype=torch.bool)}
        want = {"image": n_images * self.vision.image_tokens, "video": sum(map(self.vision.video_tokens, frames))}
        rows = {"image": image_rows, "video": video_rows}
        for kind, mask in slots.items():
            expected = want[kind] if rows[kind] is None else rows[kind].numel()
            if int(mask.sum()) != expected:
                what = (f"{n_images} images x {self.vision.image_tokens} tokens" if kind == "image" else
                        f"{len(frames)} videos of {frames} frames ({want['video']} tokens)")
                raise ValueError(f"micro-batch has {int(mask.sum())} {kind} placeholder tokens but {what}"
                                 + ("" if rows[kind] is None else f" ({expected} on this CP rank)"))
        # Under CP the ViT runs even on a rank holding no placeholder: every rank has the same graph.
        if n_images == 0 and not frames:
            return self._scatter(emb)
        feats = dict(zip(("image", "video"), self.vision_features(images, videos, frames)))
        pos_table = getattr(self.language_model.embedding, "position_embeddings", None)
        emb = emb.transpose(0, 1).clone()  # [b, s, h]
        for kind, mask in slots.items():
            seq = feats[kind] if rows[kind] is None else feats[kind][rows[kind]]  # in token order
            if pos_table is not None:
                # Overwriting the whole embedding would also drop the LM's learned
                # absolute position at image tokens, leaving attention unable to
                # tell one patch slot from another (RoPE models keep position in
                # attention and need nothing here).
                seq = seq + pos_table(position_ids)[mask].to(seq.dtype)
            emb[mask] = seq.to(emb.dtype)  # boolean indexing walks (b, s) row-major
        return self._scatter(emb.transpose(0, 1).contiguous())

    def _scatter(self, emb: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> this TP rank's ``[s / tp, b, h]`` under sequence
        parallelism (backward: the all-gather), else unchanged. Every TP rank
        holds the same ``emb`` (vocab-parallel embedding, all-reduced ViT and
        projector outputs)."""
        if not self.config.sequence_parallel:
            return emb
        return tensor_parallel.scatter_to_sequence_parallel_region(emb)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        packed_seq_params: PackedSeqParams,
        images: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        image_rows: Optional[torch.Tensor] = None,
        videos: Optional[torch.Tensor] = None,
        video_frames: Optional[torch.Tensor] = None,
        video_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        decoder_input = (self.embed(tokens, position_ids, images, image_rows, videos, video_frames, video_rows)
                         if self.pre_process else None)
        return self.language_model(
            tokens, position_ids, None, decoder_input=decoder_input, labels=labels,
            packed_seq_params=packed_seq_params,
        )


def build_llava_chunks(cfg: JobConfig, dtype: torch.dtype, vocab_size: int, image_token_id: int,
                       video_token_id: int = -1) -> list[LlavaChunk]:
    """This rank's LLaVA chunks (every rank), with freezing applied
    (``video_token_id`` -1: the vocabulary has none, no video placeholders)."""
    lm_config = transformer_config(cfg.model, cfg.parallel, dtype, cfg.moe)
    vpp = cfg.parallel.vpp or 1
    chunks = []
    for v in range(vpp):
        vp_stage = v if vpp > 1 else None
        chunk = LlavaChunk(
            cfg,
            lm_config,
            dtype,
            vocab_size=vocab_size,
            image_token_id=image_token_id,
            video_token_id=video_token_id,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        apply_freezing(chunk, cfg)
        chunks.append(chunk)
    return chunks


def apply_freezing(chunk: LlavaChunk, cfg: JobConfig) -> None:
    """Stage-1 (projector only) / stage-2 (projector + LM) training via requires_grad."""
    if cfg.model.freeze:
        for p in chunk.language_model.parameters():
            p.requires_grad_(False)
    if chunk.vision_model is not None and cfg.vision.freeze:
        for p in chunk.vision_model.parameters():
            p.requires_grad_(False)
    if chunk.vision_projection is not None and cfg.vision.freeze_projector:
        for p in chunk.vision_projection.parameters():
            p.requires_grad_(False)
        if chunk.image_newline is not None:  # it enters the LM beside the projector's output
            chunk.image_newline.requires_grad_(False)
