"""Vision towers at HF's geometry: a patch size that does not divide the
image size (SigLIP-so400m: 384 px / 14 px patches -> a 27 x 27 grid).

Tiny random models from ``transformers`` configs (tests/hf_models.py), no
download. Claims checked here:
- the grid is ``floor(image_size / patch_size)`` and the tower ignores the
  unused bottom/right border exactly as HF's stride-``patch_size`` conv does
  (changing those pixels changes nothing);
- an imported LLaVA with such a tower gives HF's logits within 1e-4 (fp32).
"""

from __future__ import annotations

import pytest
import torch

from megascale_omni.config import ConfigError, JobConfig, from_dict
from tests import hf_models
from tests.hf_models import our_logits, tool_main
from tests.launcher import run_tool_in_process

pytestmark = pytest.mark.timeout(300)

LOGIT_ATOL = 1e-4
IMAGE_TOKEN = 5


def test_grid_is_the_floor_of_image_over_patch_size():
    v = from_dict(JobConfig, {"vision": {"image_size": 384, "patch_size": 14}}).vision
    assert (v.grid, v.covered_size, v.tokens_per_image) == (27, 378, 729)
    v = from_dict(JobConfig, {"vision": {"image_size": 336, "patch_size": 14}}).vision
    assert (v.grid, v.covered_size, v.tokens_per_image) == (24, 336, 576)
    with pytest.raises(ConfigError) as e:
        from_dict(JobConfig, {"vision": {"image_size": 32, "patch_size": 40}})
    assert e.value.field == "vision.patch_size" and e.value.value == 40 and "<= vision.image_size=32" in e.value.hint


@pytest.mark.parametrize("text,tower,size", [("qwen2", "siglip", 38), ("llama", "clip", 36)])
def test_llava_with_a_tower_the_patch_does_not_divide_matches_transformers(tmp_path, text, tower, size):
    """A 4 x 4 grid of 8-px patches over 38 (36) px: 6 (4) border pixels unused."""
    src, ours = tmp_path / "hf", tmp_path / "ours"
    hf = hf_models.llava(src, text=text, tower=tower, feature_layer=-2 if tower == "clip" else -1,
                         image_size=size, patch_size=8, image_token=IMAGE_TOKEN)
    tool_main("hf_import.py", "--llava", src, "--out", ours)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(6, hf_models.VOCAB, (2, 40), generator=g)
    tokens[0, 3:19] = IMAGE_TOKEN
    tokens[1, 20:36] = IMAGE_TOKEN
    pixels = torch.randn(2, 3, size, size, generator=g)
    with torch.no_grad():
        ref = hf(input_ids=tokens, pixel_values=pixels).logits
    got = our_logits(ours, tokens, pixels, image_token=IMAGE_TOKEN)
    diff = (got - ref).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{tower} {size}px: max abs logit difference {diff:.3g}"
    # The border beyond the 32 covered pixels is never read: new values there change nothing.
    edited = pixels.clone()
    edited[..., 32:, :] = 7.0
    edited[..., :, 32:] = -7.0
    assert torch.equal(our_logits(ours, tokens, edited, image_token=IMAGE_TOKEN), got)


# ------------------------------------------------------- real-size architectures
#: llava-hf/llava-1.5-7b-hf's config.json as published (transformers fills in
#: the rest): Vicuna-7B (Llama, vocab 32064 with LLaVA's added tokens) +
#: CLIP-L/14-336 read at its penultimate layer, 2-layer GELU projector.
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False,
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
}
#: Qwen/Qwen2-7B's config.json and google/siglip-so400m-patch14-384's
#: ``vision_config`` as published, paired as LLaVA-OneVision pairs them: the
#: last tower layer, every one of the 27 x 27 patch features.
QWEN2_7B_SIGLIP_384 = {
    "model_type": "llava", "image_token_index": 151646, "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full", "image_seq_length": 729, "tie_word_embeddings": False,
    "text_config": {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
                    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
                    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
                    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
                    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                    "use_cache": True, "use_sliding_window": False, "vocab_size": 152064},
    "vision_config": {"hidden_size": 1152, "image_size": 384, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14},
}


def _unused_by_llava(names, tower: str, last_layer: int, feature_layer: int) -> set[str]:
    """HF tensors LLaVA never reads: tower layers after the feature layer,
    the tower's post-layernorm and (SigLIP) its pooling head."""
    after = [f"{tower}encoder.layers.{i}." for i in range(last_layer + feature_layer + 2, last_layer + 1)]
    return {n for n in names if n.startswith((*after, f"{tower}post_layernorm.", f"{tower}head."))}


