"""Hugging Face CLIP / SigLIP vision towers and the LLaVA projector <-> our
``vision`` section and megatron ``CLIPViTModel`` / ``MultimodalProjector`` weights.

LLaVA reads the hidden states of one tower layer (``vision_feature_layer``):
the layers after it, CLIP's ``post_layernorm`` and SigLIP's post-norm and
pooling head never influence it, so they are not imported (our tower is
built only up to the feature layer) and an export writes a tower of the
layers that run with ``vision_feature_layer: -1``.
"""

from __future__ import annotations

from typing import Callable

import torch

from megascale_omni.config import VisionConfig
from megascale_omni.config.errors import ConfigError
from megascale_omni.hf.lm import fuse_qkv, split_qkv

#: HF vision ``model_type`` -> our ``vision.model_type``.
TOWER_TYPES = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
_HF_ACTIVATIONS = {ours: hf for hf, ours in _ACTIVATIONS.items()}


def vision_section(vc: dict, feature_layer: int, field: str) -> dict:
    """Our ``vision`` section (as a dict) for an HF vision config ``vc``."""
    kind = TOWER_TYPES.get(vc.get("model_type"))
    if kind is None:
        raise ConfigError(f"{field}: model_type", vc.get("model_type"),
                          f"supported vision towers: {', '.join(TOWER_TYPES)}")
    act = _ACTIVATIONS.get(vc.get("hidden_act"))
    if act is None:
        raise ConfigError(f"{field}: hidden_act", vc.get("hidden_act"), f"supported: {', '.join(_ACTIVATIONS)}")
    if int(vc.get("num_channels", 3)) != 3:
        raise ConfigError(f"{field}: num_channels", vc.get("num_channels"), "only RGB (3-channel) towers are mapped")
    image_size, patch_size = vc.get("image_size"), vc.get("patch_size")
    if not isinstance(image_size, int) or image_size <= 0:
        raise ConfigError(f"{field}: image_size", image_size, "must be one positive int (square towers only; "
                          "a [height, width] pair is not mapped)")
    if not isinstance(patch_size, int) or not 0 < patch_size <= image_size:
        raise ConfigError(f"{field}: patch_size", patch_size,
                          f"must be an int in [1, image_size={image_size}]: the grid is image_size // patch_size "
                          "patches a side")
    hidden, heads = int(vc["hidden_size"]), int(vc["num_attention_heads"])
    if hidden % heads:
        raise ConfigError(f"{field}: hidden_size", hidden, f"must be divisible by num_attention_heads={heads}")
    layers = int(vc["num_hidden_layers"])
    if not -layers <= feature_layer <= -1:
        raise ConfigError(f"{field}: vision_feature_layer", feature_layer,
                          f"must be a single layer in [-{layers}, -1] (lists of layers are not mapped)")
    return dict(
        model_type=kind,
        class_token=kind == "clip",
        activation=act,
        image_size=image_size,
        patch_size=patch_size,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=int(vc["intermediate_size"]),
        norm_epsilon=float(vc.get("layer_norm_eps", 1e-5 if kind == "clip" else 1e-6)),
        feature_layer=feature_layer,
    )


def hf_vision_config(v: VisionConfig) -> dict:
    """An HF vision config of the layers our tower runs."""
    cfg = dict(
        model_type="clip_vision_model" if v.model_type == "clip" else "siglip_vision_model",
        hidden_act=_HF_ACTIVATIONS[v.activation],
        image_size=v.image_size,
        patch_size=v.patch_size,
        num_hidden_layers=v.layers_built,
        hidden_size=v.hidden_size,
        num_attention_heads=v.num_attention_heads,
        intermediate_size=v.ffn_size,
        layer_norm_eps=v.norm_epsilon,
        num_channels=3,
    )
    if v.model_type == "siglip":
        cfg["vision_use_head"] = False
    return cfg


def check_tower(v: VisionConfig, field: str) -> None:
    """Raise ConfigError unless ``v`` is a tower HF can represent."""
    if v.model_type == "clip" and not v.class_token:
        raise ConfigError(f"{field}.class_token", False, "HF CLIP towers have a class token; this tower cannot be "
                          "exported as CLIP")


def _layer_pairs(v: VisionConfig, layer_prefix: str, out: str):
    for i in range(v.layers_built):
        yield f"{layer_prefix}{i}.", f"{out}decoder.layers.{i}."


