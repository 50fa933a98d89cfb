"""Our checkpoint (any layout it was saved in) -> a Hugging Face directory
(``config.json`` + ``model.safetensors`` + tokenizer files) that
``transformers`` loads with ``from_pretrained``.

``gpt`` models become ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (or the
architecture they were imported from; MoE models ``MixtralForCausalLM`` /
``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM``), ``llava`` models
``LlavaForConditionalGeneration``, or with ``vision.image_newline``
``LlavaOnevisionForConditionalGeneration``. The tokenizer, chat template and
processor files are the ones the checkpoint carries
(:mod:`~megascale_omni.checkpoint.hf_assets`: a run that started from an
import has them in every checkpoint), checked against its commit marker.
The output is written under a temporary name and renamed at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from megascale_omni.checkpoint.pretrained import ModelCheckpoint, load_model_weights, open_model_checkpoint
from megascale_omni.config import ConfigError
from megascale_omni.hf import lm, vision
from megascale_omni.hf.importer import NEWLINE, PROJECTOR_PREFIX


def checkpoint_state(ckpt: ModelCheckpoint, field: str) -> dict[str, torch.Tensor]:
    """The model of ``ckpt`` as one-process tensors (inside ``one_process``)."""
    from megatron.core import dist_checkpointing

    from megascale_omni.models.standalone import build_model

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt.path))
    emb = next((k for k in meta if k.endswith("embedding.word_embeddings.weight")), None)
    if emb is None:
        raise ConfigError(field, str(ckpt.path), "holds no language-model embedding; not a gpt/llava checkpoint")
    model = build_model(ckpt.cfg, int(meta[emb].global_shape[0]), image_token_id(ckpt))
    load_model_weights([model], ckpt, field)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def image_token_id(ckpt: ModelCheckpoint) -> int:
    """The image token of an imported LLaVA (-1 when unknown)."""
    return int(ckpt.provenance.get("image_token_id", -1))


def hf_vocab_size(ckpt: ModelCheckpoint, padded: int) -> int:
    """Real vocabulary rows: the imported model's, else ``model.vocab_size``,
    else every (padded) row."""
    return int(ckpt.provenance.get("vocab_size") or ckpt.cfg.model.vocab_size or padded)


@dataclasses.dataclass(frozen=True)
class Export:
    """What :func:`export_hf` wrote."""

    #: The Hugging Face directory.
    path: Path
    #: Tokenizer/processor files copied from the checkpoint.
    copied: tuple[str, ...]
    #: What ``AutoTokenizer``/``AutoProcessor`` would miss (readable names; empty: nothing).
    missing: tuple[str, ...]


def export_hf(path: Path, out: Path, field: str = "--checkpoint", image_token: int | None = None,
              video_token: int | None = None) -> Export:
    """Write the HF directory ``out`` for the checkpoint at ``path``: weights,
    config and the tokenizer/processor files the checkpoint carries. Raises
    ConfigError for a model HF cannot express, CheckpointError for a broken
    checkpoint (its tokenizer files included)."""
    from safetensors.torch import save_file

    from megascale_omni.models.standalone import one_process

    out = Path(out)
    if out.exists():
        raise ConfigError("--out", str(out), "already exists; choose a new directory (exports never overwrite)")
    ckpt = open_model_checkpoint(path, field)
    assets = ckpt.hf_assets()
    family = ckpt.cfg.model.family
    if family not in ("gpt", "llava"):
        raise ConfigError(field, str(ckpt.path), f"holds a {family!r} model; gpt and llava checkpoints export to "
                          "Hugging Face")
    m = ckpt.cfg.model
    prov = ckpt.provenance
    text = lm.hf_text_config(m, prov.get("text_config"), ckpt.cfg.moe)
    with one_process():
        state = checkpoint_state(ckpt, field)
    padded = state["language_model.embedding.word_embeddings.weight" if family == "llava"
                   else "embedding.word_embeddings.weight"].shape[0]
    vocab = hf_vocab_size(ckpt, padded)
    text["vocab_size"] = vocab
    if family == "gpt":
        tensors = lm.weights_to_hf(state, m, vocab, body="model.", head="lm_head.weight", src="",
                                   moe=ckpt.cfg.moe, model_type=text["model_type"])
        config = text
    else:
        tensors, config = _llava(ckpt, state, text, vocab, image_token, video_token)
    dtype = next(iter(tensors.values())).dtype
    config["dtype"] = str(dtype).removeprefix("torch.")
    tmp = out.parent / f".{out.name}.exporting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        assets.write(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Export(out, tuple(assets.files), tuple(assets.missing(image_processor=family == "llava")))


def _llava(ckpt: ModelCheckpoint, state: dict, text: dict, vocab: int, image_token: int | None,
           video_token: int | None) -> tuple[dict[str, torch.Tensor], dict]:
    m, v = ckpt.cfg.model, ckpt.cfg.vision
    vision.check_tower(v, "vision")
    if v.projector_type != "mlp" or (v.projector_hidden_size or m.hidden_size) != m.hidden_size:
        raise ConfigError("vision.projector_type", v.projector_type, "HF LLaVA's projector is the 2-layer MLP "
                          "with hidden size = the LM's; this model's cannot be exported")
    token = image_token if image_token is not None else image_token_id(ckpt)
    if token < 0:
        raise ConfigError("--image-token-id", None, "this checkpoint was not imported from HF; pass the id of "
                          "the <image> token of its tokenizer")
    tensors = lm.weights_to_hf(state, m, vocab, body="language_model.model.", head="language_model.lm_head.weight",
                               src="language_model.", moe=ckpt.cfg.moe, model_type=text["model_type"])
    tensors.update(vision.tower_to_hf(state, v, "vision_tower.", src="vision_model."))
    tensors.update(vision.projector_to_hf(state, "multi_modal_projector.", src=PROJECTOR_PREFIX))
    base = {k: val for k, val in (ckpt.provenance.get("llava_config") or {}).items()
            if k not in ("text_config", "vision_config")}
    config = {
        **base,
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text,
        "vision_config": vision.hf_vision_config(v),
        # Only the layers up to the feature layer were kept: read the last.
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default" if v.class_token else "full",
        "image_token_index": token,
        "image_seq_length": v.tokens_per_image,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "tie_word_embeddings": m.share_embeddings_and_output_weights,
    }
    if v.image_newline:
        return _onevision(ckpt, state, tensors, config, video_token)
    return tensors, config


def _onevision(ckpt: ModelCheckpoint, state: dict, tensors: dict, config: dict, video_token: int | None
               ) -> tuple[dict[str, torch.Tensor], dict]:
    """A model with ``vision.image_newline``: LLaVA-OneVision, whose video
    path pools frames 2x2 and whose multi-image path appends the newline."""
    v = ckpt.cfg.vision
    if v.video_pool_stride != 2:
        raise ConfigError("vision.video_pool_stride", v.video_pool_stride, "LLaVA-OneVision pools video frames "
                          "with stride 2 only; this model cannot be exported")
    token = video_token if video_token is not None else int(ckpt.provenance.get("video_token_id", -1))
    if token < 0:
        raise ConfigError("--video-token-id", None, "this checkpoint was not imported from LLaVA-OneVision; pass "
                          "the id of the <video> token of its tokenizer")
    tensors[NEWLINE] = state[NEWLINE]
    config.pop("image_seq_length")
    config.update(architectures=["LlavaOnevisionForConditionalGeneration"], model_type="llava_onevision",
                  video_token_index=token)
    return tensors, config
