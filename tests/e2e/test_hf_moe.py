"""Hugging Face MoE interop against ``transformers`` itself (docs/moe.md,
"Hugging Face MoE models").

Tiny random Mixtral, Qwen2-MoE (gated shared expert, raw top-k
probabilities, one dense layer) and Qwen3-MoE (q/k norms, renormalised
top-k, every other layer dense) models, 4 experts top-2, 3 layers, hidden 64,
seeded, norms perturbed and router weights spread (``tests/hf_models.py``).
Claims checked, fp32, one process:

- every MoE layer routes every token to the same experts as ``transformers``
  (exactly; a mismatch reports the token's score gap between its k-th and
  (k+1)-th expert, so a near-tie flip says so instead of hiding in a
  tolerance);
- logits within 1e-4 max abs (measured ~1.5e-7), greedy tokens equal to
  ``generate``'s (checked on HF's greedy sequence, one forward); the
  opposite ``moe.pre_softmax`` moves the logits by more than 10 times the
  tolerance, so the per-family router setting is what matches;
- import -> export reproduces every HF tensor bit-exactly, the mapped config
  fields, and ``transformers`` loads the export with identical logits;
- an MoE LLaVA (CLIP + Qwen2-MoE text config) through ``--llava``, and a
  Qwen2-MoE + SigLIP through ``--llm --vision``;
- (slow) Mixtral-8x7B and Qwen1.5-MoE-A2.7B from their published configs on
  ``meta``: every tensor mapped with its shape, parameter counts equal.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from tests import hf_models
from tests.hf_models import our_logits, tool_main
from tests.launcher import run_tool_in_process

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4
#: HF config fields an export must reproduce for each family.
MAPPED_FIELDS = {
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size", "router_aux_loss_coef",
                "hidden_size", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "router_aux_loss_coef", "qkv_bias",
                  "hidden_size", "num_hidden_layers", "tie_word_embeddings"),
    "qwen3_moe": ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                  "norm_topk_prob", "router_aux_loss_coef", "hidden_size", "num_hidden_layers", "rms_norm_eps"),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-moe")


@contextlib.contextmanager
def our_model(ckpt_dir: Path):
    """Our one-process model of an imported checkpoint and the routing maps
    its routers produce: a list per layer number of ``[tokens, experts]``
    bool tensors, one per forward."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megascale_omni.checkpoint.pretrained import load_model_weights, open_model_checkpoint
    from megascale_omni.models.standalone import build_model, one_process

    ckpt = open_model_checkpoint(ckpt_dir, "test")
    cfg = ckpt.cfg
    routes: dict[int, list[torch.Tensor]] = {}
    with one_process():
        model = build_model(cfg, cfg.model.padded_vocab_size(cfg.model.vocab_size))
        load_model_weights([model], ckpt, "test")
        model.eval()
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(
                    lambda mod, inputs, out: routes.setdefault(mod.layer_number - 1, []).append(out[1].clone()))
        yield model, routes


def check_routing(hf_router_logits, routes: dict, pattern: list[int], topk: int) -> float:
    """Assert our routers chose HF's experts for every token of every MoE
    layer; returns the smallest gap between a token's k-th and (k+1)-th
    router logit (how far the test's routing is from a tie)."""
    layers = [i for i, v in enumerate(pattern) if v]
    assert sorted(routes) == layers and len(hf_router_logits) == len(layers)
    smallest = float("inf")
    for layer, logits in zip(layers, hf_router_logits):
        ranked = logits.float().sort(dim=-1, descending=True).values
        gap = ranked[:, topk - 1] - ranked[:, topk]
        theirs = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(topk, dim=-1).indices, True)
        ours = routes[layer][0]
        differ = (ours != theirs).any(dim=-1).nonzero().flatten().tolist()
        assert not differ, (f"layer {layer}: tokens {differ[:8]} routed differently; their top-{topk} score gaps "
                            f"{gap[differ[:8]].tolist()} (a near-tie flip, not a mapping error, if these are ~1e-7)")
        smallest = min(smallest, float(gap.min()))
    return smallest


def ensure_source(hf_dir: Path, kind: str) -> Path:
    """``hf_dir/<kind>``, the tiny HF model, built unless a test already did
    (every test runs on its own, none is skipped for ordering)."""
    src = hf_dir / kind
    if not src.exists():
        hf_models.causal_lm(kind, src)
    return src


def ensure_moe_import(hf_dir: Path, kind: str) -> tuple[Path, Path]:
    src, ours = ensure_source(hf_dir, kind), hf_dir / f"{kind}-ours"
    if not ours.exists():
        tool_main("hf_import.py", "--llm", src, "--out", ours)
    return src, ours


