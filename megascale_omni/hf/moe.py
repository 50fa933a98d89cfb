"""Hugging Face Mixture-of-Experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE)
<-> our ``moe`` section and megatron's ``MoELayer`` weights.

Routing. Every family scores experts with a softmax over the router logits
and keeps the top k; they differ in what multiplies the experts' outputs:

- Mixtral, and Qwen with ``norm_topk_prob: true``: the k probabilities
  renormalised to sum 1, which is a softmax over the k selected logits:
  megatron's ``moe_router_pre_softmax: false`` (``moe.pre_softmax: false``).
- Qwen with ``norm_topk_prob: false``: the raw probabilities of the softmax
  over all experts: ``moe_router_pre_softmax: true``.

Both pick the same k experts (softmax is monotonic), so megatron's router
reproduces each family exactly up to float rounding (docs/moe.md has the
table and what is refused).

Weights. ``save_pretrained`` writes one tensor per expert (transformers 5
fuses them in memory and splits them again on save, as the published
checkpoints are):

- Mixtral: ``block_sparse_moe.gate`` (router), ``experts.E.w1`` (gate),
  ``w3`` (up), ``w2`` (down);
- Qwen2/3-MoE: ``mlp.gate`` (router), ``mlp.experts.E.{gate,up,down}_proj``,
  Qwen2-MoE also ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``.

Megatron's ``SequentialMLP`` names expert ``E`` ``experts.local_experts.E``
with ``linear_fc1 = [gate; up]``; its shared experts are
``shared_experts.linear_fc1/linear_fc2`` and ``shared_experts.gate_weight``
(``[1, hidden]``, the same ``sigmoid(x w^T)`` as Qwen2-MoE's gate).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megascale_omni.config import ModelConfig, MoeConfig
from megascale_omni.config.errors import ConfigError

#: HF ``model_type`` of the MoE decoders we map, with their causal-LM class.
MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM"}

#: HF MoE decoders we know and refuse, with the reason.
REFUSED = {
    "olmoe": "OLMoE's q_norm/k_norm normalise all heads together (megatron's qk_layernorm is per head)",
    "deepseek_v2": "DeepSeek's multi-latent attention and grouped routing are not mapped",
    "deepseek_v3": "DeepSeek's multi-latent attention and grouped routing are not mapped",
}


def is_moe(model_type: Optional[str]) -> bool:
    return model_type in MOE_ARCHITECTURES


def _num_experts(tc: dict) -> int:
    # transformers 5 stores Mixtral's and Qwen3-MoE's count as num_local_experts, Qwen2-MoE's as num_experts.
    return int(tc.get("num_local_experts") or tc.get("num_experts") or 0)


def layer_pattern(tc: dict) -> list[int]:
    """1 (MoE) / 0 (dense) per layer as HF builds them: Mixtral every layer;
    Qwen layer ``i`` unless in ``mlp_only_layers`` or ``(i + 1) %
    decoder_sparse_step != 0``."""
    layers = int(tc["num_hidden_layers"])
    if tc["model_type"] == "mixtral":
        return [1] * layers
    step, dense = int(tc.get("decoder_sparse_step") or 1), set(tc.get("mlp_only_layers") or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def moe_section(tc: dict, field: str) -> dict:
    """Our ``moe`` section (as a dict) for an HF MoE decoder config ``tc``
    (completed with its defaults). Raises ConfigError naming the first field
    we do not map, so nothing is imported in part."""
    model_type = tc["model_type"]
    experts = _num_experts(tc)
    if experts <= 0:
        raise ConfigError(f"{field}: num_experts", experts, "an MoE config needs experts; import it as a dense model")
    if float(tc.get("router_jitter_noise") or 0.0) != 0.0:
        raise ConfigError(f"{field}: router_jitter_noise", tc["router_jitter_noise"],
                          "megatron's router has no multiplicative jitter; set it to 0.0 in config.json to import")
    pattern = layer_pattern(tc)
    if not any(pattern):
        raise ConfigError(f"{field}: mlp_only_layers", tc.get("mlp_only_layers"),
                          "leaves no MoE layer; import it as a dense model")
    aux = float(tc.get("router_aux_loss_coef") or 0.0)
    section = dict(
        num_experts=experts,
        topk=int(tc["num_experts_per_tok"]),
        ffn_hidden_size=int(tc["intermediate_size"] if model_type == "mixtral" else tc["moe_intermediate_size"]),
        # Mixtral always renormalises the top-k probabilities.
        pre_softmax=model_type != "mixtral" and not tc.get("norm_topk_prob", False),
        load_balancing="aux_loss" if aux > 0 else "none",
        aux_loss_coeff=aux,
        layer_freq=1 if all(pattern) else pattern,
    )
    if model_type == "qwen2_moe":
        shared = int(tc.get("shared_expert_intermediate_size") or 0)
        if shared <= 0:
            raise ConfigError(f"{field}: shared_expert_intermediate_size", shared,
                              "Qwen2-MoE always has a gated shared expert; we map widths > 0 only")
        section.update(shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
    return section


def hf_moe_config(moe: MoeConfig, m: ModelConfig, base_type: Optional[str], field: str = "moe") -> dict:
    """The HF config fields (``model_type`` included) of our MoE decoder:
    ``base_type`` (the imported family) when it expresses the model, else
    the first of Qwen2-MoE (shared expert), Qwen3-MoE (q/k norms), Mixtral
    that does. Raises ConfigError when no HF MoE class computes what ours does."""
    for name, value, why in (
        ("score_function", moe.score_function, moe.score_function != "softmax"),
        ("expert_bias", moe.expert_bias, moe.expert_bias),
        ("topk_scaling_factor", moe.topk_scaling_factor, moe.topk_scaling_factor not in (None, 1.0)),
    ):
        if why:
            raise ConfigError(f"{field}.{name}", value, "Mixtral/Qwen2-MoE/Qwen3-MoE route with a plain softmax; "
                              "a model trained with it has no Hugging Face MoE export")
    pattern = moe.layer_pattern(m.num_layers)
    shared = moe.shared_expert_ffn_hidden_size
    problems = {
        "mixtral": (shared and "a shared expert") or (m.qk_layernorm and "q/k norms")
        or (m.add_qkv_bias and "QKV biases") or (not all(pattern) and "dense layers")
        or (moe.pre_softmax and "raw (pre-softmax) top-k probabilities"),
        "qwen2_moe": (not shared and "no shared expert") or (shared and not moe.shared_expert_gate
                                                             and "an ungated shared expert")
        or (m.qk_layernorm and "q/k norms"),
        "qwen3_moe": (shared and "a shared expert") or (not m.qk_layernorm and "no q/k norms")
        or (m.add_qkv_bias and "QKV biases"),
    }
    order = [base_type] if base_type in problems else []
    order += [t for t in ("qwen2_moe", "qwen3_moe", "mixtral") if t not in order]
    model_type = next((t for t in order if not problems[t]), None)
    if model_type is None:
        raise ConfigError(f"{field}.shared_expert_ffn_hidden_size", shared,
                          "no Hugging Face MoE class has this model ("
                          + "; ".join(f"{t}: {problems[t]}" for t in order) + ")")
    cfg: dict = dict(model_type=model_type, architectures=[MOE_ARCHITECTURES[model_type]],
                     num_experts_per_tok=moe.topk, router_aux_loss_coef=moe.aux_loss_coeff,
                     output_router_logits=False)
    width = moe.ffn_hidden_size or m.ffn_size
    if model_type == "mixtral":
        cfg.update(num_local_experts=moe.num_experts, intermediate_size=width, router_jitter_noise=0.0)
        return cfg
    cfg.update(num_experts=moe.num_experts, moe_intermediate_size=width, intermediate_size=m.ffn_size,
               norm_topk_prob=not moe.pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i, v in enumerate(pattern) if not v])
    if model_type == "qwen2_moe":
        cfg.update(shared_expert_intermediate_size=shared, qkv_bias=m.add_qkv_bias)
    else:
        cfg.update(attention_bias=False)
    return cfg


# ------------------------------------------------------------------ weights
def _names(model_type: str, hf: str) -> tuple[str, Callable[[int], tuple[str, str, str]]]:
    """(router name, expert ``e`` -> its (gate, up, down) names) of HF layer prefix ``hf``."""
    if model_type == "mixtral":
        p = f"{hf}block_sparse_moe."
        return f"{p}gate.weight", lambda e: tuple(f"{p}experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))
    p = f"{hf}mlp."
    return f"{p}gate.weight", lambda e: tuple(f"{p}experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))


def moe_mlp_from_hf(get: Callable[[str], torch.Tensor], moe: MoeConfig, model_type: str, hf: str, ours: str
                    ) -> dict[str, torch.Tensor]:
    """Megatron tensors of one MoE layer's MLP (our prefix ``ours`` = ``...layers.i.``)
    from HF layer ``hf`` (``...layers.i.``)."""
    router, expert = _names(model_type, hf)
    state = {f"{ours}mlp.router.weight": get(router)}
    for e in range(moe.num_experts):
        gate, up, down = expert(e)
        state[f"{ours}mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([get(gate), get(up)])
        state[f"{ours}mlp.experts.local_experts.{e}.linear_fc2.weight"] = get(down)
    if moe.shared_expert_ffn_hidden_size:
        p = f"{hf}mlp.shared_expert."
        state[f"{ours}mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [get(f"{p}gate_proj.weight"), get(f"{p}up_proj.weight")])
        state[f"{ours}mlp.shared_experts.linear_fc2.weight"] = get(f"{p}down_proj.weight")
        if moe.shared_expert_gate:
            state[f"{ours}mlp.shared_experts.gate_weight"] = get(f"{hf}mlp.shared_expert_gate.weight")
    return state


def moe_mlp_to_hf(state: dict[str, torch.Tensor], moe: MoeConfig, model_type: str, hf: str, ours: str
                  ) -> dict[str, torch.Tensor]:
    """Inverse of :func:`moe_mlp_from_hf`."""
    router, expert = _names(model_type, hf)
    out = {router: state[f"{ours}mlp.router.weight"]}
    for e in range(moe.num_experts):
        gate, up, down = expert(e)
        out[gate], out[up] = state[f"{ours}mlp.experts.local_experts.{e}.linear_fc1.weight"].chunk(2)
        out[down] = state[f"{ours}mlp.experts.local_experts.{e}.linear_fc2.weight"]
    if moe.shared_expert_ffn_hidden_size:
        p = f"{hf}mlp.shared_expert."
        out[f"{p}gate_proj.weight"], out[f"{p}up_proj.weight"] = (
            state[f"{ours}mlp.shared_experts.linear_fc1.weight"].chunk(2))
        out[f"{p}down_proj.weight"] = state[f"{ours}mlp.shared_experts.linear_fc2.weight"]
        out[f"{hf}mlp.shared_expert_gate.weight"] = state[f"{ours}mlp.shared_experts.gate_weight"]
    return out


def moe_mlp_shapes(moe: MoeConfig, m: ModelConfig, ours: str) -> dict[str, tuple[int, ...]]:
    """Shapes :func:`moe_mlp_from_hf` must produce for one MoE layer."""
    h, width = m.hidden_size, moe.ffn_hidden_size or m.ffn_size
    shapes = {f"{ours}mlp.router.weight": (moe.num_experts, h)}
    for e in range(moe.num_experts):
        shapes[f"{ours}mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * width, h)
        shapes[f"{ours}mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, width)
    shared = moe.shared_expert_ffn_hidden_size
    if shared:
        shapes[f"{ours}mlp.shared_experts.linear_fc1.weight"] = (2 * shared, h)
        shapes[f"{ours}mlp.shared_experts.linear_fc2.weight"] = (h, shared)
        if moe.shared_expert_gate:
            shapes[f"{ours}mlp.shared_experts.gate_weight"] = (1, h)
    return shapes
