"""examples/recipes/: every recipe, as shipped, validates at 8 and 64 GPUs
through the entry points' parse path and fits 80 GB per GPU by the memory
estimate (a layout that does not fit is refused at start with one line,
exit 2); its full-size model builds on the meta device with the published
parameter count (transformers / diffusers built from the same config are the
outside reference); the README's throughput figures are the step record's
FLOP count; and each recipe trains 5 steps on CPU at reduced width."""

from __future__ import annotations

import itertools
import json
import math
import sys

import numpy as np
import pytest
import torch

from megascale_omni.config import ConfigError, load_yaml
from megascale_omni.data.dit.reader import encode_latent_record, write_dit_dataset
from megascale_omni.data.image_preprocess import ImagePreprocessor
from megascale_omni.entry import parse_for_family
from megascale_omni.metrics.flops import step_model_flops
from megascale_omni.models.standalone import build_model, one_process, single_process_config
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.parallel.pipeline_plan import GIB, plan_pipeline
from megascale_omni.tasks.registry import estimate_memory_per_gpu
from tests.launcher import REPO, finish, kill_group, read_training, spawn, start_training

RECIPES = REPO / "examples" / "recipes"
STAGE1, STAGE2 = "llava15_7b_stage1.yaml", "llava15_7b_stage2.yaml"
ANYRES, DIT = "qwen2_7b_siglip_anyres.yaml", "dit_xl2_256.yaml"
#: Per-GPU memory estimate (GiB, bf16, fullest pp rank; weights, gradients,
#: optimizer state and activations) of each recipe as shipped, at 8 and 64
#: GPUs: the numbers examples/recipes/README.md quotes.
PEAK_GIB = {
    (STAGE1, 8): 23.99, (STAGE1, 64): 23.96,
    (STAGE2, 8): 56.35, (STAGE2, 64): 48.09,
    (ANYRES, 8): 46.54, (ANYRES, 64): 36.72,
    (DIT, 8): 19.55, (DIT, 64): 19.55,
}


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    """A directory laid out as the README's commands leave a job's inputs:
    each recipe's ``data.path`` with a ``train/`` split and its tokenizer
    directory (empty stand-ins: validation reads paths, not contents), and
    ``examples/`` of this checkout. The tests validate the shipped files
    from there, unmodified."""
    root = tmp_path_factory.mktemp("job")
    for name in (STAGE1, STAGE2, ANYRES, DIT):
        data = load_yaml(RECIPES / name)["data"]
        (root / data["path"] / "train").mkdir(parents=True, exist_ok=True)
        if data.get("tokenizer"):
            (root / data["tokenizer"]).mkdir(parents=True, exist_ok=True)
    (root / "examples").symlink_to(REPO / "examples")
    return root


@pytest.fixture(autouse=True)
def _in_job_dir(job_dir, monkeypatch):
    monkeypatch.chdir(job_dir)


def recipe(name: str, world: int, *overrides: str):
    """``(cfg, family)`` of a shipped recipe, validated for ``world`` ranks
    exactly as ``pretrain_*.py`` validates it."""
    family = load_yaml(RECIPES / name)["model"]["family"]
    return parse_for_family(family, ["--config", str(RECIPES / name), *overrides], world_size=world)


def planned_gib(cfg, family, world: int) -> float:
    """The start-up check's per-GPU figure on CUDA, GiB (raises its ConfigError
    when over ``parallel.pipeline_memory_gib``)."""
    return plan_pipeline(cfg, family.cost_model_fn(cfg), cuda=True, world_size=world).peak_memory / GIB


