"""Training with ``data.image_mode=anyres`` on a tiny ingested set: the shapes
samples as LLaVA JSON with non-square images, ingested with token counts
(``--data-format words``), planned from the index alone, tiled by the
batcher, the ViT on every view."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from PIL import Image

from megascale_omni.data.llava.ingest import IngestInputs, ingest, words_coster
from megascale_omni.data.shards import INDEX_FILENAME
from megascale_omni.demo.llava_shapes import make_shapes_llava_json
from tests.launcher import read_metrics, run

# About 20 s of CPU (one process); in `make test-all` beside the chat-format training run.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ANYRES = {"size": {"shortest_edge": 32}, "do_center_crop": True, "crop_size": {"height": 32, "width": 32},
          "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64], [96, 32]]}


def _anyres_set(root):
    """40 + 8 shapes samples, their images padded to random non-square sizes,
    ingested into ``root/{train,val}`` with token counts for the shapes tokenizer."""
    make_shapes_llava_json(root / "json", num_train=40, num_val=8, seed=3)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for png in sorted((root / "json" / split / "images").glob("*.png")):
            image = np.asarray(Image.open(png).convert("RGB"))
            pad = ((0, int(rng.integers(0, 40))), (0, int(rng.integers(0, 40))), (0, 0))
            Image.fromarray(np.pad(image, pad)).save(png)
        ingest(IngestInputs(llava_json=[str(root / "json" / split / "llava.json")],
                            image_root=str(root / "json" / split)),
               root / split, samples_per_shard=20, coster=words_coster(root / "json" / "tokenizer.json"))
    (root / "tokenizer.json").write_bytes((root / "json" / "tokenizer.json").read_bytes())
    (root / "preprocessor_config.json").write_text(json.dumps(ANYRES))


def test_anyres_trains_from_the_index(tmp_path):
    _anyres_set(tmp_path / "ds")
    doc = json.loads((tmp_path / "ds" / "train" / INDEX_FILENAME).read_text())
    sizes = {tuple(hw) for s in doc["samples"] for hw in s["cost"]["images"]}
    assert len(sizes) > 5 and all(s["cost"]["tokens"] for s in doc["samples"])
    res = run(
        [sys.executable, "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml",
         f"data.path={tmp_path / 'ds'}", "data.image_mode=anyres",
         f"data.image_processor={tmp_path / 'ds' / 'preprocessor_config.json'}", "model.num_layers=2",
         "vision.num_layers=1", "train.steps=3", "train.global_batch_size=2", "train.micro_batch_size=1",
         "train.eval_interval=0", f"logging.output_dir={tmp_path / 'run'}", "logging.tensorboard=false"],
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "images: anyres with" in res.stderr
    assert "planned 40 of 40 samples" in res.stderr and "planned 8 of 8 samples" in res.stderr
    records = read_metrics(tmp_path / "run")
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["skipped_samples"] == 0 and records[-1]["excluded_samples"] == 0
    evals = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "eval/real/loss" in r]
    assert len(evals) == 1 and np.isfinite(evals[0]["eval/shuffled/loss"])
