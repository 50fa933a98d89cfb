"""The DiT model chunk of one pipeline stage.

Data flow of one micro-batch (one bucket, ``B`` images of ``C x H x W``,
``N = (H/p)(W/p)`` tokens, captions of ``L`` tokens)::

    stage 0:   x_t --patchify--> [N, B, C p p] --linear--> + 2-D sin-cos positions  -> x   [N, B, h]
               caption --embed/project-------------------------------------------->  ctx [L, B, h]
               t --sin features--> MLP  +  MLP(mean of ctx over real tokens)        -> c   [B, h]
    blocks:    x = DiTLayer(x, c, ctx)   (adaLN-Zero from c, cross-attention to ctx)
    last:      x --adaLN(c)--> zero-init linear --unpatchify--> velocity [B, C, H, W]

Pipeline parallelism: the condition ``c`` and caption states ``ctx`` are made
once, on stage 0, by trainable modules, but every block needs them. They
travel with the image tokens in the one tensor megatron's schedules pass
between stages, ``[N + L + 1, B, h] = cat(x, ctx, c)``; the backward pass
carries their gradients back to stage 0 the same way. Shapes differ per
bucket, hence ``variable_seq_lengths``. (megatron's alternative for
diffusion models - a copy of the condition embedders on every stage with
``has_cond_embedder`` grad all-reduce - counts those weights once per stage
in the gradient norm, so clipping, and thus training, would depend on the
pipeline split.)

Stage ``r`` holds the blocks ``[first, first + count)`` of
:func:`stage_layers`: ``parallel.pipeline_partition`` after
``resolve_partition`` (explicit counts, or ``uniform``: an even split).
Blocks keep their global index, so parameter keys, the layout-invariant
init and checkpoints are the same under any split.

Context parallelism (``parallel.cp > 1``, :mod:`megascale_omni.models.dit.context`):
each CP rank holds ``N / cp`` tokens of every image (load-balanced split).
Stage 0 patchifies the whole image and embeds only its local patches (with
their 2-D positions); the pipeline tensor is ``[N / cp + L + 1, B, h] =
cat(x_local, ctx, c)``; caption and condition stay whole on every CP rank.
Self-attention runs as ring attention over the CP group, cross-attention
takes the local queries against the full caption without communication.
The last stage returns the error of its local tokens, or gathers the
velocity of all tokens over the CP group (sampling).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch
from megatron.core import parallel_state as mpu
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from megascale_omni.config import JobConfig
from megascale_omni.models.dit.context import gather_image_tokens, image_token_index
from megascale_omni.models.dit.embed import patchify, sincos_2d, timestep_features, unpatchify
from megascale_omni.models.dit.layer import (
    DiTLayerStack,
    layer_norm,
    mark_zero_init,
    modulate,
    modulation_linear,
)
from megascale_omni.models.gpt import common_config_kwargs
from megascale_omni.models.specs import dit_layer_specs, resolve_layer_impl, te_cp_comm_type

# TIME_FEATURES, the width of the sinusoidal timestep features fed to the
# timestep MLP, is defined beside the cost model, which counts that MLP.
from megascale_omni.parallel.pipeline_cost_dit import TIME_FEATURES

logger = logging.getLogger(__name__)


def stage_layers(num_layers: int, pp: int, partition: Union[str, Sequence[int]], rank: int) -> tuple[int, int]:
    """``(first global block index, block count)`` of pp rank ``rank``:
    ``partition`` is per-stage counts (one per pp rank) or ``"uniform"``
    (``num_layers // pp`` each). ``"auto"`` must be resolved first."""
    if partition == "uniform":
        counts = [num_layers // pp] * pp
    elif isinstance(partition, str):
        raise ValueError(f"parallel.pipeline_partition={partition!r} must be resolved to counts (resolve_partition)")
    else:
        counts = list(partition)
    if len(counts) != pp or sum(counts) != num_layers:
        raise ValueError(f"partition {counts} is not {num_layers} layers over pp={pp} stages")
    return sum(counts[:rank]), counts[rank]


def dit_transformer_config(cfg: JobConfig, dtype: torch.dtype) -> TransformerConfig:
    """megatron config of the DiT blocks; shapes vary per bucket across stages."""
    m, par = cfg.model, cfg.parallel
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=True,
        bias_activation_fusion=False,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        cp_comm_type=te_cp_comm_type(par.cp_comm_type),
        hierarchical_context_parallel_sizes=par.hierarchical_cp_sizes,
        variable_seq_lengths=True,
        # No MoE here; megatron rejects variable_seq_lengths with the default
        # (allgather) dispatcher even when it is unused.
        moe_token_dispatcher_type="alltoall",
        **common_config_kwargs(cfg.parallel.tp, dtype, m.init_method_std),
    )


class DiTChunk(MegatronModule):
    """One pipeline stage of the DiT (built on every rank).

    ``forward(x_t [B, C, H, W], t [B], text, text_mask [B, L] bool (True =
    real token), target=None)``; ``text`` is token ids ``[B, L]`` (learned
    text encoder) or states ``[B, L, text_dim]`` (precomputed). Every stage
    receives the whole micro-batch (it reads shapes and masks from it).

    Returns, on the last stage, per-token squared error ``[B, N]`` (mean over
    the ``C p p`` values of a token) when ``target`` is given, else the
    predicted velocity ``[B, C, H, W]``; on other stages the pipeline tensor.

    Under context parallelism every CP rank receives the whole micro-batch
    too; the error is then ``[B, N / cp]``, over this rank's tokens in the
    order of :func:`~megascale_omni.models.dit.context.image_token_index`,
    and the velocity (gathered over the CP group, no gradient) is whole.
    """

    def __init__(
        self, cfg: JobConfig, config: TransformerConfig, *, text_vocab_size: int, pre_process: bool, post_process: bool
    ):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        # Looked up by finalize_model_grads; nothing is tied across stages.
        self.share_embeddings_and_output_weights = False
        self.pre_process, self.post_process = pre_process, post_process
        d, h = cfg.dit, config.hidden_size
        self.patch, self.channels = d.patch_size, d.in_channels
        self.cp = config.context_parallel_size
        patch_dim = d.in_channels * d.patch_size**2
        self.input_tensor: Optional[torch.Tensor] = None
        if pre_process:
            self.x_embedder = _linear(config, patch_dim, h)
            mlp = dit_layer_specs("local")[2]
            self.t_embedder = build_module(mlp, config=config, input_size=TIME_FEATURES)
            text_dim = d.text_dim or h
            self.text_embedding = (
                VocabParallelEmbedding(text_vocab_size, text_dim, init_method=config.init_method, config=config)
                if d.text_encoder == "learned"
                else None
            )
            self.text_proj = _linear(config, text_dim, h)
            self.pooled_embedder = build_module(mlp, config=config, input_size=h)
        impl = resolve_layer_impl(cfg.model.layer_impl)
        rank = mpu.get_pipeline_model_parallel_rank()
        first, count = stage_layers(config.num_layers, cfg.parallel.pp, cfg.parallel.pipeline_partition, rank)
        logger.info("DiT stage %d: layers [%d, %d)", rank, first, first + count)
        self.layers = DiTLayerStack(config, dit_layer_specs(impl, context_parallel=self.cp > 1), first, count)
        if post_process:
            self.final_adaln = modulation_linear(config, h, 2 * h)
            self.final_linear = _linear(config, h, patch_dim)
            mark_zero_init(self.final_adaln)
            mark_zero_init(self.final_linear)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook: the previous stage's ``cat(x, ctx, c)``."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def embed(
        self, x_t: torch.Tensor, t: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor,
        index: Optional[torch.Tensor] = None,
    ):
        """Stage 0: ``(x [N, B, h], ctx [L, B, h], c [B, h])``; with ``index``
        (context parallelism; int64 on the host, where the position table is
        built) ``x`` holds only those tokens, ``[len(index), B, h]``."""
        _, _, height, width = x_t.shape
        patches = patchify(x_t, self.patch)  # [N, B, C p p]
        pos = sincos_2d(height // self.patch, width // self.patch, self.config.hidden_size)
        if index is not None:
            # The embedding is per token: embedding only the local patches
            # gives the same tokens for 1/cp of the work.
            patches, pos = patches[index.to(patches.device)], pos[index]
        x, _ = self.x_embedder(patches)
        x = x + pos.to(device=x.device, dtype=x.dtype)[:, None, :]
        emb = self.text_embedding(text) if self.text_embedding is not None else text.to(x.dtype)  # [B, L, D]
        ctx, _ = self.text_proj(emb.transpose(0, 1).contiguous())  # [L, B, h]
        keep = text_mask.transpose(0, 1).unsqueeze(-1).to(ctx.dtype)  # [L, B, 1]
        pooled = (ctx * keep).sum(0) / keep.sum(0).clamp(min=1.0)  # [B, h]
        c_t, b_t = self.t_embedder(timestep_features(t, TIME_FEATURES).to(x.dtype).unsqueeze(0))
        c_p, b_p = self.pooled_embedder(pooled.unsqueeze(0))
        c = (c_t + b_t + c_p + b_p).squeeze(0)
        return x, ctx, c

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        target: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        _, _, height, width = x_t.shape
        n = (height // self.patch) * (width // self.patch)
        index = None
        if self.cp > 1:
            # On the host: reading a device index back for the position table would wait for the GPU.
            index = image_token_index(n, self.cp, mpu.get_context_parallel_rank())
        local = n if index is None else index.numel()
        if self.pre_process:
            x, ctx, c = self.embed(x_t, t, text, text_mask, index)
        else:
            hidden = self.input_tensor
            x, ctx, c = hidden[:local], hidden[local:-1], hidden[-1]
        context_mask = ~text_mask[:, None, None, :]  # [B, 1, 1, L], True = masked
        x = self.layers(x, c, ctx, context_mask)
        if not self.post_process:
            return torch.cat([x, ctx, c.unsqueeze(0)], dim=0)
        shift, scale = self.final_adaln(torch.nn.functional.silu(c).unsqueeze(0))[0].chunk(2, dim=-1)
        out, _ = self.final_linear(modulate(layer_norm(x), shift, scale))  # [N / cp, B, C p p]
        if target is None:
            if index is not None:
                out = gather_image_tokens(out, n, mpu.get_context_parallel_group())
            return unpatchify(out, self.patch, height, width, self.channels)
        goal = patchify(target, self.patch)
        if index is not None:
            goal = goal[index.to(goal.device)]
        err = (out.float() - goal.float()) ** 2
        return err.mean(-1).transpose(0, 1).contiguous()  # [B, N / cp]


def _linear(config: TransformerConfig, in_size: int, out_size: int) -> ColumnParallelLinear:
    """TP-sharded linear gathered to the full output (small projections at the model's edges)."""
    return ColumnParallelLinear(
        in_size, out_size, config=config, init_method=config.init_method, gather_output=True, bias=True
    )


def build_dit_chunks(cfg: JobConfig, dtype: torch.dtype, text_vocab_size: int) -> list[DiTChunk]:
    """This rank's DiT chunk (every rank; one chunk, no interleaving)."""
    config = dit_transformer_config(cfg, dtype)
    return [
        DiTChunk(
            cfg,
            config,
            text_vocab_size=text_vocab_size,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=True),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=True),
        )
    ]