@pytest.mark.parametrize("name,world", sorted(PEAK_GIB))
def test_recipe_validates_and_fits_80gb(name, world):
    cfg, family = recipe(name, world)
    assert cfg.parallel.pipeline_memory_gib == 80 and cfg.train.precision == "bf16"
    stages = estimate_memory_per_gpu(cfg, cuda=True, world_size=world)
    assert round(max(s.total_gib for s in stages), 2) == PEAK_GIB[name, world]
    # The start-up check sums the same and lets it through.
    assert planned_gib(cfg, family, world) == pytest.approx(max(s.total_gib for s in stages), rel=1e-9)
    dp = world // cfg.parallel.model_parallel_size
    accumulation = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    assert accumulation * cfg.train.micro_batch_size * dp == cfg.train.global_batch_size
    if name == DIT:  # the paper's 256 images per step: packages x images per package
        assert cfg.train.global_batch_size * cfg.dit.token_budget // 256 == 256


def test_recipes_published_settings():
    """The numbers the README cites, as the files state them."""
    s1, _ = recipe(STAGE1, 8)
    s2, _ = recipe(STAGE2, 8)
    any_, _ = recipe(ANYRES, 8)
    dit, _ = recipe(DIT, 8)
    # Stage 1 and 2 train the same architecture; only what trains and the row length differ.
    def arch(c):
        return ({k: v for k, v in vars(c.model).items() if k not in ("freeze", "recompute", "seq_length")},
                {k: v for k, v in vars(c.vision).items() if k != "images_per_sequence"})

    assert arch(s1) == arch(s2)
    assert (s1.model.freeze, s1.vision.freeze, s1.vision.freeze_projector) == (True, True, False)
    assert (s2.model.freeze, s2.vision.freeze, s2.vision.freeze_projector) == (False, True, False)
    assert (s1.train.lr, s2.train.lr, s1.train.weight_decay, s2.train.weight_decay) == (1e-3, 2e-5, 0.0, 0.0)
    # warmup_ratio 0.03 of one epoch (558k / 256 and 665k / 128 samples per step).
    assert s1.train.steps == math.ceil(558_128 / 256) and s1.train.lr_warmup_steps == math.ceil(0.03 * 2181)
    assert s2.train.steps == math.ceil(665_298 / 128) and s2.train.lr_warmup_steps == math.ceil(0.03 * 5198)
    assert s1.vision.tokens_per_image == 576 and s1.vision.layers_built == 23
    assert any_.vision.tokens_per_image == 729 and any_.vision.layers_built == 26
    assert any_.train.lr * any_.vision.lr_mult == pytest.approx(2e-6)
    # A 640 x 480 photo: the 768 x 768 grid, 4 tiles + the overview, 3645 tokens in a 4096-token row.
    tiles = ImagePreprocessor.from_config("anyres", any_.vision.image_size, REPO / any_.data.image_processor)
    assert tiles.num_views((480, 640)) == 5 and tiles(np.zeros((480, 640, 3), np.uint8)).shape == (5, 3, 384, 384)
    assert 5 * any_.vision.tokens_per_image == 3645 < any_.model.seq_length
    assert (dit.train.lr, dit.train.lr_decay_style, dit.dit.ema_decay) == (1e-4, "constant", 0.9999)


#: name -> (a global batch of typical samples, its tokens (DiT: images), model
#: GFLOPs per token (DiT: per image), tokens (images) per second of one H100 at
#: MFU 0.4), as examples/recipes/README.md quotes them.
THROUGHPUT = {
    STAGE1: (BatchShape(segments=(592,) * 100, tower_inputs=100), 592 * 100, 27.4, 14_400),
    STAGE2: (BatchShape(segments=(900,) * 100, tower_inputs=100), 900 * 100, 40.8, 9_700),
    ANYRES: (BatchShape(segments=(4096,) * 10, tower_inputs=50), 4096 * 10, 47.3, 8_400),
    DIT: (BatchShape(dit_packages=((256, 4),) * 10), 40, 835, 474),
}


@pytest.mark.parametrize("name", sorted(THROUGHPUT))
def test_expected_throughput_is_the_step_records_flop_count(name):
    cfg, family = recipe(name, 8)
    batch, units, gflop, per_gpu = THROUGHPUT[name]
    flops = step_model_flops(cfg, family.cost_model_fn(cfg), batch) / units
    assert round(flops / 1e9, 1 if gflop < 100 else 0) == gflop
    rate = 0.4 * 989e12 / flops  # H100 SXM dense bf16 peak
    assert round(rate, -2 if per_gpu > 1000 else 0) == per_gpu


