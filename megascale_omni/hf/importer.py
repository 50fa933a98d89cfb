"""Hugging Face model directories -> our model-only checkpoint + config sections.

Three sources (:func:`read_llm`, :func:`read_llava`, :func:`read_llm_and_tower`)
give an :class:`HFImport`: our config sections, the megatron weights of a
one-process model, and where they came from. :func:`write_import` builds the
model, loads the weights and writes, under a temporary name renamed at the
end (an interrupted import leaves no half-written output)::

    OUT/step_00000000/   model-only checkpoint (loads under any TP/PP/VPP), with
                         the tokenizer files below in its tokenizer/ (verified
                         by its commit marker; every checkpoint of a run from
                         it carries them)
    OUT/model.yaml       the model (and vision) sections + checkpoint.pretrained: OUT
    OUT/tokenizer/       the HF tokenizer files and chat template, and the tower's
                         preprocessor_config.json, when present (for data.tokenizer)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import yaml

from megascale_omni.checkpoint.hf_assets import ASSET_DIR, HFAssets
from megascale_omni.config import ConfigError, JobConfig, from_dict
from megascale_omni.hf import lm, vision
from megascale_omni.hf import moe as hf_moe
from megascale_omni.hf.directory import HFDirectory, expect_shape, with_defaults

logger = logging.getLogger(__name__)

#: Our names of the parts that an import without a projector initialises fresh.
PROJECTOR_PREFIX = "vision_projection."

#: The whole multimodal architectures ``--llava`` maps (``architectures[0]``), by their ``model_type``.
LLAVA_ARCHITECTURES = {"llava": "LlavaForConditionalGeneration",
                       "llava_onevision": "LlavaOnevisionForConditionalGeneration"}
#: Our name of LLaVA-OneVision's newline embedding (HF's ``image_newline``, any prefix).
NEWLINE = "image_newline"


@dataclasses.dataclass
class HFImport:
    """What an HF source maps to, before anything is written."""

    #: Config sections (``model``, and ``vision`` for LLaVA) as dicts.
    sections: dict
    #: One-process megatron state, by module ``state_dict`` name.
    state: dict[str, torch.Tensor]
    #: Record stored in the checkpoint: sources, HF configs, image token id.
    provenance: dict
    #: Directories whose tokenizer files come along (first found wins).
    tokenizer_dirs: list[Path]
    #: Name prefixes of parts not in ``state`` that are initialised fresh.
    fresh: tuple[str, ...] = ()


def check_architecture(d: HFDirectory, supported: dict[str, str]) -> None:
    """Raise ConfigError unless ``d``'s ``model_type`` and ``architectures``
    (when given) are one of ``supported`` (``model_type`` -> class). A
    relative such as ``LlavaOnevisionForConditionalGeneration`` has weights
    we would read but parts we would silently drop (LLaVA-NeXT's
    ``image_newline`` and anyres unpadding), and its export would be another model."""
    model_type, arch = d.config.get("model_type"), d.architecture
    if model_type not in supported or (arch and arch != supported[model_type]):
        raise ConfigError(d.field, str(d.path), f"is a {arch or model_type!r} model (model_type "
                          f"{model_type!r}); {d.field} maps {', '.join(supported.values())} only "
                          f"(model_type {', '.join(map(repr, supported))}); nothing was written")


def check_all_mapped(d: HFDirectory, unused: set[str], within: str = "") -> None:
    """Raise ConfigError when a tensor of ``d`` (under ``within``) was
    neither read by the mapping nor is in ``unused`` (tensors the model never
    reads by design): an import that left it out would not be the model."""
    left = sorted(n for n in d.names() if n.startswith(within) and n not in d.read and n not in unused)
    if left:
        raise ConfigError(d.field, str(d.path), f"has {len(left)} tensor(s) the import does not map (e.g. "
                          f"{', '.join(left[:3])}), so this is not a model we map fully (a relative of "
                          f"{d.architecture or d.config.get('model_type')!r} with more parts?); supported: " + ", ".join([*lm.LM_ARCHITECTURES.values(),
                                                                         *LLAVA_ARCHITECTURES.values()]))


def _lm_unused(d: HFDirectory, tied: bool) -> set[str]:
    """Decoder tensors that carry nothing: rotary ``inv_freq`` buffers older
    saves include, and a tied model's ``lm_head`` copy of the embedding."""
    return {n for n in d.names() if n.endswith("rotary_emb.inv_freq") or (tied and n.endswith("lm_head.weight"))}


