"""GPT language model on megatron-core: config translation and chunk building."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megascale_omni.config import ModelConfig, MoeConfig, ParallelConfig
from megascale_omni.models.moe import moe_config_kwargs
from megascale_omni.models.specs import gpt_decoder_spec, resolve_layer_impl, te_cp_comm_type
from megascale_omni.parallel.pipeline_plan import megatron_layout


def common_config_kwargs(tp: int, dtype: torch.dtype, init_method_std: float) -> dict:
    """``TransformerConfig`` settings shared by every megatron module we build
    (LM, ViT, projector): TP degree, dtypes, init and loss conventions."""
    return dict(
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        init_method_std=init_method_std,
        # The values are overwritten by the layout-invariant init, but
        # megatron's init functions are also what tag weights with
        # ``tensor_model_parallel``; without the tag the grad norm silently
        # drops TP shards on TP ranks > 0. CPU init slices a full master
        # weight, which is cheap next to the rest of start-up.
        use_cpu_initialization=True,
        perform_initialization=True,
        # Schedules sum token losses; finalize_model_grads divides by the
        # global token count (see transformer_config).
        calculate_per_token_loss=True,
        # gloo has no use for batched p2p and megatron's batched path
        # synchronises CUDA; the unbatched path is correct everywhere.
        batch_p2p_comm=torch.cuda.is_available(),
    )


def recompute_kwargs(recompute: str) -> dict:
    """``TransformerConfig`` recomputation settings of ``model.recompute``.

    ``selective``: megatron checkpoints the core attention of every layer
    (``recompute_modules=["core_attn"]``; ``Attention`` runs it under
    ``tensor_parallel.checkpoint``, which works with the local spec's
    :class:`~megascale_omni.models.attention.PackedCoreAttention` and TE's
    attention alike). ``full``: every layer is one checkpointed unit
    (``uniform`` method, one layer per unit)."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    raise ValueError(f"unknown model.recompute {recompute!r}")


def activation_kwargs(activation: str) -> dict:
    """MLP activation settings of ``TransformerConfig`` for our activation names."""
    if activation == "swiglu":
        # fc1 holds [gate; up]; megatron applies silu(gate) * up.
        return dict(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    if activation == "gelu":
        return dict(activation_func=F.gelu, bias_activation_fusion=False)
    raise ValueError(f"unknown language-model activation {activation!r}")


def rope_kwargs(model: ModelConfig) -> dict:
    """``GPTModel`` rotary-embedding arguments (``model.rotary_base``, ``model.rope_scaling``)."""
    if model.position_embedding_type != "rope":
        return {}
    kwargs: dict = dict(rotary_base=model.rotary_base)
    if model.rope_scaling == "linear":
        kwargs["seq_len_interpolation_factor"] = model.rope_scaling_factor
    elif model.rope_scaling == "llama3":
        kwargs.update(rope_scaling=True, rope_scaling_factor=model.rope_scaling_factor)
    return kwargs


def build_gpt_model(
    model: ModelConfig, config: TransformerConfig, spec, *, vocab_size: int, max_sequence_length: int,
    pre_process: bool, post_process: bool, vp_stage, scatter_embedding: bool = True,
) -> GPTModel:
    """One megatron ``GPTModel`` (a pipeline chunk) with every architecture
    option of ``model`` applied (every rank). ``spec``: the chunk's decoder
    spec (:func:`~megascale_omni.models.specs.gpt_decoder_spec`).
    ``scatter_embedding``: under sequence parallelism the embedding scatters
    its output over TP; False leaves that to the caller (LLaVA splices image
    features into the whole sequence first)."""
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        vp_stage=vp_stage,
        scatter_embedding_sequence_parallel=scatter_embedding,
        **rope_kwargs(model),
    )


def pipeline_kwargs(parallel: ParallelConfig) -> dict:
    """Pipeline degrees and split for megatron. Explicit per-chunk counts
    (``auto`` is resolved to them before start-up) become megatron's
    ``pipeline_model_parallel_layout``; ``uniform`` leaves megatron's even split."""
    partition = parallel.pipeline_partition
    if partition == "auto":
        raise ValueError("parallel.pipeline_partition=auto must be resolved (pipeline_plan.resolve_partition) first")
    kwargs = dict(pipeline_model_parallel_size=parallel.pp, virtual_pipeline_model_parallel_size=parallel.vpp)
    if isinstance(partition, list) and parallel.pp > 1:
        kwargs["pipeline_model_parallel_layout"] = megatron_layout(partition, parallel.pp)
    return kwargs


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    dtype: torch.dtype,
    moe: Optional[MoeConfig] = None,
) -> TransformerConfig:
    """megatron ``TransformerConfig`` for the language model; with ``moe``
    (enabled) its MoE fields too (:func:`~megascale_omni.models.moe.moe_config_kwargs`).

    Per-token loss (``calculate_per_token_loss``) makes the schedules sum
    token losses and divide by the global token count across DP in
    ``finalize_model_grads``,
    so every DP/PP layout optimises exactly the same objective even when
    micro-batches carry different numbers of loss tokens.

    A non-uniform pipeline split reaches megatron as its layout string, so
    megatron numbers the layers globally (``get_transformer_layer_offset``)
    and the layout-invariant init keys stay the same under any split.
    """
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_size,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        **activation_kwargs(model.activation),
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        context_parallel_size=parallel.cp,
        cp_comm_type=te_cp_comm_type(parallel.cp_comm_type),
        hierarchical_context_parallel_sizes=parallel.hierarchical_cp_sizes,
        sequence_parallel=parallel.sequence_parallel,
        **pipeline_kwargs(parallel),
        **recompute_kwargs(model.recompute),
        **common_config_kwargs(parallel.tp, dtype, model.init_method_std),
        **moe_config_kwargs(moe or MoeConfig(), model, parallel, resolve_layer_impl(model.layer_impl)),
    )


def build_gpt_chunks(
    model: ModelConfig,
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
) -> list[GPTModel]:
    """Build this rank's model chunks (every rank; ``vpp`` chunks when interleaved).

    Chunk ``v`` gets ``pre_process``/``post_process`` from its virtual stage,
    so the embedding lives on the first virtual stage of PP rank 0 and the
    output layer on the last virtual stage of the last PP rank.
    """
    impl = resolve_layer_impl(model.layer_impl)
    vpp = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for v in range(vpp):
        vp_stage = v if vpp > 1 else None
        chunks.append(
            build_gpt_model(
                model, config, gpt_decoder_spec(impl, model.normalization, config, vp_stage),
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
            )
        )
    return chunks