@pytest.mark.parametrize("overrides,words", [
    # ZeRO-less Adam on 8 GPUs: 18 bytes per parameter does not fit 80 GB.
    (["parallel.use_distributed_optimizer=false"],
     ["parallel.pipeline_memory_gib=80.0", "122.463 GiB", "set parallel.use_distributed_optimizer=true",
      "56.351 GiB", "parallel.pp=2"]),
    # A 40 GB card.
    (["parallel.pipeline_memory_gib=40"],
     ["parallel.pipeline_memory_gib=40.0", "56.351 GiB", "parallel.pp=2 (smallest pp that fits)"]),
])
def test_stage2_on_too_little_memory_is_refused_with_the_fix(overrides, words):
    cfg, family = recipe(STAGE2, 8, *overrides)
    with pytest.raises(ConfigError) as err:
        planned_gib(cfg, family, 8)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("launcher", ["entry", "omni-run"])
def test_entry_point_refuses_stage2_without_distributed_optimizer(tmp_path, job_dir, launcher):
    """The same refusal through ``pretrain_llava.py`` (before any process
    group; WORLD_SIZE=8, one process) and through ``omni-run`` for 8 workers
    (before any worker starts): exit 2, one line, no traceback."""
    job = [str(REPO / "pretrain_llava.py"), "--config", str(RECIPES / STAGE2),
           "parallel.use_distributed_optimizer=false", f"logging.output_dir={tmp_path}"]
    if launcher == "entry":
        proc = spawn([sys.executable, *job], timeout=120, env={"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0"},
                     cwd=job_dir)
    else:
        proc = spawn([sys.executable, "-m", "megascale_omni.launch", "--standalone", "--nproc-per-node", "8", *job],
                     timeout=120, cwd=job_dir)
    res = finish(proc, 120)
    lines = [line for line in res.stderr.splitlines() if line.startswith("config error:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "worker" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1 and "parallel.pipeline_memory_gib=80.0" in lines[0]
    assert "set parallel.use_distributed_optimizer=true" in lines[0]


def _vicuna_like_tokenizer(path, corpus):
    """A tiny Llama-style fast tokenizer (``<unk> <s> </s>``, no chat template)
    trained on ``corpus`` (so that no character of it is unknown, as with
    Vicuna's byte fallback), saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                    show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))


@pytest.mark.parametrize("template,rendered,answers", [
    # Stage 1, LLaVA's "plain": the image, then the caption; no system prompt or user text.
    ("llava_plain.jinja", "<s><image>a red circle\n", ["a red circle\n"]),
    # Stage 2, Vicuna v1: system prompt, USER / ASSISTANT, </s> after each answer.
    ("vicuna_v1.jinja", "<s>A chat between a curious human and an artificial intelligence assistant. The "
     "assistant gives helpful, detailed, and polite answers to the human's questions. USER: <image>\nRender "
     "a clear and concise summary of the photo. ASSISTANT: a red circle</s>USER: left? ASSISTANT: left</s>",
     ["a red circle</s>", "left</s>"]),
])
def test_llava15_chat_templates_mask_the_answers(tmp_path, template, rendered, answers):
    from megascale_omni.data.conversation import ChatEncoder

    _vicuna_like_tokenizer(tmp_path, [rendered.replace("<s>", "").replace("</s>", "").replace("<image>", "")])
    (tmp_path / "chat_template.jinja").write_text((RECIPES / template).read_text())
    cfg, _ = recipe(STAGE1 if "plain" in template else STAGE2, 8)
    enc = ChatEncoder.from_pretrained(tmp_path, cfg.data.image_token, cfg.vision.tokens_per_image)
    conv = [{"from": "human", "value": "<image>\nRender a clear and concise summary of the photo."},
            {"from": "gpt", "value": "a red circle"}]
    if "vicuna" in template:
        conv += [{"from": "human", "value": "left?"}, {"from": "gpt", "value": "left"}]
    assert enc.tok.apply_chat_template([{"role": t["from"].replace("human", "user").replace("gpt", "assistant"),
                                         "content": t["value"]} for t in conv], tokenize=False) == rendered
    out = enc.encode(conv, num_images=1)
    # The 576 placeholders are Vicuna's <unk> (id 0): byte fallback never produces it from text.
    assert enc.image_token_id == 0 and out.tokens.count(0) == 576
    spans = [[t for t, _ in run] for m, run in itertools.groupby(zip(out.tokens, out.loss_mask), key=lambda x: x[1])
             if m]
    assert [enc.tok.decode(ids) for ids in spans] == answers, [enc.tok.decode(ids) for ids in spans]


#: The config.json fields of the published checkpoints the recipes import
#: (lmsys/vicuna-7b-v1.5, openai/clip-vit-large-patch14-336's vision_config,
#: Qwen/Qwen2-7B-Instruct, google/siglip-so400m-patch14-384's vision_config).
VICUNA = dict(model_type="llama", hidden_act="silu", hidden_size=4096, intermediate_size=11008,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
              max_position_embeddings=4096, vocab_size=32000, tie_word_embeddings=False, rope_scaling=None)
CLIP_336 = dict(model_type="clip_vision_model", hidden_act="quick_gelu", hidden_size=1024, intermediate_size=4096,
                num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14, layer_norm_eps=1e-5)
QWEN2_7B = dict(model_type="qwen2", hidden_act="silu", hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
                rope_theta=1000000.0, max_position_embeddings=32768, vocab_size=152064, tie_word_embeddings=False,
                use_sliding_window=False, sliding_window=131072)
SIGLIP_384 = dict(model_type="siglip_vision_model", hidden_act="gelu_pytorch_tanh", hidden_size=1152,
                  intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=384,
                  patch_size=14, layer_norm_eps=1e-6)


@pytest.mark.parametrize("name,text,tower", [(STAGE1, VICUNA, CLIP_336), (ANYRES, QWEN2_7B, SIGLIP_384)])
def test_recipe_loads_the_weights_tools_hf_import_writes(name, text, tower):
    """``checkpoint.pretrained`` accepts the import: the model/vision sections
    tools/hf_import.py writes for the published configs (``--feature-layer -2``)
    match the recipe's up to the fields that may change when starting from weights."""
    from megascale_omni.checkpoint.state import PRETRAINED_FREE_FIELDS, incompatibilities
    from megascale_omni.config import from_dict, to_dict
    from megascale_omni.config.schema import JobConfig
    from megascale_omni.hf.importer import _llava_sections

    imported = from_dict(JobConfig, _llava_sections(text, tower, 2048, -2, "config.json"))
    cfg, _ = recipe(name, 8)
    assert incompatibilities(to_dict(imported), cfg, PRETRAINED_FREE_FIELDS) == []
    if name == STAGE1:  # stage 2 starts from stage 1's checkpoints
        assert incompatibilities(to_dict(cfg), recipe(STAGE2, 8)[0], PRETRAINED_FREE_FIELDS) == []


# ------------------------------------------------- full-size models on meta


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _ours(name: str) -> torch.nn.Module:
    cfg = single_process_config(recipe(name, 8)[0])
    with one_process(), torch.device("meta"):
        if cfg.model.family == "dit":
            from megascale_omni.models.dit.model import build_dit_chunks

            return build_dit_chunks(cfg, torch.bfloat16, 0)[0]
        return build_model(cfg, cfg.model.padded_vocab_size(cfg.model.vocab_size))


def _hf_llava(vision, text, feature_layer):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    with torch.device("meta"):
        return LlavaForConditionalGeneration(
            LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=feature_layer,
                        projector_hidden_act="gelu"))


def test_llava15_7b_has_the_published_parameter_count():
    from transformers import CLIPVisionConfig, LlamaConfig

    ours = _ours(STAGE2)
    assert next(ours.parameters()).device.type == "meta"
    hf = _hf_llava(CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                    num_attention_heads=16, image_size=336, patch_size=14, hidden_act="quick_gelu"),
                   LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32), -2)
    assert _count(hf) == 7_062_902_784  # llava-hf/llava-1.5-7b-hf with Vicuna's 32000-token vocabulary
    tower = hf.model.vision_tower
    # We build the tower up to feature_layer -2: its last layer and post-norm never reach the LM.
    unused = _count(tower.encoder.layers[-1]) + _count(tower.post_layernorm)
    assert _count(ours) == _count(hf) - unused == 7_050_304_512
    assert _count(ours.language_model) == 6_738_415_616  # Vicuna-7B (Llama-2-7B shape)
    assert _count(ours.vision_projection) == _count(hf.model.multi_modal_projector) == 20_979_712