def _tower_unused(d: HFDirectory, prefix: str, v) -> set[str]:
    """Tower tensors LLaVA never reads: layers after the feature layer, the
    post-layernorm and (SigLIP) the pooling head."""
    after = tuple(f"{prefix}encoder.layers.{i}." for i in range(v.layers_built, v.num_layers))
    return {n for n in d.names() if n.startswith((*after, f"{prefix}post_layernorm.", f"{prefix}head."))}


def _lm_prefixes(d: HFDirectory, tied: bool) -> tuple[str, Optional[str]]:
    body = d.find_prefix("embed_tokens.weight", exclude=("vision", "text_model"))
    if body is None:
        raise ConfigError(d.field, str(d.path), "has no decoder weights (no *embed_tokens.weight); is it a "
                          "Llama/Qwen2/Mistral/MoE decoder?")
    head = None
    if not tied:
        head_prefix = d.find_prefix("lm_head.weight")
        if head_prefix is None:
            from megascale_omni.checkpoint.errors import CheckpointError

            raise CheckpointError(f"{d.path}: config.json says tie_word_embeddings=false but no lm_head.weight "
                                  "is in the weights; copy the complete model")
        head = f"{head_prefix}lm_head.weight"
    return body, head


def read_llm(d: HFDirectory, seq_length: int) -> HFImport:
    """A Llama/Qwen2/Mistral or Mixtral/Qwen2-MoE/Qwen3-MoE causal LM -> the
    ``gpt`` family (with a ``moe`` section for the MoE ones)."""
    tc = with_defaults(d.config, d.field)
    if tc.get("model_type") not in lm.LM_ARCHITECTURES or (
            d.architecture and d.architecture != lm.LM_ARCHITECTURES[tc["model_type"]]):
        why = hf_moe.REFUSED.get(tc.get("model_type"))
        raise ConfigError(d.field, str(d.path), f"is a {d.architecture or tc.get('model_type')!r} model"
                          + (f" ({why})" if why else "") + f"; --llm takes {', '.join(lm.LM_ARCHITECTURES.values())}")
    sections = lm.text_sections(tc, seq_length, f"{d.path}/config.json", "gpt")
    cfg = from_dict(JobConfig, sections)
    m = cfg.model
    body, head = _lm_prefixes(d, m.share_embeddings_and_output_weights)
    state = lm.weights_from_hf(d.tensor, m, m.padded_vocab_size(m.vocab_size), body, head, out="",
                               moe=cfg.moe, model_type=tc["model_type"])
    check_all_mapped(d, _lm_unused(d, m.share_embeddings_and_output_weights))
    provenance = {"source": str(d.path), "architecture": d.architecture, "text_config": tc,
                  "vocab_size": m.vocab_size}
    return HFImport(sections, state, provenance, [d.path])


def _llava_sections(text: dict, tower: dict, seq_length: int, feature_layer: int, where: str) -> dict:
    sections = lm.text_sections(text, seq_length, where, "llava")
    vis = vision.vision_section(tower, feature_layer, where)
    vis.update(projector_type="mlp", projector_hidden_size=sections["model"]["hidden_size"])
    return {**sections, "vision": vis}


