"""tools/make_dit_latents.py on real diffusers/transformers encoders (tiny,
randomly initialised, saved to local directories), then DiT training on the
latent shards with precomputed text states (the `test` extra installs both)."""

from __future__ import annotations

import json
import sys

import diffusers
import pytest
import transformers
from PIL import Image

from megascale_omni.demo.dit_shapes import generate, vocabulary
from tests.launcher import read_metrics, run

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def encoders(tmp_path):
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    )
    vae.save_pretrained(tmp_path / "vae")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", *vocabulary()])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(tmp_path / "text")
    cfg = transformers.CLIPTextConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16)
    transformers.CLIPTextModel(cfg).save_pretrained(tmp_path / "text")
    return tmp_path / "vae", tmp_path / "text"


def test_latent_shards_from_local_encoders_train(tmp_path, encoders):
    images = tmp_path / "images"
    images.mkdir()
    for i in range(60):
        image, caption, _ = generate(i, 0, 0)
        Image.fromarray(image).save(images / f"{i:03d}.png")
        if i != 7:  # one image without a caption
            (images / f"{i:03d}.txt").write_text(caption)
    Image.fromarray(generate(99, 0, 0)[0][:6, :6]).save(images / "tiny.png")  # smaller than every bucket
    (images / "tiny.txt").write_text("a red square")
    config = tmp_path / "latent.yaml"
    config.write_text("dit:\n  patch_size: 2\n  buckets: [[4, 4], [4, 6], [6, 4], [6, 6], [4, 8], [8, 4]]\n"
                      "  token_budget: 48\n  max_text_length: 6\n")
    vae, text = encoders
    out = tmp_path / "latents"
    res = run([sys.executable, "tools/make_dit_latents.py", "--images", str(images), "--vae", str(vae),
               "--text-encoder", str(text), "--config", str(config), "--out", str(out), "--val-fraction", "0",
               "--batch-size", "8"],
              timeout=200)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary == {"out": str(out), "train": 59, "val": 0, "skipped": 2, "in_channels": 4, "text_dim": 16}
    assert "missing caption" in res.stderr and "smaller than every bucket" in res.stderr
    desc = json.loads((out / "dataset.json").read_text())
    assert desc["kind"] == "latents" and desc["downsample"] == 2

    run_dir = tmp_path / "run"
    res = run([sys.executable, "pretrain_dit.py", "--config", "examples/dit/tiny_cpu.yaml", f"data.path={out}",
               "dit.patch_size=2", "dit.buckets=[[4,4],[4,6],[6,4],[6,6],[4,8],[8,4]]",
               "dit.token_budget=48", "dit.in_channels=4", "dit.text_encoder=precomputed", "dit.text_dim=16",
               "dit.max_text_length=6", "model.num_layers=1", "train.global_batch_size=2", "train.steps=3",
               "dit.eval_resolutions=[]", f"logging.output_dir={run_dir}", "logging.tensorboard=false"],
              timeout=200)
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_metrics(run_dir)
    assert len(records) == 3 and records[-1]["excluded_samples"] == 0 and records[-1]["skipped_samples"] == 0


def test_batched_encoding_equals_one_image_at_a_time(encoders):
    """The tool encodes B images of a bucket (and their captions) in one call;
    each latent and caption state equals encoding it alone (fp32, 1e-5), and
    a partial batch is encoded at the end."""
    import importlib.util

    import numpy as np

    from megascale_omni.data.dit.latents import TextStates, VaeCodec

    spec = importlib.util.spec_from_file_location("make_dit_latents", "tools/make_dit_latents.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    vae_dir, text_dir = encoders
    vae, text = VaeCodec.load(vae_dir), TextStates.load(text_dir, max_length=6)
    encoder = tool.LatentEncoder(vae, text, batch_size=4)
    items = [(f"{i}.png", generate(i, 0, 0)[0][:8, :8].copy(), generate(i, 0, 0)[1]) for i in range(5)]
    out = [r for name, pixels, caption in items for r in encoder.add(0, name, pixels, caption)]
    assert [r[0] for r in out] == ["0.png", "1.png", "2.png", "3.png"]  # one full batch so far
    out += list(encoder.flush())
    assert [r[0] for r in out] == [f"{i}.png" for i in range(5)] and not encoder.pending
    for (name, pixels, caption), (_, latent, _, states) in zip(items, out):
        np.testing.assert_allclose(latent, vae.encode(pixels[None])[0], atol=1e-5)
        np.testing.assert_allclose(states, text.encode([caption])[0], atol=1e-5)
    # The val split is a hash of the name: none at 0, about half at 0.5.
    assert not any(tool.in_val(f"{i}.png", 0.0) for i in range(100))
    assert 35 <= sum(tool.in_val(f"{i}.png", 0.5) for i in range(100)) <= 65
