"""Tiny random Hugging Face models saved with ``save_pretrained`` (no download),
for the import/export tests (each builder returns the model, eval mode,
fp32, after writing it to ``path``), and helpers to run our side."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"

VOCAB = 100


def _save(model, path: Path):
    model.eval()
    model.save_pretrained(str(path))
    return model


def text_config(kind: str, vocab: int = VOCAB, **overrides):
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        return T.LlamaConfig(**{**common, "rms_norm_eps": 1e-6, "rope_theta": 5000.0, **overrides})
    if kind == "qwen2":
        return T.Qwen2Config(**{**common, "tie_word_embeddings": True, "rope_theta": 20000.0, **overrides})
    if kind == "mistral":
        return T.MistralConfig(**{**common, "sliding_window": None, **overrides})
    # MoE decoders: 4 experts, top 2, 3 layers (hidden 64 as above).
    moe = dict(common, num_hidden_layers=3, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    if kind == "mixtral":
        return T.MixtralConfig(**{**moe, "num_local_experts": 4, "intermediate_size": 48, "sliding_window": None,
                                  **overrides})
    if kind == "qwen2_moe":  # a gated shared expert, raw top-k probabilities, layer 1 dense
        return T.Qwen2MoeConfig(**{**moe, "num_experts": 4, "moe_intermediate_size": 48,
                                   "shared_expert_intermediate_size": 80, "norm_topk_prob": False,
                                   "mlp_only_layers": [1], **overrides})
    if kind == "qwen3_moe":  # q/k norms, renormalised top-k, layers 0 and 2 dense (decoder_sparse_step 2),
        # heads twice as wide as hidden / heads (Qwen3-30B-A3B: 128 at hidden 2048, 32 heads)
        return T.Qwen3MoeConfig(**{**moe, "num_experts": 4, "moe_intermediate_size": 48, "norm_topk_prob": True,
                                   "decoder_sparse_step": 2, "head_dim": 32, **overrides})
    raise ValueError(kind)


#: HF model types of the MoE decoders above.
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")


def causal_lm(kind: str, path: Path, seed: int = 0, **overrides):
    import transformers as T

    torch.manual_seed(seed)
    cls = {"llama": T.LlamaForCausalLM, "qwen2": T.Qwen2ForCausalLM, "mistral": T.MistralForCausalLM,
           "mixtral": T.MixtralForCausalLM, "qwen2_moe": T.Qwen2MoeForCausalLM,
           "qwen3_moe": T.Qwen3MoeForCausalLM}[kind]
    model = cls(text_config(kind, **overrides))
    _perturb_norms(model, seed)
    if kind in MOE_KINDS:
        _spread_routers(model, seed)
    return _save(model, path)


@torch.no_grad()
def _spread_routers(model, seed: int) -> None:
    """Router weights large enough that routing decisions are far from ties:
    HF initialises them like any linear (std 0.02), where two experts' scores
    can differ by less than float rounding and the top-k would be decided by
    summation order."""
    gen = torch.Generator().manual_seed(seed + 2)
    for name, p in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def vision_config(kind: str, image_size: int = 32, patch_size: int = 8, layers: int = 3, **overrides):
    import transformers as T

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  image_size=image_size, patch_size=patch_size)
    common.update(overrides)
    if kind == "clip":
        return T.CLIPVisionConfig(**common)
    return T.SiglipVisionConfig(**common)


#: Real tower widths and geometry (``vision_config`` overrides; fewer layers
#: are given separately): CLIP-L/14-336 (LLaVA-1.5) and SigLIP-so400m-patch14-384.
CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, image_size=336, patch_size=14,
                  hidden_act="quick_gelu", layer_norm_eps=1e-5)
SIGLIP_SO400M_384 = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, image_size=384,
                         patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)


def vision_tower(kind: str, path: Path, seed: int = 0, **config):
    import transformers as T

    torch.manual_seed(seed)
    cls = T.CLIPVisionModel if kind == "clip" else T.SiglipVisionModel
    model = cls(vision_config(kind, **config))
    _perturb_norms(model, seed)
    return _save(model, path)


def llava(path: Path, text: str = "llama", tower: str = "clip", vocab: int = VOCAB, image_token: int = 5,
          seed: int = 0, feature_layer: int = -2, image_size: int = 32, patch_size: int = 8, **tower_config):
    import transformers as T

    torch.manual_seed(seed)
    config = T.LlavaConfig(
        vision_config=vision_config(tower, image_size, patch_size, **tower_config), text_config=text_config(text, vocab),
        image_token_index=image_token, vision_feature_layer=feature_layer,
        vision_feature_select_strategy="default" if tower == "clip" else "full",
        image_seq_length=(image_size // patch_size) ** 2,
    )
    model = T.LlavaForConditionalGeneration(config)
    _perturb_norms(model, seed)
    return _save(model, path)


def llava_relative(path: Path, kind: str, seed: int = 0, vocab: int = VOCAB, image_token: int = 5,
                   video_token: int = 6, **text_overrides):
    """A tiny ``LlavaNextForConditionalGeneration`` (``kind="next"``: CLIP +
    Llama) or ``LlavaOnevisionForConditionalGeneration`` (``"onevision"``:
    SigLIP + Qwen2, 32 px, 8 px patches, image token 5, video token 6):
    LLaVA's relatives, whose weights include everything LLaVA's do plus an
    ``image_newline``. ``text_overrides``: of the OneVision's Qwen2 config
    (``initializer_range=0.3``: greedy decoding that is not one token repeated)."""
    import transformers as T

    torch.manual_seed(seed)
    pinpoints = [[32, 32], [32, 64], [64, 32]]
    if kind == "next":
        config = T.LlavaNextConfig(vision_config=vision_config("clip"), text_config=text_config("llama"),
                                   image_token_index=5, image_grid_pinpoints=pinpoints, image_seq_length=16)
        model = T.LlavaNextForConditionalGeneration(config)
    else:
        config = T.LlavaOnevisionConfig(vision_config=vision_config("siglip"), text_config=text_config("qwen2", vocab, **text_overrides),
                                        image_token_index=image_token, video_token_index=video_token,
                                        image_grid_pinpoints=pinpoints)
        model = T.LlavaOnevisionForConditionalGeneration(config)
    _perturb_norms(model, seed)
    return _save(model, path)


class ModelSource:
    """:class:`megascale_omni.hf.directory.HFDirectory`'s read interface over
    an in-memory ``transformers`` model (e.g. one built on ``meta``), so the
    importer's mapping runs without a save; ``read`` collects the tensor
    names the mapping asked for."""

    def __init__(self, model, config: dict | None = None, field: str = "test"):
        #: ``config.json`` as published (defaults left out) when given, else the model's full config.
        self.config = model.config.to_dict() if config is None else config
        self.path = Path(f"<{type(model).__name__}>")
        self.field = field
        self.architecture = type(model).__name__
        self.tensors = dict(model.state_dict())
        self.read: set[str] = set()

    def names(self) -> list[str]:
        return list(self.tensors)

    def find_prefix(self, suffix: str, exclude=()):
        from megascale_omni.hf.directory import find_prefix

        return find_prefix(self.tensors, suffix, exclude)

    def tensor(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self.tensors[name]


@torch.no_grad()
def _perturb_norms(model, seed: int) -> None:
    """Random norm weights/biases and biases: freshly initialised HF models
    have norms at exactly 1/0 and zero biases, which would hide a mapping
    that swaps or drops them."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("bias") or "class_embedding" in name:
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def tool_main(name: str, *args) -> None:
    """Run a tool's ``main`` in this process: the same code as the command
    line without a subprocess's interpreter and import start-up (~10 s here)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name[:-3]}", TOOLS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(a) for a in args])


def our_logits(ckpt_dir: Path, tokens: torch.Tensor, images=None, image_token: int = -1, videos=None,
               video_frames=(), video_token: int = -1) -> torch.Tensor:
    """Our model's logits (one process, fp32) for a checkpoint, cut to the real vocabulary."""
    from megascale_omni.checkpoint.pretrained import load_model_weights, open_model_checkpoint
    from megascale_omni.models.generation import logits
    from megascale_omni.models.standalone import build_model, one_process

    ckpt = open_model_checkpoint(ckpt_dir, "test")
    m = ckpt.cfg.model
    with one_process():
        model = build_model(ckpt.cfg, m.padded_vocab_size(m.vocab_size), image_token, video_token)
        load_model_weights([model], ckpt, "test")
        return logits(model, tokens, images, videos, video_frames)[..., : m.vocab_size]