def read_llava(d: HFDirectory, seq_length: int) -> HFImport:
    """A whole ``LlavaForConditionalGeneration`` or ``LlavaOnevisionForConditionalGeneration``
    -> the ``llava`` family (OneVision: ``vision.image_newline``, frames
    pooled 2x2, its video token recorded). Any other architecture
    (LLaVA-NeXT, ...), or a tensor left unmapped, is refused with ConfigError."""
    check_architecture(d, LLAVA_ARCHITECTURES)
    onevision = d.config.get("model_type") == "llava_onevision"
    raw = dict(d.config)
    where = f"{d.path}/config.json"
    text = raw["text_config"] = dict(raw.get("text_config") or {})
    text.setdefault("model_type", "llama")
    if "tie_word_embeddings" in raw and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    c = with_defaults(raw, d.field)
    text, tower = dict(c["text_config"]), dict(c.get("vision_config") or {})
    tower.setdefault("model_type", "clip_vision_model")
    feature_layer = c.get("vision_feature_layer", -2)
    if not isinstance(feature_layer, int):
        raise ConfigError(f"{where}: vision_feature_layer", feature_layer, "only a single feature layer is mapped")
    sections = _llava_sections(text, tower, seq_length, feature_layer, where)
    strategy = c.get("vision_feature_select_strategy", "default")
    wanted = "default" if sections["vision"]["class_token"] else "full"
    if strategy != wanted:
        raise ConfigError(f"{where}: vision_feature_select_strategy", strategy,
                          f"with a {sections['vision']['model_type']} tower only {wanted!r} is mapped "
                          "(every patch feature, no class token)")
    if c.get("projector_hidden_act", "gelu") != "gelu" or not c.get("multimodal_projector_bias", True):
        raise ConfigError(f"{where}: projector_hidden_act", c.get("projector_hidden_act"),
                          "only the LLaVA-1.5 projector (linear, exact GELU, linear, with biases) is mapped")
    image_token = c.get("image_token_index", c.get("image_token_id"))
    if image_token is None:
        raise ConfigError(f"{where}: image_token_index", None, "is missing; a LLaVA config names its image token")
    video_token = c.get("video_token_index", c.get("video_token_id"))
    if onevision:
        if video_token is None:
            raise ConfigError(f"{where}: video_token_index", None, "is missing; a LLaVA-OneVision config names its "
                              "video token")
        # OneVision's get_video_features pools every frame to ceil(grid / 2) a side, then one newline per video.
        sections["vision"].update(image_newline=True, video_pool_stride=2)
    cfg = from_dict(JobConfig, sections)
    m, v = cfg.model, cfg.vision
    body, head = _lm_prefixes(d, m.share_embeddings_and_output_weights)
    state = lm.weights_from_hf(d.tensor, m, m.padded_vocab_size(m.vocab_size), body, head, out="language_model.",
                               moe=cfg.moe, model_type=text["model_type"])
    tower_prefix = d.find_prefix("embeddings.patch_embedding.weight", exclude=("text_model",))
    projector_prefix = d.find_prefix("linear_1.weight")
    if tower_prefix is None or projector_prefix is None:
        raise ConfigError(d.field, str(d.path), "lacks the vision tower or projector weights of a LLaVA model")
    state.update(vision.tower_from_hf(d.tensor, v, tower_prefix, out="vision_model."))
    state.update(vision.projector_from_hf(d.tensor, projector_prefix, out=PROJECTOR_PREFIX))
    if onevision:
        newline_prefix = d.find_prefix(NEWLINE, exclude=("vision", "language_model"))
        if newline_prefix is None:
            raise ConfigError(d.field, str(d.path), f"lacks the {NEWLINE} tensor of a LLaVA-OneVision model")
        state[NEWLINE] = expect_shape(d.tensor(newline_prefix + NEWLINE), (m.hidden_size,), NEWLINE, d.path)
    check_all_mapped(d, _lm_unused(d, m.share_embeddings_and_output_weights) | _tower_unused(d, tower_prefix, v))
    provenance = {"source": str(d.path), "architecture": d.architecture, "llava_config": c, "text_config": text,
                  "vision_config": tower, "image_token_id": int(image_token), "vocab_size": m.vocab_size}
    if onevision:
        provenance["video_token_id"] = int(video_token)
    return HFImport(sections, state, provenance, [d.path])


