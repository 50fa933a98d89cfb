"""Hugging Face round trip of a trained model: its tokenizer, chat template
and processor config travel in every checkpoint and come out of the export.

A tiny random ``LlavaForConditionalGeneration`` is saved with a real
``LlavaProcessor`` (a byte-level BPE tokenizer built here with a ChatML
template, a CLIP image processor), imported, trained 2 steps on chat data in
one process, then resumed for one more step under DP2 (another layout).
Both checkpoints export to directories that ``AutoProcessor`` and
``LlavaForConditionalGeneration`` load, whose tokenizer renders and
tokenizes exactly as the source's and whose logits on the processor's own
inputs match our checkpoint's within 1e-4. A tampered tokenizer file makes
the checkpoint unexportable (exit 4, one line). A Qwen2 import exports to
``AutoTokenizer`` + ``AutoModelForCausalLM``; a checkpoint without
tokenizer files exports its weights and names what is missing in one line.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import hf_models
from tests.launcher import REPO, run_tool_in_process, train_and_read
from tests.launcher import run as run_command

pytestmark = [pytest.mark.timeout(600)]
transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4
CARRIED = ("chat_template.jinja", "processor_config.json", "tokenizer.json", "tokenizer_config.json")
CHAT = [{"role": "user", "content": "<image>\nWhat is in the image?"},
        {"role": "assistant", "content": "A red circle on the left."},
        {"role": "user", "content": "How many shapes are there?"}]
TEXTS = ["Describe the picture in detail.", "two squares and a blue triangle <image> Thanks!"]


def _llava_source(path: Path) -> None:
    """A tiny HF LLaVA saved with its processor (tokenizer + chat template + image processor)."""
    tok = hf_models.chat_tokenizer(path)
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                chat_template=tok.chat_template, image_token="<image>").save_pretrained(str(path))
    hf_models.llava(path, text="qwen2", vocab=len(tok), image_token=tok.convert_tokens_to_ids("<image>"), seed=3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(source, run directory): imported, trained 2 steps (1 process), resumed 1 step under DP2."""
    from megascale_omni.demo.llava_shapes import make_shapes_dataset

    root = tmp_path_factory.mktemp("roundtrip")
    _llava_source(root / "src")
    assert sorted(p.name for p in (root / "src").iterdir() if p.name in CARRIED) == list(CARRIED)
    hf_models.tool_main("hf_import.py", "--llava", root / "src", "--out", root / "imported", "--seq-length", 256)
    make_shapes_dataset(root / "data", num_train=40, num_val=4, seed=2, image_size=32, samples_per_shard=40)
    run = root / "run"
    args = ["--config", "examples/llava/tiny_cpu.yaml", "--config", str(root / "imported" / "model.yaml"),
            f"data.path={root / 'data'}", "data.format=chat", f"data.tokenizer={root / 'imported' / 'tokenizer'}",
            "train.global_batch_size=2", "train.micro_batch_size=1", "train.eval_interval=0",
            f"checkpoint.dir={run / 'checkpoints'}"]
    train_and_read("pretrain_llava.py", 1, [*args, "train.steps=2"], run, 2, timeout=300)
    # The resume of step 2 under another layout: its step-3 checkpoint must still carry the files.
    records = train_and_read("pretrain_llava.py", 2, [*args, "train.steps=3"], run, 3, timeout=300)
    assert [r["step"] for r in records] == [1, 2, 3]
    return root / "src", run