def test_qwen2_7b_siglip_has_the_published_parameter_count():
    from transformers import Qwen2Config, SiglipVisionConfig

    ours = _ours(ANYRES)
    hf = _hf_llava(SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                      num_attention_heads=16, image_size=384, patch_size=14,
                                      hidden_act="gelu_pytorch_tanh"),
                   Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False), -2)
    tower = hf.model.vision_tower
    assert _count(hf.model.language_model) + _count(hf.lm_head) == 7_615_616_512  # Qwen2-7B
    assert _count(hf.model.vision_tower) == 428_225_600  # siglip-so400m-patch14-384
    # Not built: the layer after feature_layer -2, the post-norm and the pooling head.
    unused = _count(tower.encoder.layers[-1]) + _count(tower.post_layernorm) + _count(tower.head)
    assert _count(ours) == _count(hf) - unused == 8_030_342_944


def test_dit_xl2_parameter_count_against_the_paper_model():
    """diffusers' DiT-XL/2 gives the paper's blocks; ours adds cross-attention
    and text conditioning and drops the class embedding and learned variance."""
    from diffusers import DiTTransformer2DModel

    ours = _ours(DIT)
    with torch.device("meta"):
        ref = DiTTransformer2DModel(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                                    num_layers=28, sample_size=32, patch_size=2, num_embeds_ada_norm=1000)
    h, blocks = 1152, 28
    block, ref_block = ours.layers._modules["0"], ref.transformer_blocks[0]
    assert _count(block.self_attention) == _count(block.cross_attention) == _count(ref_block.attn1)
    assert _count(block.mlp) == _count(ref_block.ff) and _count(ours.x_embedder) == _count(ref.pos_embed)
    assert _count(ours.final_adaln) == _count(ref.proj_out_1)
    # diffusers repeats the timestep + class embedders inside every block's
    # adaLN and keeps positions in a buffer; the paper's model has them once
    # and counts its fixed position table as a parameter: 675,129,632.
    embedders = _count(ref_block.norm1.emb)
    paper = _count(ref) - (blocks - 1) * embedders + 256 * h
    assert paper == 675_129_632
    paper_adaln = _count(ref_block.norm1.linear)  # 6h outputs; ours modulates 3 branches: 9h
    ours_minus_paper = (
        blocks * (_count(block.cross_attention) + _count(block.adaln) - paper_adaln)
        + _count(ours.t_embedder) + _count(ours.text_proj) + _count(ours.pooled_embedder)
        - embedders  # paper: timestep MLP + 1001-row class table
        - 256 * h  # fixed sin-cos positions, computed on the fly here
        - _count(ref.proj_out_2) + _count(ours.final_linear)  # no learned variance: C p p outputs, not 2 C p p
    )
    assert _count(ours) == paper + ours_minus_paper == 949_789_456


