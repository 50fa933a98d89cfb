"""Training on conversation data through the model's chat template (``data.format=chat``)
with non-square images preprocessed from a ``preprocessor_config.json`` (``pad_square``)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from megascale_omni.data.sample import KIND_TEXT_ONLY, Sample
from megascale_omni.data.shard_writer import write_shards
from megascale_omni.demo.llava_shapes import make_shapes_dataset, open_shapes_split
from tests.hf_models import chat_tokenizer
from tests.launcher import read_metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
pytest.importorskip("transformers")

SEQ = 512
TOO_LONG = 2  # samples whose first round alone exceeds SEQ (1% of 200: at the limit)


def _chat_dataset(root):
    """Shapes conversations with a system turn on every third sample and
    images padded to random non-square sizes; a chat tokenizer and a CLIP
    preprocessor config beside the shards."""
    make_shapes_dataset(root / "src", num_train=200 - TOO_LONG, num_val=20, seed=1, image_size=32,
                        samples_per_shard=100)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        reader = open_shapes_split(root / "src", split)
        out = []
        for i in range(len(reader)):
            s = reader[i]
            imgs = [np.pad(im, ((0, int(rng.integers(0, 12))), (0, int(rng.integers(0, 12))), (0, 0)))
                    for im in s.images]
            system = [{"role": "system", "text": "Answer briefly."}] if i % 3 == 0 else []
            out.append(Sample(s.id, s.kind, imgs, system + s.conversation, s.image_dependent_words))
        if split == "train":
            out += [Sample(10_000 + k, KIND_TEXT_ONLY, [], [{"role": "user", "text": "what shape ? " * 200},
                                                             {"role": "assistant", "text": "none"}])
                    for k in range(TOO_LONG)]
        write_shards(out, root / split, samples_per_shard=100)
        reader.close()
    chat_tokenizer(root)
    (root / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 32}, "do_center_crop": True, "crop_size": {"height": 32, "width": 32},
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
    }))


def test_chat_format_trains_with_preprocessed_images(tmp_path):
    _chat_dataset(tmp_path / "ds")
    res = run(
        [sys.executable, "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml",
         f"data.path={tmp_path / 'ds'}", "data.format=chat", "data.image_mode=pad_square",
         f"model.seq_length={SEQ}", "model.num_layers=2", "vision.num_layers=1", "train.steps=6",
         "train.global_batch_size=2", "train.micro_batch_size=1", "train.eval_interval=0",
         f"logging.output_dir={tmp_path / 'run'}", "logging.tensorboard=false"],
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "images: pad_square with" in res.stderr
    assert res.stderr.count("first round alone is") == TOO_LONG
    records = read_metrics(tmp_path / "run")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if "eval/real/loss" in r]
    # The end-of-run evaluation scores the assistant tokens of the real tokenizer.
    assert len(evals) == 1 and evals[0]["eval/real/scored_tokens"] > 0
    assert 0.0 <= evals[0]["eval/real/answer_token_accuracy"] <= 1.0 and "answer token accuracy" in res.stderr
    assert records[-1]["excluded_samples"] == TOO_LONG and records[-1]["skipped_samples"] == TOO_LONG
    assert all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
