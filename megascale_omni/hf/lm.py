"""Hugging Face Llama / Qwen2 / Mistral decoders, and the MoE ones of
:mod:`.moe` (Mixtral, Qwen2-MoE, Qwen3-MoE), <-> our ``model`` (and ``moe``)
sections and megatron ``GPTModel`` weights.

Weight names on our side are those of a one-process (TP1, PP1) megatron
module's ``state_dict``; resharding to any layout is dist_checkpointing's job.
megatron fuses Q, K and V into one ``linear_qkv`` whose rows go group by
group (the group's query heads, then its key head, then its value head), and
SwiGLU's gate and up projections into one ``linear_fc1`` as ``[gate; up]``.
The vocabulary is padded to ``make_vocab_size_divisible_by`` with zero rows
on import and cut back on export.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megascale_omni.config import ModelConfig, MoeConfig
from megascale_omni.config.errors import ConfigError
from megascale_omni.hf import moe as hf_moe

#: HF ``model_type`` of the decoders we map, with their causal-LM class.
LM_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                    **hf_moe.MOE_ARCHITECTURES}

#: Llama-3.1 rope scaling constants that megatron's ``rope_scaling`` hard-codes.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_settings(tc: dict, field: str) -> tuple[float, str, float]:
    """``(rotary_base, rope_scaling, rope_scaling_factor)`` from an HF text
    config, in transformers 4 (``rope_theta`` + ``rope_scaling``) or 5
    (``rope_parameters``) form."""
    params = tc.get("rope_parameters") or {}
    scaling = dict(tc.get("rope_scaling") or {})
    if params.get("rope_type", "default") != "default":
        scaling = params
    theta = float(params.get("rope_theta", tc.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, "none", 1.0
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return theta, "linear", factor
    if kind == "llama3":
        for key, fixed in _LLAMA3_FIXED.items():
            if float(scaling.get(key, fixed)) != fixed:
                raise ConfigError(f"{field}: rope_scaling.{key}", scaling.get(key),
                                   f"megatron's llama3 rope scaling fixes it at {fixed}; this model cannot be mapped")
        return theta, "llama3", factor
    raise ConfigError(f"{field}: rope_scaling.rope_type", kind, "we map default, linear and llama3 rope scaling only")


def model_section(tc: dict, seq_length: int, field: str) -> dict:
    """Our ``model`` section (as a dict) for an HF decoder config ``tc``."""
    model_type = tc.get("model_type")
    if model_type not in LM_ARCHITECTURES:
        why = f"{hf_moe.REFUSED[model_type]}; " if model_type in hf_moe.REFUSED else ""
        raise ConfigError(f"{field}: model_type", model_type,
                           f"{why}supported language models: {', '.join(LM_ARCHITECTURES)}")
    if tc.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{field}: hidden_act", tc.get("hidden_act"), "only SwiGLU (silu) decoders are mapped")
    hidden, heads = int(tc["hidden_size"]), int(tc["num_attention_heads"])
    groups = int(tc.get("num_key_value_heads") or heads)
    head_dim = int(tc.get("head_dim") or hidden // heads)
    if model_type in ("qwen2", "qwen2_moe", "qwen3_moe") and tc.get("use_sliding_window"):
        raise ConfigError(f"{field}: use_sliding_window", True, "sliding-window attention is not implemented")
    if model_type in ("qwen2", "qwen2_moe"):
        add_bias_linear, add_qkv_bias = False, bool(tc.get("qkv_bias", True))
    elif model_type == "qwen3_moe":
        if tc.get("attention_bias"):
            raise ConfigError(f"{field}: attention_bias", True, "MoE models here have no linear biases "
                              "(megatron 0.16.1's expert MLP cannot train with them); we map attention_bias: false")
        add_bias_linear, add_qkv_bias = False, False
    else:
        attention_bias, mlp_bias = bool(tc.get("attention_bias", False)), bool(tc.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            raise ConfigError(f"{field}: attention_bias", attention_bias,
                               f"with mlp_bias={mlp_bias}: we map biases on all linears or on none")
        add_bias_linear, add_qkv_bias = attention_bias, False
    window = tc.get("sliding_window")
    if model_type in ("mistral", "mixtral") and window is not None and window < seq_length:
        raise ConfigError(f"{field}: sliding_window", window,
                           f"is shorter than --seq-length {seq_length}; sliding-window attention is not "
                           f"implemented, so use --seq-length <= {window}")
    rotary_base, rope_scaling, rope_factor = rope_settings(tc, field)
    return dict(
        num_layers=int(tc["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=None if groups == heads else groups,
        kv_channels=None if head_dim * heads == hidden else head_dim,
        ffn_hidden_size=int(tc["intermediate_size"]),
        vocab_size=int(tc["vocab_size"]),
        seq_length=seq_length,
        position_embedding_type="rope",
        normalization="RMSNorm",
        norm_epsilon=float(tc.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_qkv_bias,
        rotary_base=rotary_base,
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_factor,
        share_embeddings_and_output_weights=bool(tc.get("tie_word_embeddings", False)),
        qk_layernorm=model_type == "qwen3_moe",
    )


def text_sections(tc: dict, seq_length: int, field: str, family: str) -> dict:
    """Our ``model`` section (``family``), plus ``moe`` for an MoE decoder, of HF config ``tc``."""
    sections = {"model": {"family": family, **model_section(tc, seq_length, field)}}
    if hf_moe.is_moe(tc.get("model_type")):
        sections["moe"] = hf_moe.moe_section(tc, field)
    return sections


def hf_text_config(m: ModelConfig, base: Optional[dict] = None, moe: Optional[MoeConfig] = None) -> dict:
    """An HF decoder config for ``m`` (Qwen2 when it has QKV-only biases,
    else Llama; with ``moe`` enabled the MoE class of
    :func:`.moe.hf_moe_config`), over ``base`` (the config recorded at
    import) if given."""
    field = "model"
    if m.activation != "swiglu" or m.normalization != "RMSNorm" or m.position_embedding_type != "rope":
        raise ConfigError(f"{field}.activation", m.activation,
                          "only RMSNorm + SwiGLU + RoPE decoders export to Hugging Face Llama/Qwen2 "
                          f"(this one: {m.normalization}, {m.activation}, {m.position_embedding_type})")
    moe_fields = hf_moe.hf_moe_config(moe, m, (base or {}).get("model_type")) if moe and moe.enabled else {}
    qwen = m.add_qkv_bias and not m.add_bias_linear
    model_type = "qwen2" if qwen else (base or {}).get("model_type", "llama")
    if (model_type == "qwen2" and not qwen) or hf_moe.is_moe(model_type):
        model_type = "llama"
    if m.qk_layernorm and not moe_fields:
        raise ConfigError(f"{field}.qk_layernorm", True, "only Qwen3-MoE carries q/k norms among the Hugging Face "
                          "classes we export; a dense model with them has no export")
    rope: dict = {"rope_theta": m.rotary_base, "rope_type": "default"}
    if m.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=m.rope_scaling_factor)
    elif m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=m.rope_scaling_factor, **_LLAMA3_FIXED)
    cfg = {k: v for k, v in (base or {}).items() if k not in ("rope_theta", "rope_scaling", "architectures")}
    cfg.update(
        model_type=model_type,
        architectures=[LM_ARCHITECTURES[model_type]],
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.query_groups,
        head_dim=m.head_dim,
        hidden_act="silu",
        rms_norm_eps=m.norm_epsilon,
        rope_parameters=rope,
        tie_word_embeddings=m.share_embeddings_and_output_weights,
        max_position_embeddings=max(int(cfg.get("max_position_embeddings", 0)), m.seq_length),
    )
    if moe_fields:
        cfg.update(moe_fields)
    elif model_type != "qwen2":
        cfg.update(attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear)
    return cfg


# ------------------------------------------------------------------ weights
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """HF separate Q/K/V (weights ``[rows, in]`` or biases ``[rows]``) ->
    megatron's grouped ``linear_qkv`` layout."""
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, -1, *rest)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    rest = qkv.shape[1:]
    per_group = heads // groups
    grouped = qkv.reshape(groups, per_group + 2, -1, *rest)
    q = grouped[:, :per_group].reshape(-1, *rest)
    k = grouped[:, per_group].reshape(-1, *rest)
    v = grouped[:, per_group + 1].reshape(-1, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _moe_layers(m: ModelConfig, moe: Optional[MoeConfig]) -> list[int]:
    """1 per MoE layer, 0 per dense one."""
    return moe.layer_pattern(m.num_layers) if moe is not None and moe.enabled else [0] * m.num_layers


def weights_from_hf(
    get: Callable[[str], torch.Tensor], m: ModelConfig, padded_vocab: int, body: str, head: Optional[str], out: str,
    moe: Optional[MoeConfig] = None, model_type: str = "",
) -> dict[str, torch.Tensor]:
    """Megatron state (names prefixed ``out``) from HF tensors fetched by
    ``get(name)``; ``body`` prefixes the decoder (``model.``), ``head`` names
    the untied output matrix (None when tied). With ``moe`` enabled, its
    MoE layers come from the experts of HF ``model_type`` (:mod:`.moe`)."""
    heads, groups = m.num_attention_heads, m.query_groups
    routed = _moe_layers(m, moe)
    state = {f"{out}embedding.word_embeddings.weight": _pad_rows(get(f"{body}embed_tokens.weight"), padded_vocab)}
    for i in range(m.num_layers):
        hf, ours = f"{body}layers.{i}.", f"{out}decoder.layers.{i}."
        attn = {p: get(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"}
        state[f"{ours}input_layernorm.weight"] = get(f"{hf}input_layernorm.weight")
        state[f"{ours}self_attention.linear_qkv.weight"] = fuse_qkv(attn["q"], attn["k"], attn["v"], heads, groups)
        state[f"{ours}self_attention.linear_proj.weight"] = get(f"{hf}self_attn.o_proj.weight")
        if m.add_bias_linear or m.add_qkv_bias:
            b = {p: get(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"}
            state[f"{ours}self_attention.linear_qkv.bias"] = fuse_qkv(b["q"], b["k"], b["v"], heads, groups)
        if m.qk_layernorm:
            state[f"{ours}self_attention.q_layernorm.weight"] = get(f"{hf}self_attn.q_norm.weight")
            state[f"{ours}self_attention.k_layernorm.weight"] = get(f"{hf}self_attn.k_norm.weight")
        state[f"{ours}pre_mlp_layernorm.weight"] = get(f"{hf}post_attention_layernorm.weight")
        if routed[i]:
            state.update(hf_moe.moe_mlp_from_hf(get, moe, model_type, hf, ours))
        else:
            state[f"{ours}mlp.linear_fc1.weight"] = torch.cat(
                [get(f"{hf}mlp.gate_proj.weight"), get(f"{hf}mlp.up_proj.weight")]
            )
            state[f"{ours}mlp.linear_fc2.weight"] = get(f"{hf}mlp.down_proj.weight")
        if m.add_bias_linear:
            state[f"{ours}self_attention.linear_proj.bias"] = get(f"{hf}self_attn.o_proj.bias")
            state[f"{ours}mlp.linear_fc1.bias"] = torch.cat([get(f"{hf}mlp.gate_proj.bias"), get(f"{hf}mlp.up_proj.bias")])
            state[f"{ours}mlp.linear_fc2.bias"] = get(f"{hf}mlp.down_proj.bias")
    state[f"{out}decoder.final_layernorm.weight"] = get(f"{body}norm.weight")
    if head is not None:
        state[f"{out}output_layer.weight"] = _pad_rows(get(head), padded_vocab)
    _check_shapes(state, m, padded_vocab, out, moe)
    return state


def expected_shapes(m: ModelConfig, padded_vocab: int, out: str, moe: Optional[MoeConfig] = None
                    ) -> dict[str, tuple[int, ...]]:
    """Shapes :func:`weights_from_hf` must produce (our side, TP1)."""
    h, d = m.hidden_size, m.head_dim
    routed = _moe_layers(m, moe)
    qkv_rows = (m.num_attention_heads + 2 * m.query_groups) * d
    shapes = {f"{out}embedding.word_embeddings.weight": (padded_vocab, h), f"{out}decoder.final_layernorm.weight": (h,)}
    for i in range(m.num_layers):
        p = f"{out}decoder.layers.{i}."
        shapes.update({
            f"{p}input_layernorm.weight": (h,), f"{p}pre_mlp_layernorm.weight": (h,),
            f"{p}self_attention.linear_qkv.weight": (qkv_rows, h),
            f"{p}self_attention.linear_proj.weight": (h, m.num_attention_heads * d),
        })
        if m.qk_layernorm:
            shapes.update({f"{p}self_attention.q_layernorm.weight": (d,),
                           f"{p}self_attention.k_layernorm.weight": (d,)})
        if routed[i]:
            shapes.update(hf_moe.moe_mlp_shapes(moe, m, p))
        else:
            shapes.update({f"{p}mlp.linear_fc1.weight": (2 * m.ffn_size, h),
                           f"{p}mlp.linear_fc2.weight": (h, m.ffn_size)})
        if m.add_bias_linear or m.add_qkv_bias:
            shapes[f"{p}self_attention.linear_qkv.bias"] = (qkv_rows,)
        if m.add_bias_linear:
            shapes.update({f"{p}self_attention.linear_proj.bias": (h,), f"{p}mlp.linear_fc1.bias": (2 * m.ffn_size,),
                           f"{p}mlp.linear_fc2.bias": (h,)})
    if not m.share_embeddings_and_output_weights:
        shapes[f"{out}output_layer.weight"] = (padded_vocab, h)
    return shapes


def _check_shapes(state: dict[str, torch.Tensor], m: ModelConfig, padded_vocab: int, out: str,
                  moe: Optional[MoeConfig]) -> None:
    from megascale_omni.checkpoint.errors import CheckpointError

    for name, shape in expected_shapes(m, padded_vocab, out, moe).items():
        got = tuple(state[name].shape)
        if got != shape:
            raise CheckpointError(f"weights do not match config.json: {name} built from the HF tensors has shape "
                                  f"{got}, the config implies {shape}")


def weights_to_hf(state: dict[str, torch.Tensor], m: ModelConfig, vocab: int, body: str, head: str, src: str,
                  moe: Optional[MoeConfig] = None, model_type: str = "") -> dict[str, torch.Tensor]:
    """Inverse of :func:`weights_from_hf`: HF tensors (names prefixed
    ``body``; ``head`` for the output matrix unless tied) from our state
    (names prefixed ``src``), the vocabulary cut to ``vocab`` rows; MoE
    layers named as HF ``model_type`` names its experts."""
    heads, groups = m.num_attention_heads, m.query_groups
    routed = _moe_layers(m, moe)
    out = {f"{body}embed_tokens.weight": state[f"{src}embedding.word_embeddings.weight"][:vocab]}
    for i in range(m.num_layers):
        hf, ours = f"{body}layers.{i}.", f"{src}decoder.layers.{i}."
        q, k, v = split_qkv(state[f"{ours}self_attention.linear_qkv.weight"], heads, groups)
        out.update({
            f"{hf}input_layernorm.weight": state[f"{ours}input_layernorm.weight"],
            f"{hf}self_attn.q_proj.weight": q, f"{hf}self_attn.k_proj.weight": k, f"{hf}self_attn.v_proj.weight": v,
            f"{hf}self_attn.o_proj.weight": state[f"{ours}self_attention.linear_proj.weight"],
            f"{hf}post_attention_layernorm.weight": state[f"{ours}pre_mlp_layernorm.weight"],
        })
        if m.qk_layernorm:
            out[f"{hf}self_attn.q_norm.weight"] = state[f"{ours}self_attention.q_layernorm.weight"]
            out[f"{hf}self_attn.k_norm.weight"] = state[f"{ours}self_attention.k_layernorm.weight"]
        if routed[i]:
            out.update(hf_moe.moe_mlp_to_hf(state, moe, model_type, hf, ours))
        else:
            out[f"{hf}mlp.gate_proj.weight"], out[f"{hf}mlp.up_proj.weight"] = (
                state[f"{ours}mlp.linear_fc1.weight"].chunk(2))
            out[f"{hf}mlp.down_proj.weight"] = state[f"{ours}mlp.linear_fc2.weight"]
        if m.add_bias_linear or m.add_qkv_bias:
            qb, kb, vb = split_qkv(state[f"{ours}self_attention.linear_qkv.bias"], heads, groups)
            out.update({f"{hf}self_attn.q_proj.bias": qb, f"{hf}self_attn.k_proj.bias": kb,
                        f"{hf}self_attn.v_proj.bias": vb})
        if m.add_bias_linear:
            gb, ub = state[f"{ours}mlp.linear_fc1.bias"].chunk(2)
            out.update({f"{hf}self_attn.o_proj.bias": state[f"{ours}self_attention.linear_proj.bias"],
                        f"{hf}mlp.gate_proj.bias": gb, f"{hf}mlp.up_proj.bias": ub,
                        f"{hf}mlp.down_proj.bias": state[f"{ours}mlp.linear_fc2.bias"]})
    out[f"{body}norm.weight"] = state[f"{src}decoder.final_layernorm.weight"]
    if not m.share_embeddings_and_output_weights:
        out[head] = state[f"{src}output_layer.weight"][:vocab]
    return {k: v.contiguous() for k, v in out.items()}