@pytest.mark.parametrize("name,published,facts", [
    ("llava-1.5-7b", LLAVA_15_7B, dict(
        tokens=576, built=23, excluded_layers=1, padded=32128, hf_total=7_063_427_072,
        fields={"model.hidden_size": 4096, "model.ffn_hidden_size": 11008, "model.norm_epsilon": 1e-5,
                "model.rotary_base": 10000.0, "vision.activation": "quick_gelu", "vision.norm_epsilon": 1e-5,
                "vision.class_token": True})),
    ("qwen2-7b-siglip-384", QWEN2_7B_SIGLIP_384, dict(
        tokens=729, built=27, excluded_layers=0, padded=152064, hf_total=8_060_823_104,
        fields={"model.num_query_groups": 4, "model.add_qkv_bias": True, "model.rotary_base": 1e6,
                "model.norm_epsilon": 1e-6, "vision.activation": "gelu_tanh", "vision.norm_epsilon": 1e-6,
                "vision.class_token": False})),
])
def test_real_size_llava_maps_every_tensor_onto_transformers(name, published, facts):
    """Both models on ``meta`` (no memory), from the published config.json
    (defaults left out, as transformers reads it): every tensor of ours comes
    from the importer's mapping of transformers' own
    ``LlavaForConditionalGeneration`` with the same shape, every HF tensor is
    read except the ones LLaVA never uses, and the parameter counts agree to
    the element."""
    import transformers as T

    from megascale_omni.hf.importer import read_llava
    from megascale_omni.models.standalone import build_model, one_process

    config = T.LlavaConfig(**published)
    with torch.device("meta"):
        hf = T.LlavaForConditionalGeneration(config)
    src = hf_models.ModelSource(hf, config=published)
    imp = read_llava(src, seq_length=4096)
    cfg = from_dict(JobConfig, imp.sections)
    m, v = cfg.model, cfg.vision
    assert (v.tokens_per_image, v.layers_built, m.padded_vocab_size(m.vocab_size)) == (
        facts["tokens"], facts["built"], facts["padded"])
    # Values the published files leave to transformers' defaults (hidden_act, layer_norm_eps, ...).
    got = {f: getattr(getattr(cfg, f.split(".")[0]), f.split(".")[1]) for f in facts["fields"]}
    assert got == facts["fields"]
    with one_process(), torch.device("meta"):
        ours = build_model(cfg, m.padded_vocab_size(m.vocab_size), int(config.image_token_index))
    own = {k: tuple(t.shape) for k, t in ours.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(own) == sorted(imp.state)
    wrong = {k: (s, tuple(imp.state[k].shape)) for k, s in own.items() if tuple(imp.state[k].shape) != s}
    assert not wrong, wrong

    hf_params = dict(hf.named_parameters())
    tower = src.find_prefix("embeddings.patch_embedding.weight")
    unused = _unused_by_llava(hf_params, tower, config.vision_config.num_hidden_layers - 1,
                              config.vision_feature_layer)
    assert set(src.tensors) - src.read == unused  # exactly these are left out, nothing else
    per_layer = 16  # q, k, v, out, fc1, fc2 weight + bias, two norms' weight + bias
    # SigLIP's pooling head: probe, attention in/out projections, layernorm, MLP (weight + bias each).
    head = 1 + 4 + 2 + 4 if v.model_type == "siglip" else 0
    assert len(unused) == facts["excluded_layers"] * per_layer + 2 + head  # + the post-layernorm
    excluded = sum(hf_params[n].numel() for n in unused)
    padding = (m.padded_vocab_size(m.vocab_size) - m.vocab_size) * m.hidden_size * 2  # embedding + output rows
    ours_total = sum(p.numel() for p in ours.parameters())
    hf_total = sum(p.numel() for p in hf.parameters())
    print(f"\n{name}: transformers {hf_total:,} parameters, ours {ours_total:,} "
          f"(- {padding:,} vocabulary padding, + {excluded:,} that LLaVA never reads)")
    assert hf_total == facts["hf_total"]  # the published model's size: the configs are the real ones
    assert ours_total - padding == hf_total - excluded


@pytest.mark.parametrize("key,value,words", [
    ("patch_size", 40, "patch_size=40: must be an int in [1, image_size=32]"),
    ("image_size", [32, 48], "image_size=[32, 48]: must be one positive int"),
    ("num_attention_heads", 5, "hidden_size=32: must be divisible by num_attention_heads=5"),
])
def test_bad_tower_geometry_exits_2_with_one_line(tmp_path, key, value, words):
    import json

    hf_models.causal_lm("llama", tmp_path / "lm")
    hf_models.vision_tower("siglip", tmp_path / "tower")
    config = json.loads((tmp_path / "tower" / "config.json").read_text())
    config[key] = value
    (tmp_path / "tower" / "config.json").write_text(json.dumps(config))
    r = run_tool_in_process("tools/hf_import.py", "--llm", tmp_path / "lm", "--vision", tmp_path / "tower",
                            "--out", tmp_path / "out")
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


# ------------------------------------------------ real widths, fewer layers
def _one_image_batch(image_token: int, grid: int, size: int, vocab: int, seed: int = 0):
    """``[1, grid**2 + 24]`` tokens with one image's placeholders after 8 text tokens, and its pixels."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(6, vocab, (1, grid * grid + 24), generator=g)
    tokens[tokens == image_token] = 6
    tokens[0, 8 : 8 + grid * grid] = image_token
    return tokens, torch.randn(1, 3, size, size, generator=g)


def test_clip_l_336_llava_at_real_width_matches_transformers(tmp_path):
    """CLIP-L/14-336's width and geometry (1024 wide, 24 x 24 patches + class
    token), 2 layers read at -2 as LLaVA-1.5 does, under a tiny Llama."""
    src, ours = tmp_path / "hf", tmp_path / "ours"
    hf = hf_models.llava(src, text="llama", tower="clip", feature_layer=-2, image_token=IMAGE_TOKEN, layers=2,
                         **hf_models.CLIP_L_336)
    tool_main("hf_import.py", "--llava", src, "--out", ours)
    tokens, pixels = _one_image_batch(IMAGE_TOKEN, 24, 336, hf_models.VOCAB)
    with torch.no_grad():
        ref = hf(input_ids=tokens, pixel_values=pixels).logits
    diff = (our_logits(ours, tokens, pixels, image_token=IMAGE_TOKEN) - ref).abs().max().item()
    print(f"\nCLIP-L/336 (2 layers) LLaVA: max abs logit difference {diff:.2e}")
    assert diff <= LOGIT_ATOL


def _model_state(path) -> dict[str, torch.Tensor]:
    """One-process model tensors of a checkpoint (import output or training run)."""
    from megascale_omni.checkpoint.pretrained import load_model_weights, open_model_checkpoint
    from megascale_omni.models.standalone import build_model, one_process

    ckpt = open_model_checkpoint(path, "test")
    m = ckpt.cfg.model
    with one_process():
        model = build_model(ckpt.cfg, m.padded_vocab_size(m.vocab_size))
        load_model_weights([model], ckpt, "test")
        return {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


STEPS = 5


def test_siglip_so400m_384_plus_qwen2_imports_trains_and_exports(tmp_path):
    """SigLIP-so400m-patch14-384's width and geometry (1152 wide, 27 x 27
    patches, 6 unused pixel rows/columns), one layer, with a tiny Qwen2 (QKV
    bias, tied embeddings): ``--llm`` + ``--vision`` import, LLaVA stage 1
    (projector only, fresh) with pretrain_llava.py on 384 px shapes images,
    then the trained checkpoint exports to a transformers LLaVA whose logits
    match ours. As tests/dist/test_pretrained_training.py's stage 1: the
    frozen LM and tower stay bit-identical, the projector changes and the
    loss falls (here on the same one-sample batch every step)."""
    import transformers

    from megascale_omni.data.tokenizer import TextTokenizer
    from megascale_omni.demo.llava_shapes import make_shapes_dataset
    from tests.launcher import train_and_read

    data = tmp_path / "shapes"
    make_shapes_dataset(data, num_train=1, num_val=1, seed=7, image_size=384, samples_per_shard=1)
    tok = TextTokenizer.from_path(data / "tokenizer.json")
    hf_models.causal_lm("qwen2", tmp_path / "lm", vocab=tok.vocab_size, seed=3)
    hf_models.vision_tower("siglip", tmp_path / "tower", seed=4, layers=1, **hf_models.SIGLIP_SO400M_384)
    imported = tmp_path / "imported"
    tool_main("hf_import.py", "--llm", tmp_path / "lm", "--vision", tmp_path / "tower", "--out", imported,
              "--seq-length", 2048)

    out = tmp_path / "run"
    records = train_and_read("pretrain_llava.py", 1, [
        "--config", "examples/llava/tiny_cpu.yaml", "--config", str(imported / "model.yaml"), f"data.path={data}",
        f"train.steps={STEPS}", "train.eval_interval=0", "train.global_batch_size=1", "train.micro_batch_size=1",
        "train.lr=1e-2", "train.lr_warmup_steps=0", "model.freeze=true", "vision.freeze=true",
        f"checkpoint.dir={out}/checkpoints",
    ], out, STEPS, timeout=400)
    losses = [r["loss"] for r in records]
    print(f"\nSigLIP-so400m/384 (1 layer) + Qwen2 stage 1: losses {[round(x, 3) for x in losses]}")
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.1, losses

    before, after = _model_state(imported), _model_state(out / "checkpoints")
    assert set(before) == set(after) and after["vision_model.conv1.weight"].shape == (1152, 3, 14, 14)
    frozen = [k for k in before if not k.startswith("vision_projection.")]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert all(not torch.equal(before[k], after[k]) for k in before if k.startswith("vision_projection."))

    # An LLM + tower import records no image token: the export names the dataset tokenizer's.
    tool_main("hf_export.py", "--checkpoint", out / "checkpoints", "--out", out / "hf",
              "--image-token-id", tok.image_token_id)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(str(out / "hf")).eval()
    assert hf.config.image_seq_length == 729 and hf.config.vision_config.image_size == 384
    image_token = hf.config.image_token_index
    assert image_token == tok.image_token_id
    tokens, pixels = _one_image_batch(image_token, 27, 384, tok.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf(input_ids=tokens, pixel_values=pixels).logits
    diff = (our_logits(out / "checkpoints", tokens, pixels, image_token) - ref).abs().max().item()
    print(f"exported after training: max abs logit difference {diff:.2e}")
    assert diff <= LOGIT_ATOL