def tower_from_hf(get: Callable[[str], torch.Tensor], v: VisionConfig, prefix: str, out: str) -> dict[str, torch.Tensor]:
    """Megatron tower state (names prefixed ``out``) from HF tensors under
    ``prefix`` (e.g. ``vision_tower.`` or ``vision_model.``)."""
    heads = v.num_attention_heads
    state = {
        f"{out}conv1.weight": get(f"{prefix}embeddings.patch_embedding.weight"),
        f"{out}position_embeddings.weight": get(f"{prefix}embeddings.position_embedding.weight"),
    }
    if v.model_type == "siglip":
        state[f"{out}conv1.bias"] = get(f"{prefix}embeddings.patch_embedding.bias")
    else:
        state[f"{out}class_token"] = get(f"{prefix}embeddings.class_embedding").reshape(1, 1, -1)
        state[f"{out}ln_pre.weight"] = get(f"{prefix}pre_layrnorm.weight")
        state[f"{out}ln_pre.bias"] = get(f"{prefix}pre_layrnorm.bias")
    for hf, ours in _layer_pairs(v, f"{prefix}encoder.layers.", out):
        for kind in ("weight", "bias"):
            q, k, vv = (get(f"{hf}self_attn.{p}_proj.{kind}") for p in "qkv")
            state[f"{ours}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, vv, heads, heads)
            state[f"{ours}self_attention.linear_proj.{kind}"] = get(f"{hf}self_attn.out_proj.{kind}")
            state[f"{ours}input_layernorm.{kind}"] = get(f"{hf}layer_norm1.{kind}")
            state[f"{ours}pre_mlp_layernorm.{kind}"] = get(f"{hf}layer_norm2.{kind}")
            state[f"{ours}mlp.linear_fc1.{kind}"] = get(f"{hf}mlp.fc1.{kind}")
            state[f"{ours}mlp.linear_fc2.{kind}"] = get(f"{hf}mlp.fc2.{kind}")
    return state


def tower_to_hf(state: dict[str, torch.Tensor], v: VisionConfig, prefix: str, src: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`tower_from_hf`."""
    heads = v.num_attention_heads
    out = {
        f"{prefix}embeddings.patch_embedding.weight": state[f"{src}conv1.weight"],
        f"{prefix}embeddings.position_embedding.weight": state[f"{src}position_embeddings.weight"],
    }
    if v.model_type == "siglip":
        out[f"{prefix}embeddings.patch_embedding.bias"] = state[f"{src}conv1.bias"]
    else:
        out[f"{prefix}embeddings.class_embedding"] = state[f"{src}class_token"].reshape(-1)
        out[f"{prefix}pre_layrnorm.weight"] = state[f"{src}ln_pre.weight"]
        out[f"{prefix}pre_layrnorm.bias"] = state[f"{src}ln_pre.bias"]
    for hf, ours in _layer_pairs(v, f"{prefix}encoder.layers.", src):
        for kind in ("weight", "bias"):
            q, k, vv = split_qkv(state[f"{ours}self_attention.linear_qkv.{kind}"], heads, heads)
            out.update({
                f"{hf}self_attn.q_proj.{kind}": q, f"{hf}self_attn.k_proj.{kind}": k,
                f"{hf}self_attn.v_proj.{kind}": vv,
                f"{hf}self_attn.out_proj.{kind}": state[f"{ours}self_attention.linear_proj.{kind}"],
                f"{hf}layer_norm1.{kind}": state[f"{ours}input_layernorm.{kind}"],
                f"{hf}layer_norm2.{kind}": state[f"{ours}pre_mlp_layernorm.{kind}"],
                f"{hf}mlp.fc1.{kind}": state[f"{ours}mlp.linear_fc1.{kind}"],
                f"{hf}mlp.fc2.{kind}": state[f"{ours}mlp.linear_fc2.{kind}"],
            })
    return {k: t.contiguous() for k, t in out.items()}


#: HF LLaVA projector layer -> ours (``mlp`` type).
_PROJECTOR_MLP = {"linear_1": "encoder.linear_fc1", "linear_2": "encoder.linear_fc2"}


def projector_from_hf(get: Callable[[str], torch.Tensor], prefix: str, out: str) -> dict[str, torch.Tensor]:
    """Our 2-layer MLP projector (names prefixed ``out``) from HF's ``multi_modal_projector``."""
    return {f"{out}{ours}.{kind}": get(f"{prefix}{hf}.{kind}")
            for hf, ours in _PROJECTOR_MLP.items() for kind in ("weight", "bias")}


def projector_to_hf(state: dict[str, torch.Tensor], prefix: str, src: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}{hf}.{kind}": state[f"{src}{ours}.{kind}"]
            for hf, ours in _PROJECTOR_MLP.items() for kind in ("weight", "bias")}