@pytest.mark.parametrize("kind", hf_models.MOE_KINDS)
def test_moe_decoder_matches_transformers_and_round_trips_bit_exactly(hf_dir, kind):
    from safetensors.torch import load_file

    from megascale_omni.models.generation import logits

    src, ours_dir = ensure_moe_import(hf_dir, kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src)).eval()
    moe = yaml_sections(ours_dir)["moe"]
    pattern = [1] * hf.config.num_hidden_layers if moe["layer_freq"] == 1 else moe["layer_freq"]
    assert pattern == hf_models_pattern(hf)
    # Row 0: a 6-token prompt and HF's 8 greedy tokens after it; row 1: random tokens.
    tokens = torch.randint(0, hf_models.VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens[0] = hf.generate(tokens[:1, :6], max_new_tokens=8, do_sample=False, pad_token_id=0,
                                eos_token_id=None)[0]
        ref = hf(tokens, output_router_logits=True)
    expected = tokens[0, 6:].tolist()
    with our_model(ours_dir) as (model, routes), torch.no_grad():
        ours = logits(model, tokens)[..., : hf_models.VOCAB]
        gap = check_routing(ref.router_logits, routes, pattern, moe["topk"])
        # Greedy decoding without a KV cache is the argmax after each prefix; under the causal mask
        # that is the argmax at each position of the whole sequence (tools/generate.py re-runs the prefix).
        greedy = ours[0, 5:13].argmax(-1).tolist()
        # The other router setting (renormalised vs raw top-k probabilities) is measurably another
        # model: megatron's router reads the flag at every forward from the config all modules share.
        model.config.moe_router_pre_softmax = not moe["pre_softmax"]
        other = (logits(model, tokens)[..., : hf_models.VOCAB] - ref.logits).abs().max().item()
    diff = (ours - ref.logits).abs().max().item()
    print(f"\n{kind}: max abs logit diff {diff:.2e}, smallest top-k score gap {gap:.2e}, "
          f"with pre_softmax flipped {other:.2e}")
    assert diff <= LOGIT_ATOL, f"{kind}: max abs logit difference {diff:.3g}"
    assert greedy == expected and len(set(greedy)) > 1
    assert other > 10 * LOGIT_ATOL, f"{kind}: pre_softmax flipped changes the logits by only {other:.3g}"

    out = hf_dir / f"{kind}-exported"
    tool_main("hf_export.py", "--checkpoint", ours_dir, "--out", out)
    original, exported = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, tensor in exported.items():
        assert torch.equal(tensor, original[key]), f"{key} differs after import -> export"
    source_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert out_cfg["architectures"] == source_cfg["architectures"]
    for field in MAPPED_FIELDS[kind]:
        assert out_cfg[field] == source_cfg[field], field
    assert hf_models_pattern(transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(str(out)))) == pattern
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, ref.logits)


def yaml_sections(ours_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((ours_dir / "model.yaml").read_text())


def hf_models_pattern(model) -> list[int]:
    """1 per decoder layer whose MLP is a sparse MoE block in ``model``."""
    return [int(hasattr(layer.mlp, "experts")) for layer in model.model.layers]


def test_moe_llava_imports_exports_and_matches_transformers(hf_dir):
    """``--llava`` with a Qwen2-MoE text config (CLIP tower), and ``--llm
    --vision`` with a Qwen2-MoE LM and a SigLIP tower (fresh projector)."""
    from safetensors.torch import load_file

    from tests.e2e.test_hf_interop import llava_inputs

    src = hf_dir / "llava-moe"
    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        vision_config=hf_models.vision_config("clip"), text_config=hf_models.text_config("qwen2_moe"),
        image_token_index=5, vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=16)
    hf = transformers.LlavaForConditionalGeneration(config)
    hf_models._perturb_norms(hf, 0)
    hf_models._spread_routers(hf, 0)
    hf.eval().save_pretrained(str(src))
    ours_dir = hf_dir / "llava-moe-ours"
    tool_main("hf_import.py", "--llava", src, "--out", ours_dir)
    sections = yaml_sections(ours_dir)
    assert sections["model"]["family"] == "llava" and sections["moe"]["shared_expert_gate"] is True
    tokens, pixels = llava_inputs(image_token=5)
    with torch.no_grad():
        ref = hf(input_ids=tokens, pixel_values=pixels).logits
    diff = (our_logits(ours_dir, tokens, pixels, image_token=5) - ref).abs().max().item()
    print(f"\nMoE LLaVA: max abs logit diff {diff:.2e}")
    assert diff <= LOGIT_ATOL
    out = hf_dir / "llava-moe-exported"
    r = run_tool_in_process("tools/hf_export.py", "--checkpoint", ours_dir, "--out", out)
    assert r.returncode == 0, r.output
    original, exported = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for key, tensor in exported.items():
        assert torch.equal(tensor, original[key]), f"{key} differs after import -> export"
    # Feature layer -2 of 3: only the last tower layer and the post-norm are not carried.
    assert all(k.startswith(("vision_tower.encoder.layers.2.", "vision_tower.post_layernorm"))
               for k in set(original) - set(exported))
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert text["model_type"] == "qwen2_moe" and text["mlp_only_layers"] == [1]

    lm_src = ensure_source(hf_dir, "qwen2_moe")
    hf_models.vision_tower("siglip", hf_dir / "siglip", seed=4)
    # The mapping only (tools/hf_import.py writes it as it wrote --llava's above).
    from megascale_omni.hf.directory import HFDirectory
    from megascale_omni.hf.importer import read_llm, read_llm_and_tower

    imp = read_llm_and_tower(HFDirectory(lm_src, "--llm"), HFDirectory(hf_dir / "siglip", "--vision"), None, 128)
    assert imp.sections["moe"] == read_llm(HFDirectory(lm_src, "--llm"), 128).sections["moe"]
    assert imp.sections["vision"]["model_type"] == "siglip" and imp.fresh == ("vision_projection.",)
    state = imp.state
    source = load_file(str(lm_src / "model.safetensors"))
    fc1 = state["language_model.decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([source["model.layers.2.mlp.experts.3.gate_proj.weight"],
                                       source["model.layers.2.mlp.experts.3.up_proj.weight"]]))
    assert torch.equal(state["language_model.decoder.layers.0.mlp.shared_experts.gate_weight"],
                       source["model.layers.0.mlp.shared_expert_gate.weight"])