# ------------------------------------------------ reduced width on the CPU

#: Every LLaVA recipe at toy width on the embedded shapes data (word-level
#: tokens): what stays is the recipe's structure (tower type, patch 14,
#: feature layer, projector, freezing, image mode, tp and sequence
#: parallelism, optimizer and schedule, bf16).
LLAVA_SMALL = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
    "model.vocab_size=0", "model.seq_length=256", "vision.num_layers=2", "vision.hidden_size=32",
    "vision.num_attention_heads=2", "vision.ffn_hidden_size=64", "vision.image_size=28",
    "data.path=null", "data.format=words", "data.tokenizer=null", "data.image_token=<image>",
    "data.num_workers=0", "data.default_num_train=200", "data.default_num_val=20", "data.image_processor=null",
    "train.steps=5", "train.global_batch_size=2", "train.micro_batch_size=1",
    "train.evaluator=none", "checkpoint.dir=''", "checkpoint.interval=0", "checkpoint.pretrained=''",
]
DIT_SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
             "dit.text_dim=16", "train.steps=5", "train.global_batch_size=2", "checkpoint.dir=''",
             "checkpoint.interval=0"]


def _latents(root, n=24, text_dim=16):
    """A tiny set shaped like tools/make_dit_latents.py output: 4 x 32 x 32
    latents with precomputed caption states."""
    rng = np.random.default_rng(0)
    records = [encode_latent_record(i, rng.standard_normal((4, 32, 32)), f"a photo of class {i % 3}",
                                    rng.standard_normal((3 + i % 4, text_dim))) for i in range(n)]
    write_dit_dataset(root, {"train": records}, {"kind": "latents", "in_channels": 4, "text": "precomputed",
                                                 "text_dim": text_dim}, samples_per_shard=12)
    return root