def read_llm_and_tower(llm: HFDirectory, tower: HFDirectory, feature_layer: Optional[int], seq_length: int
                       ) -> HFImport:
    """A causal LM + a CLIP/SigLIP tower (``CLIPVisionModel``, ``CLIPModel``,
    ``SiglipVisionModel``, ``SiglipModel``) -> ``llava`` with a fresh projector."""
    text = with_defaults(llm.config, llm.field)
    full = with_defaults(tower.config, tower.field)  # CLIPModel / SiglipModel: the vision half
    tc = dict(full.get("vision_config") or full)
    kind = vision.TOWER_TYPES.get(tc.get("model_type"))
    if feature_layer is None:
        feature_layer = -2 if kind == "clip" else -1  # LLaVA-1.5's choice for CLIP
    where = f"{llm.path}/config.json + {tower.path}/config.json"
    sections = _llava_sections(text, tc, seq_length, feature_layer, where)
    cfg = from_dict(JobConfig, sections)
    m, v = cfg.model, cfg.vision
    body, head = _lm_prefixes(llm, m.share_embeddings_and_output_weights)
    state = lm.weights_from_hf(llm.tensor, m, m.padded_vocab_size(m.vocab_size), body, head, out="language_model.",
                               moe=cfg.moe, model_type=text.get("model_type", ""))
    tower_prefix = tower.find_prefix("embeddings.patch_embedding.weight", exclude=("text_model",))
    if tower_prefix is None:
        raise ConfigError(tower.field, str(tower.path), "has no vision tower weights (*embeddings.patch_embedding)")
    state.update(vision.tower_from_hf(tower.tensor, v, tower_prefix, out="vision_model."))
    check_all_mapped(llm, _lm_unused(llm, m.share_embeddings_and_output_weights))
    # A CLIPModel / SiglipModel's text half is not wanted; its vision half must map.
    check_all_mapped(tower, _tower_unused(tower, tower_prefix, v), within=tower_prefix)
    provenance = {"source": f"{llm.path} + {tower.path}", "architecture": "LlavaForConditionalGeneration",
                  "text_config": text, "vision_config": tc, "vocab_size": m.vocab_size}
    return HFImport(sections, state, provenance, [llm.path, tower.path], fresh=(PROJECTOR_PREFIX,))


def write_import(imp: HFImport, out: Path, seed: int, image_token_id: int = -1) -> Path:
    """Build the model, load ``imp``'s weights and write ``out`` (see module
    docstring). Parts in ``imp.fresh`` get the layout-invariant init of
    ``seed``. Raises ConfigError when ``out`` exists."""
    from megascale_omni.checkpoint.pretrained import save_model_checkpoint
    from megascale_omni.models.init import init_layout_invariant
    from megascale_omni.models.standalone import build_model, one_process

    out = Path(out)
    if out.exists():
        raise ConfigError("--out", str(out), "already exists; choose a new directory (imports never overwrite)")
    cfg = from_dict(JobConfig, {**imp.sections, "train": {"seed": seed}})
    assets = HFAssets.from_sources(imp.tokenizer_dirs)
    tmp = out.parent / f".{out.name}.importing-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with one_process(seed):
            model = build_model(cfg, cfg.model.padded_vocab_size(cfg.model.vocab_size), image_token_id)
            init_layout_invariant([model], seed, cfg.model.init_method_std, cfg.model.num_layers)
            own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
            missing = sorted(k for k in own - set(imp.state) if not k.startswith(imp.fresh or ("\0",)))
            unexpected = sorted(set(imp.state) - own)
            if missing or unexpected:
                raise RuntimeError(f"HF mapping incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}")
            model.load_state_dict(imp.state, strict=False)
            provenance = {**imp.provenance, "fresh": list(imp.fresh), "seed": seed}
            save_model_checkpoint(model, cfg, tmp, provenance, assets)
        _write_sections(tmp / "model.yaml", imp.sections, out.resolve())
        assets.write(tmp / ASSET_DIR)
        if assets.enabled:
            logger.info("copied %s from %s", ", ".join(assets.files), " + ".join(map(str, imp.tokenizer_dirs)))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_sections(path: Path, sections: dict, out: Path) -> None:
    doc = {**sections, "checkpoint": {"pretrained": str(out)}}
    header = ("# Written by tools/hf_import.py: the architecture of the imported weights.\n"
              "# Use it as a base config: --config <your job>.yaml, then merge these sections,\n"
              "# or pass them as overrides. Changing a shape field no longer matches the weights.\n")
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False))