# ------------------------------------------------------------------ bad input
def _edit(src: Path, dst: Path, config: dict = None, drop: str = "", add: str = "") -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop or add:
        tensors = load_file(str(dst / "model.safetensors"))
        if drop:
            tensors.pop(drop)
        if add:
            tensors[add] = torch.zeros(48, 64)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("kind,edit,code,words", [
    ("mixtral", dict(config={"router_jitter_noise": 0.1}), 2, "router_jitter_noise=0.1"),
    ("mixtral", dict(config={"hidden_act": "gelu"}), 2, "hidden_act='gelu'"),
    ("qwen2_moe", dict(config={"shared_expert_intermediate_size": 0}), 2, "shared_expert_intermediate_size=0"),
    ("qwen2_moe", dict(config={"num_experts_per_tok": 5}), 2, "moe.topk=5"),
    ("qwen3_moe", dict(config={"attention_bias": True}), 2, "attention_bias=True"),
    ("qwen3_moe", dict(config={"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"]}), 2,
     "OLMoE's q_norm/k_norm normalise all heads together"),
    # An unsupported router: DeepSeek-V3's grouped top-k over sigmoid scores with a correction bias.
    ("qwen3_moe", dict(config={"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}), 2,
     "DeepSeek's multi-latent attention and grouped routing are not mapped"),
    ("qwen2_moe", dict(drop="model.layers.2.mlp.experts.3.down_proj.weight"), 4,
     "model.layers.2.mlp.experts.3.down_proj.weight"),
    ("mixtral", dict(add="model.layers.0.block_sparse_moe.experts.4.w1.weight"), 2,
     "has 1 tensor(s) the import does not map (e.g. model.layers.0.block_sparse_moe.experts.4.w1.weight)"),
])
def test_bad_moe_source_exits_with_one_line_and_writes_nothing(hf_dir, tmp_path, kind, edit, code, words):
    src = ensure_source(hf_dir, kind)
    bad = _edit(src, tmp_path / "bad", **edit)
    out = tmp_path / "out"
    r = run_tool_in_process("tools/hf_import.py", "--llm", bad, "--out", out)
    assert r.returncode == code, r.output
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and words in line, line
    assert not out.exists() and not any(p.name.startswith(".out.") for p in tmp_path.iterdir())


# ------------------------------------------------------- real-size architectures
#: mistralai/Mixtral-8x7B-v0.1's config.json as published.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
}
#: Qwen/Qwen1.5-MoE-A2.7B's config.json as published (Qwen2MoeForCausalLM: 60 experts
#: top-4 with raw probabilities and a gated 5632-wide shared expert).
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def _as_saved(src: hf_models.ModelSource, model_type: str) -> None:
    """Rename ``src``'s tensors from transformers 5's in-memory layout (each
    layer's experts fused into ``experts.gate_up_proj [E, 2I, H]`` and
    ``experts.down_proj [E, H, I]``) to the per-expert names
    ``save_pretrained`` writes and the published checkpoints have (meta
    tensors: names and shapes only)."""
    saved = {}
    for name, t in src.tensors.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            layer = name[: name.index("mlp.experts.")]
            for e in range(t.shape[0]):
                if model_type == "mixtral":
                    parts = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}[name.rsplit(".", 1)[1]]
                    names = [f"{layer}block_sparse_moe.experts.{e}.{w}.weight" for w in parts]
                else:
                    parts = {"gate_up_proj": ("gate_proj", "up_proj"),
                             "down_proj": ("down_proj",)}[name.rsplit(".", 1)[1]]
                    names = [f"{layer}mlp.experts.{e}.{w}.weight" for w in parts]
                for n, piece in zip(names, t[e].chunk(len(names))):
                    saved[n] = piece
        elif model_type == "mixtral" and ".mlp.gate." in name:
            saved[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
        else:
            saved[name] = t
    src.tensors = saved


@pytest.mark.slow  # 26-44 s each here: megatron builds 256 / 1440 experts (on meta)
@pytest.mark.parametrize("published,total", [(MIXTRAL_8X7B, 46_702_792_704), (QWEN15_MOE_A27B, 14_315_784_192)],
                         ids=["mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def test_real_size_moe_maps_every_tensor_onto_transformers(published, total):
    """Mixtral-8x7B and Qwen1.5-MoE-A2.7B from their published config.json,
    both sides on ``meta``: every tensor of ours comes from the mapping with
    its shape, every HF tensor is read, and the parameter counts are equal
    (and the published models')."""
    from megascale_omni.config import JobConfig, from_dict
    from megascale_omni.hf.importer import read_llm
    from megascale_omni.models.standalone import build_model, one_process

    config = transformers.AutoConfig.for_model(**published)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    src = hf_models.ModelSource(hf, config=published)
    _as_saved(src, published["model_type"])
    imp = read_llm(src, seq_length=4096)
    cfg = from_dict(JobConfig, imp.sections)
    m = cfg.model
    assert m.padded_vocab_size(m.vocab_size) == m.vocab_size  # both vocabularies are multiples of 128
    with one_process(), torch.device("meta"):
        ours = build_model(cfg, m.padded_vocab_size(m.vocab_size))
    own = {k: tuple(t.shape) for k, t in ours.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(own) == sorted(imp.state)
    wrong = {k: (s, tuple(imp.state[k].shape)) for k, s in own.items() if tuple(imp.state[k].shape) != s}
    assert not wrong, wrong
    assert src.read == set(src.tensors)
    hf_total = sum(p.numel() for p in hf.parameters())
    ours_total = sum(p.numel() for p in ours.parameters())
    print(f"\n{published['architectures'][0]}: transformers {hf_total:,} parameters, ours {ours_total:,}")
    assert hf_total == ours_total == total


@pytest.mark.timeout(600)  # two training runs (1 and 2 processes) at once
def test_imported_mixtral_trains_from_checkpoint_pretrained_under_ep1_and_ep2_alike(hf_dir, tmp_path):
    """``checkpoint.pretrained`` = a Mixtral import, with training-only router
    settings changed (z-loss, aux-loss coefficient: free when starting from
    weights): EP1 and EP2 route the same tokens to every expert at every step
    and agree on the loss within 1e-6 (the import reshards onto EP2)."""
    from tests.launcher import read_training, start_training

    # A vocabulary of 128 rows: the GPT smoke task builds model.vocab_size rows, unpadded.
    src, ours = tmp_path / "mixtral-128", tmp_path / "mixtral-128-ours"
    hf_models.causal_lm("mixtral", src, vocab=128)
    tool_main("hf_import.py", "--llm", src, "--out", ours)
    args = ["--config", "examples/gpt/tiny_moe.yaml", "--config", str(ours / "model.yaml"), "train.steps=2",
            "model.seq_length=32", "moe.z_loss_coeff=1e-3", "moe.aux_loss_coeff=1e-2"]
    runs = {ep: start_training("megascale_omni.smoke", ep, [*args, f"parallel.ep={ep}"], tmp_path / f"ep{ep}", 300)
            for ep in (1, 2)}
    records = {ep: read_training(proc, tmp_path / f"ep{ep}", 2, 300) for ep, proc in runs.items()}
    for one, two in zip(records[1], records[2]):
        assert one["moe_expert_tokens"] == two["moe_expert_tokens"], one["step"]
        assert abs(one["loss"] - two["loss"]) <= 1e-6 * abs(one["loss"]), (one["loss"], two["loss"])
    assert len(records[1][0]["moe_expert_tokens"]) == 3  # the import's 3 MoE layers, not tiny_moe.yaml's 4