def hf_greedy(model, prompt: list[int], tok, max_new_tokens: int, **pixels) -> list[int]:
    """HF ``generate``'s greedy new tokens after ``prompt``, up to and with
    ``tok``'s eos (what tools/generate.py prints as ``new_ids``)."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, **pixels)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(tok.eos_id) + 1] if tok.eos_id in new else new


# ------------------------------------------------------------ chat tokenizers
#: ChatML (Qwen2 style): a default system turn when none is given.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: Llama-3 style: BOS, header tokens, trimmed content, <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                       "<|end_header_id|>", "<|eot_id|>", "<image>")
_CHAT_CORPUS = [
    "You are a helpful assistant.", "What is in the image?", "A red circle on the left.",
    "Describe the picture in detail.", "There are two squares and a blue triangle.", "How many shapes are there?",
    "Which one is bigger?", "Compare the two images.", "The first image is brighter than the second one.",
    "user assistant system", "Thanks! Anything else?", "No, that is all.",
]


def chat_tokenizer(path: Path, template: str = CHATML_TEMPLATE):
    """A tiny byte-level BPE ``PreTrainedTokenizerFast`` with ``template`` as its
    chat template and ``<image>`` as a special token, saved to ``path``
    (``tokenizer.json`` + ``tokenizer_config.json``). Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(CHAT_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_CHAT_CORPUS, trainer)
    llama = template == LLAMA3_TEMPLATE
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>" if llama else None,
        eos_token="<|eot_id|>" if llama else "<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<image>"],
    )
    tok.chat_template = template
    tok.save_pretrained(str(path))
    return tok
