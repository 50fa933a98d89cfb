"""Training on shards with planted corrupt samples: skip and count below the
limit, stop with a clear message (exit 3) above it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from megascale_omni.data.shard_writer import index_shards
from megascale_omni.demo.llava_shapes import make_shapes_dataset
from tests.launcher import read_metrics, run

pytestmark = pytest.mark.timeout(300)

NUM_TRAIN = 400


def _corrupt_images(split_dir: Path, count: int) -> list[int]:
    """Overwrite the first PNG of ``count`` image samples in place and
    re-index (written corrupt: the shard checksums match, the samples are
    bad); returns their ids."""
    doc = json.loads((split_dir / "index.json").read_text())
    victims = [s for s in doc["samples"] if "0.png" in s["members"]][:count]
    for s in victims:
        offset, size = s["members"]["0.png"]
        with open(split_dir / doc["shards"][s["shard"]]["name"], "r+b") as f:
            f.seek(offset)
            f.write((b"\x00garbage" * size)[:size])
    index_shards(split_dir)
    return [s["id"] for s in victims]


@pytest.fixture()
def dataset(tmp_path):
    root = tmp_path / "shapes"
    make_shapes_dataset(root, num_train=NUM_TRAIN, num_val=20, seed=3, image_size=32, samples_per_shard=100)
    return root


def _train(dataset: Path, out: Path, steps: int):
    return run(
        [sys.executable, "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml", f"data.path={dataset}",
         f"train.steps={steps}", "train.eval_interval=0", f"logging.output_dir={out}", "logging.tensorboard=false",
         "model.num_layers=2", "vision.num_layers=1"],
        timeout=240,
    )


def test_corrupt_samples_below_limit_are_skipped_and_counted(dataset, tmp_path):
    bad = _corrupt_images(dataset / "train", 2)  # 0.5% < 1%
    # ~52 samples per step: 10 steps cover the whole epoch's packs.
    res = _train(dataset, tmp_path / "run", steps=10)
    assert res.returncode == 0, res.stderr[-4000:]
    warned = [int(m.group(1)) for m in re.finditer(r"skipping bad sample: bad sample id=(\d+)", res.stderr)]
    records = read_metrics(tmp_path / "run")
    assert len(records) == 10
    # Both planted samples are hit (every epoch revisits them), nothing else is.
    assert set(warned) == set(bad), res.stderr[-2000:]
    assert records[-1]["skipped_samples"] == len(warned)
    assert all(r["loss"] == r["loss"] for r in records)  # no NaN from a half-read batch


def test_corrupt_samples_above_limit_stop_the_run(dataset, tmp_path):
    _corrupt_images(dataset / "train", 40)  # 10%
    res = _train(dataset, tmp_path / "run", steps=10)
    assert res.returncode == 3, res.stderr[-4000:]
    last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("data error: ")
    assert "data.max_bad_sample_fraction=1.0%" in last and "samples were bad" in last
    assert "Traceback" not in res.stderr


def test_missing_dataset_path_names_the_path(tmp_path):
    res = run([sys.executable, "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml",
               f"data.path={tmp_path / 'nope'}"], timeout=120)
    assert res.returncode == 2
    assert f"data.path='{tmp_path / 'nope'}'" in res.stderr and "Traceback" not in res.stderr


def test_missing_tokenizer_names_the_path(dataset, tmp_path):
    res = run([sys.executable, "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml",
               f"data.path={dataset}", f"data.tokenizer={tmp_path / 'tok.json'}"], timeout=120)
    assert res.returncode == 2
    assert "data.tokenizer=" in res.stderr and "tok.json" in res.stderr and "Traceback" not in res.stderr