@pytest.mark.timeout(400)
def test_recipes_train_five_steps_at_reduced_width(tmp_path):
    # SigLIP's 384/14 geometry at toy size: 30 px over 14 px patches is a 2 x 2 grid.
    anyres = tmp_path / "anyres.json"
    conf = json.loads((RECIPES / "siglip_so400m_384_anyres.json").read_text())
    conf.update(size={"height": 30, "width": 30}, image_grid_pinpoints=[[30, 60], [60, 30], [60, 60], [90, 30]])
    anyres.write_text(json.dumps(conf))
    assert ImagePreprocessor.from_config("anyres", 30, anyres).num_views((30, 30)) == 3  # a 30 x 60 grid + overview
    runs = {  # name: (entry point, processes, overrides)
        STAGE1: ("pretrain_llava.py", 1, LLAVA_SMALL),
        STAGE2: ("pretrain_llava.py", 1, LLAVA_SMALL),
        # As shipped: tp=2 with sequence parallelism, on 2 processes.
        ANYRES: ("pretrain_llava.py", 2, [*LLAVA_SMALL, "model.num_query_groups=2", "vision.image_size=30",
                                          f"data.image_processor={anyres}"]),
        DIT: ("pretrain_dit.py", 1, [*DIT_SMALL, f"data.path={_latents(tmp_path / 'latents')}"]),
    }
    # Started together: the runs share the 2 cores (the 28 px LLaVA runs share one embedded set).
    out = {name: tmp_path / f"run{i}" for i, name in enumerate(runs)}  # short: the control socket lives there
    procs = {name: start_training(entry, nproc, ["--config", str(RECIPES / name), *args], out[name], timeout=300)
             for name, (entry, nproc, args) in runs.items()}
    try:
        for name, proc in procs.items():
            records = read_training(proc, out[name], 5, timeout=300)
            cfg = recipe(name, runs[name][1], *runs[name][2])[0]
            assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records), (name, records)
            # The recipe's schedule: linear warm-up from 0 over lr_warmup_steps, step k at
            # lr * (k - 1) / warmup as in HF Trainer's schedules (DiT: constant).
            warmup = cfg.train.lr_warmup_steps
            expected = [cfg.train.lr * min((k - 1) / warmup, 1.0) if warmup else cfg.train.lr for k in range(1, 6)]
            assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-6, abs=1e-12), name
    finally:  # a failed run must not leave the others running
        for proc in procs.values():
            kill_group(proc)
