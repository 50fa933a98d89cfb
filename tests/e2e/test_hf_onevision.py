"""Hugging Face LLaVA-OneVision (SigLIP + Qwen2) import, export and generation
against ``transformers`` itself (issue 32 item 3).

A tiny random ``LlavaOnevisionForConditionalGeneration`` (32 px, 8 px
patches: 4 x 4 features a frame, pooled to 2 x 2) is built and saved here;
norms and biases are perturbed, so a mapping that drops or swaps them
cannot pass. Claims:
- a video prompt (3 frames: 3 x 4 pooled tokens + the newline) and an
  interleaved two-image prompt (each image 16 tokens + the newline, HF's
  multi-image path) give HF's logits within 1e-4 max abs (fp32) and the
  same greedy tokens;
- import -> export reproduces every tensor the model reads bit-exactly,
  ``image_newline`` included, and transformers loads the export as the
  same model;
- ``tools/generate.py --video DIR --frames N`` keeps transformers' frames
  and generates HF's greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import hf_models
from tests.hf_models import tool_main

pytestmark = pytest.mark.timeout(600)

LOGIT_ATOL = 1e-4
IMAGE, VIDEO = 5, 6
FRAMES = 3
#: The Qwen2's init std (its default 0.02 makes a tiny random LM repeat one token under greedy decoding).
INIT = 0.3
#: Greedy tokens compared (each re-runs the prompt: no KV cache).
NEW = 6


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    """(HF model, its directory, our import of it)."""
    root = tmp_path_factory.mktemp("onevision")
    hf = hf_models.llava_relative(root / "hf", "onevision", seed=3, initializer_range=INIT)
    tool_main("hf_import.py", "--llava", root / "hf", "--out", root / "ours")
    return hf, root / "hf", root / "ours"


def _prompts():
    """(video prompt ids [1, 40], frames [1, F, 3, 32, 32]), (two-image prompt ids [1, 56], images [2, 3, 32, 32])."""
    g = torch.Generator().manual_seed(0)
    video_ids = torch.randint(7, hf_models.VOCAB, (1, 40), generator=g)
    video_ids[0, 4 : 4 + FRAMES * 4 + 1] = VIDEO
    image_ids = torch.randint(7, hf_models.VOCAB, (1, 56), generator=g)
    image_ids[0, 3:20] = IMAGE
    image_ids[0, 30:47] = IMAGE  # text between and after: interleaved
    return (video_ids, torch.randn(1, FRAMES, 3, 32, 32, generator=g)), (image_ids, torch.randn(2, 3, 32, 32,
                                                                                                generator=g))


def _hf_kwargs(kind: str, pixels: torch.Tensor) -> dict:
    if kind == "video":
        return dict(pixel_values_videos=pixels)
    # The multi-image path: one view per image, its features then the newline.
    return dict(pixel_values=pixels[:, None], image_sizes=torch.tensor([[32, 32]] * len(pixels)),
                batch_num_images=torch.tensor([len(pixels)]))


def _our_kwargs(kind: str, pixels: torch.Tensor) -> dict:
    return dict(videos=pixels[0], video_frames=[FRAMES]) if kind == "video" else dict(images=pixels)


def test_video_and_interleaved_images_match_transformers(onevision):
    from megascale_omni.checkpoint.pretrained import load_model_weights, open_model_checkpoint
    from megascale_omni.models.generation import generate, logits
    from megascale_omni.models.standalone import build_model, one_process

    hf, _, ours = onevision
    ckpt = open_model_checkpoint(ours, "test")
    m, v = ckpt.cfg.model, ckpt.cfg.vision
    assert (v.image_newline, v.video_pool_stride, v.video_tokens(FRAMES), v.image_tokens) == (True, 2, 13, 17)
    assert ckpt.provenance["video_token_id"] == VIDEO
    (video_ids, frames), (image_ids, images) = _prompts()
    with one_process():
        model = build_model(ckpt.cfg, m.padded_vocab_size(m.vocab_size), IMAGE, VIDEO)
        load_model_weights([model], ckpt, "test")
        model.eval()
        for kind, ids, pixels in (("video", video_ids, frames), ("images", image_ids, images)):
            with torch.no_grad():
                ref = hf(input_ids=ids, **_hf_kwargs(kind, pixels)).logits
            got = logits(model, ids, **_our_kwargs(kind, pixels))[..., : m.vocab_size]
            diff = (got - ref).abs().max().item()
            print(f"\n{kind}: max abs logit difference {diff:.2e}")
            assert diff <= LOGIT_ATOL, f"{kind}: max abs logit difference {diff:.3g}"
            with torch.no_grad():
                expected = hf.generate(input_ids=ids, **_hf_kwargs(kind, pixels), max_new_tokens=NEW,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
            new = generate(model, ids[0].tolist(), NEW, m.vocab_size, **_our_kwargs(kind, pixels))
            assert new == expected, kind
            assert len(set(expected)) > 1  # not a degenerate repeat of one token


def test_import_then_export_reproduces_every_tensor_bit_exactly(onevision, tmp_path):
    import transformers
    from safetensors.torch import load_file

    hf, src, ours = onevision
    tool_main("hf_export.py", "--checkpoint", ours, "--out", tmp_path / "out")
    original, exported = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" /
                                                                                   "model.safetensors"))
    assert "image_newline" in exported
    for key, tensor in exported.items():
        assert key in original, f"export wrote {key}, which the HF model does not have"
        assert torch.equal(tensor, original[key]), f"{key} differs after import -> export"
    dropped = set(original) - set(exported)  # SigLIP's post-norm and pooling head never reach the LM
    assert dropped and all(k.startswith(("vision_tower.post_layernorm", "vision_tower.head.")) for k in dropped), \
        sorted(dropped)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["video_token_index"], config["image_token_index"]) == (
        "llava_onevision", VIDEO, IMAGE)
    reloaded = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    (video_ids, frames), (image_ids, images) = _prompts()
    with torch.no_grad():
        for kind, ids, pixels in (("video", video_ids, frames), ("images", image_ids, images)):
            kwargs = dict(input_ids=ids, **_hf_kwargs(kind, pixels))
            assert torch.equal(reloaded(**kwargs).logits, hf(**kwargs).logits), kind


def test_generate_tool_with_a_video_reproduces_transformers(tmp_path, capsys):
    from PIL import Image

    from megascale_omni.data.tokenizer import build_word_tokenizer

    src = tmp_path / "hf"
    tok = build_word_tokenizer([f"w{i}" for i in range(90)] + ["<video>"], src / "tokenizer.json")
    video_token = tok.token_to_id("<video>")
    hf = hf_models.llava_relative(src, "onevision", seed=5, vocab=tok.vocab_size, image_token=tok.image_token_id,
                                  video_token=video_token, initializer_range=INIT)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["eos_token_id"] = tok.eos_id
    (src / "config.json").write_text(json.dumps(config))
    tool_main("hf_import.py", "--llava", src, "--out", tmp_path / "ours")
    frames = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    (tmp_path / "clip").mkdir()
    for i, frame in enumerate(frames):  # a frame folder: lossless, so the test knows the pixels
        Image.fromarray(frame).save(tmp_path / "clip" / f"{i:03d}.png")
    tool_main("generate.py", "--checkpoint", tmp_path / "ours", "--video", tmp_path / "clip", "--frames", FRAMES,
              "--prompt", "w3 <video> w7 w8", "--max-new-tokens", NEW, "--ids")
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prompt = result["prompt_ids"]
    assert prompt.count(video_token) == FRAMES * 4 + 1
    kept = frames[[i * 5 // FRAMES for i in range(FRAMES)]]  # transformers' uniform choice: 0, 1, 3
    pixels = torch.from_numpy(kept.astype(np.float32) / 127.5 - 1.0).permute(0, 3, 1, 2)[None]
    expected = hf_models.hf_greedy(hf, prompt, tok, NEW, pixel_values_videos=pixels)
    assert result["new_ids"] == expected and len(set(expected)) > 1