def _check_export(src: Path, ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """Export ``ckpt`` to ``out`` with the tool and check it against ``src``;
    returns the exported tensors."""
    from safetensors.torch import load_file

    from megascale_omni.checkpoint import layout

    r = run_tool_in_process("tools/hf_export.py", "--checkpoint", ckpt, "--out", out)
    assert r.returncode == 0, r.output
    assert r.stdout.strip() == f"wrote {out} (weights, config, {', '.join(CARRIED)})"
    step = layout.resolve(ckpt)
    for name in CARRIED:  # byte for byte the source's, and committed with the checkpoint
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
        assert f"tokenizer/{name}" in step.commit["files"], name

    source = transformers.AutoProcessor.from_pretrained(str(src))
    processor = transformers.AutoProcessor.from_pretrained(str(out))
    assert type(processor) is transformers.LlavaProcessor
    tok, ref = processor.tokenizer, source.tokenizer
    assert transformers.AutoTokenizer.from_pretrained(str(out)).get_vocab() == ref.get_vocab()
    for text in TEXTS:
        assert tok(text).input_ids == ref(text).input_ids
    rendered = processor.apply_chat_template(CHAT, add_generation_prompt=True)
    assert rendered == source.apply_chat_template(CHAT, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<image>")
    assert rendered.endswith("<|im_start|>assistant\n")

    image = (np.random.default_rng(0).random((40, 48, 3)) * 255).astype(np.uint8)
    inputs = processor(text=rendered, images=[image], return_tensors="pt")
    ref_inputs = source(text=rendered, images=[image], return_tensors="pt")
    assert torch.equal(inputs["input_ids"], ref_inputs["input_ids"])
    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(out)).eval()
    image_token = model.config.image_token_index
    assert int((inputs["input_ids"] == image_token).sum()) == 16  # (32 / 8)^2 patches, the class token dropped
    with torch.no_grad():
        theirs = model(**inputs).logits
    ours = hf_models.our_logits(ckpt, inputs["input_ids"], inputs["pixel_values"], image_token)
    diff = (ours - theirs).abs().max().item()
    print(f"\n{ckpt.name}: exported LLaVA logits vs our checkpoint: max abs diff {diff:.1e}")
    assert diff <= LOGIT_ATOL
    return load_file(str(out / "model.safetensors"))


def test_trained_and_resumed_checkpoints_export_with_tokenizer_chat_template_and_processor(trained, tmp_path):
    from megascale_omni.checkpoint import layout

    src, run = trained
    saved_dp = [layout.step_info(run / "checkpoints" / layout.step_dir_name(s)).commit["layout"]["dp"] for s in (2, 3)]
    assert saved_dp == [1, 2]  # step 3 was written under another layout than the one it resumed
    step2 = _check_export(src, run / "checkpoints" / "step_00000002", tmp_path / "s2")
    step3 = _check_export(src, run / "checkpoints", tmp_path / "s3")  # the root: its newest, step 3
    source = transformers.LlavaForConditionalGeneration.from_pretrained(str(src)).state_dict()
    # Trained weights, not the import's: the LM changed at every step.
    key = "model.language_model.layers.0.mlp.down_proj.weight"
    trained_key = next(k for k in step2 if k.endswith("layers.0.mlp.down_proj.weight"))
    assert not torch.equal(step2[trained_key], source[key])
    assert not torch.equal(step2[trained_key], step3[trained_key])


def test_a_tampered_tokenizer_file_is_refused_with_one_line(trained, tmp_path):
    _, run = trained
    step = tmp_path / "step_00000003"
    shutil.copytree(run / "checkpoints" / "step_00000003", step)
    config = step / "tokenizer" / "tokenizer_config.json"
    text = config.read_text()
    config.write_text(text.replace('"<|im_end|>"', '"<|im_END|>"', 1))  # same size, another eos token
    assert config.stat().st_size == len(text.encode())
    r = run_tool_in_process("tools/hf_export.py", "--checkpoint", step, "--out", tmp_path / "out")
    assert r.returncode == 4, r.output
    assert r.stderr.strip().splitlines() == [
        f"checkpoint error: checkpoint {step} is broken: tokenizer/tokenizer_config.json: sha256 mismatch"]
    assert not (tmp_path / "out").exists()
    r = run_command([sys.executable, "tools/ckpt.py", "verify", step], timeout=120)  # torch-free: starts in ~1 s
    assert r.returncode == 1 and r.stdout.strip() == f"{step}: BROKEN: tokenizer/tokenizer_config.json: sha256 mismatch"


def test_gpt_import_exports_a_tokenizer_that_autotokenizer_loads(tmp_path):
    src = tmp_path / "qwen2"
    tok = hf_models.chat_tokenizer(src)
    hf_models.causal_lm("qwen2", src, vocab=len(tok))
    hf_models.tool_main("hf_import.py", "--llm", src, "--out", tmp_path / "imported")
    r = run_tool_in_process("tools/hf_export.py", "--checkpoint", tmp_path / "imported", "--out", tmp_path / "out")
    assert r.returncode == 0 and r.stdout.strip() == (
        f"wrote {tmp_path / 'out'} (weights, config, chat_template.jinja, tokenizer.json, tokenizer_config.json)")
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    for text in TEXTS:
        assert exported(text).input_ids == tok(text).input_ids
    chat = [{"role": "user", "content": "What is in the image?"}]
    assert exported.apply_chat_template(chat, tokenize=False) == tok.apply_chat_template(chat, tokenize=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(model) is transformers.Qwen2ForCausalLM and model.config.vocab_size == len(tok)


def test_llava_trained_from_scratch_exports_weights_and_says_what_is_missing_in_one_line(tmp_path):
    """A checkpoint without tokenizer files: the shapes demo's LLaVA with a
    Llama decoder, written directly (its word-level tokenizer does not travel)."""
    from megascale_omni.checkpoint.pretrained import save_model_checkpoint
    from megascale_omni.config import JobConfig, from_dict
    from megascale_omni.config.loader import load_yaml
    from megascale_omni.models.standalone import build_model, one_process

    raw = load_yaml(REPO / "examples/llava/tiny_cpu.yaml")
    model = {**raw["model"], "vocab_size": 40, "activation": "swiglu", "normalization": "RMSNorm"}
    cfg = from_dict(JobConfig, {"model": model, "vision": {**raw["vision"], "class_token": True}})
    with one_process():
        save_model_checkpoint(build_model(cfg, cfg.model.padded_vocab_size(40), image_token_id=4), cfg,
                              tmp_path / "ckpt", provenance={})
    out = tmp_path / "out"
    r = run_tool_in_process("tools/hf_export.py", "--checkpoint", tmp_path / "ckpt", "--out", out,
                            "--image-token-id", 4)
    assert r.returncode == 0, r.output
    assert r.stdout.strip().splitlines() == [
        f"wrote {out}",
        f"{out} has no tokenizer (tokenizer.json), tokenizer_config.json, chat template, image processor "
        "(preprocessor_config.json): the checkpoint carries none (its run did not start from tools/hf_import.py, "
        "or the source lacked them); copy them from the model's tokenizer before loading it with "
        "AutoTokenizer/AutoProcessor"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(out))
    assert model.config.image_token_index == 4 and model.config.text_config.vocab_size == 40
