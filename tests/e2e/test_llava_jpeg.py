"""A non-square JPEG set end to end: LLaVA JSON + JPEGs -> ``tools/ingest_llava.py``
(source bytes, val split at ingest) -> training steps with
``data.image_mode=pad_square``; the default ``exact`` mode refuses the set at
start with the fix instead of skipping every sample."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
from PIL import Image

from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.demo.llava_shapes import make_shapes_llava_json
from tests.launcher import read_metrics, run

# Two short training launches (~20 s of CPU each); in `make test-all` beside the anyres run.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _jpeg_set(root):
    """48 shapes samples as LLaVA JSON whose images are non-square JPEGs (quality 90)."""
    make_shapes_llava_json(root / "json", num_train=48, num_val=0, seed=3)
    src = root / "json" / "train"
    records = json.loads((src / "llava.json").read_text())
    rng = np.random.default_rng(0)
    for record in records:
        for key in ("image", "images"):
            if key not in record:
                continue
            paths = [record[key]] if key == "image" else record[key]
            renamed = []
            for rel in paths:
                image = np.asarray(Image.open(src / rel).convert("RGB"))
                pad = ((0, int(rng.integers(4, 24))), (0, int(rng.integers(0, 24))), (0, 0))
                Image.fromarray(np.pad(image, pad)).save(src / rel.replace(".png", ".jpg"), quality=90)
                renamed.append(rel.replace(".png", ".jpg"))
            record[key] = renamed[0] if key == "image" else renamed
    (src / "llava.json").write_text(json.dumps(records))
    return src


def test_non_square_jpegs_ingest_and_train(tmp_path):
    src = _jpeg_set(tmp_path)
    ds = tmp_path / "ds"
    res = run([sys.executable, "tools/ingest_llava.py", "--out", ds / "train", "--image-root", src, "--llava-json",
               src / "llava.json", "--val-fraction", "0.2", "--samples-per-shard", "20", "--workers", "1"],
              timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    shutil.copy(tmp_path / "json" / "tokenizer.json", ds / "tokenizer.json")
    train, val = ShardedSampleReader(ds / "train"), ShardedSampleReader(ds / "val")
    assert len(train) + len(val) == 48 and 2 <= len(val) <= 18
    # Every image is stored as its source file's bytes (no re-encoding), once, in one split.
    stored = sorted(v for reader in (train, val) for i in range(len(reader))
                    for k, v in reader.read_members(i)[2].items() if k != "json")
    assert stored == sorted(p.read_bytes() for p in (src / "images").glob("*.jpg"))
    common = ["pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml", f"data.path={ds}",
              "model.num_layers=2", "vision.num_layers=1", "train.global_batch_size=2", "train.micro_batch_size=1",
              "train.eval_interval=0", "logging.tensorboard=false"]
    refused = run([sys.executable, *common, "train.steps=1", f"logging.output_dir={tmp_path / 'exact'}"], timeout=240)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and last.startswith("config error: data.image_mode='exact': needs every image "
                                                       "32x32"), refused.stderr[-3000:]
    assert "set data.image_mode=pad_square" in last
    res = run([sys.executable, *common, "data.image_mode=pad_square", "train.steps=3",
               f"logging.output_dir={tmp_path / 'run'}"], timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    records = read_metrics(tmp_path / "run")
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["skipped_samples"] == 0
