"""DiT bad input: images smaller than every bucket, missing captions and
corrupt samples are skipped and counted; a shard that does not match its
index stops the run at start (exit 3, one line), as does a bucket table that
cannot fit the token budget (exit 2, one line)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from megascale_omni.data.dit.reader import encode_latent_record, encode_pixel_record, write_dit_dataset
from megascale_omni.data.shard_writer import index_shards
from megascale_omni.demo.dit_shapes import description, generate, vocabulary
from tests.launcher import read_metrics, run

pytestmark = pytest.mark.timeout(300)

SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64", "dit.eval_resolutions=[]",
         "train.global_batch_size=2", "logging.tensorboard=false"]


def _train(data: Path, out: Path, steps: int, *extra: str):
    return run([sys.executable, "pretrain_dit.py", "--config", "examples/dit/tiny_cpu.yaml", f"data.path={data}",
                f"train.steps={steps}", f"logging.output_dir={out}", *SMALL, *extra], timeout=240)


def _pixel_dataset(root: Path) -> dict[str, list[int]]:
    """120 good samples plus planted bad ones; returns the planted ids by kind."""
    records, planted = [], {"tiny": [], "no_caption": []}
    for i in range(124):
        image, caption, _ = generate(i, 0, 0)
        if i in (5, 50):
            image, planted["tiny"] = image[:8, :8], planted["tiny"] + [i]  # smaller than every bucket
        if i == 77:
            caption, planted["no_caption"] = None, [i]
        records.append(encode_pixel_record(i, image, caption))
    write_dit_dataset(root, {"train": records}, description(), vocabulary(), samples_per_shard=40)
    return planted


def corrupt_member(split: Path, suffix: str, sample_id: int) -> None:
    """Overwrite one member in place (then re-index to make it a sample written corrupt)."""
    doc = json.loads((split / "index.json").read_text())
    s = next(s for s in doc["samples"] if s["id"] == sample_id)
    offset, size = s["members"][suffix]
    with open(split / doc["shards"][s["shard"]]["name"], "r+b") as f:
        f.seek(offset)
        f.write((b"\x00garbage" * size)[:size])


def test_small_images_missing_captions_and_corrupt_images_are_skipped_and_counted(tmp_path):
    planted = _pixel_dataset(tmp_path / "d")
    corrupt_member(tmp_path / "d" / "train", "png", 3)
    index_shards(tmp_path / "d" / "train")
    # 121 usable samples ~ 15 packages ~ 7 steps per epoch: 8 steps read every one.
    res = _train(tmp_path / "d", tmp_path / "run", 8, "data.max_bad_sample_fraction=0.05")
    assert res.returncode == 0, res.stderr[-4000:]
    excluded = [int(m) for m in re.findall(r"excluding sample (\d+) from the plan", res.stderr)]
    assert sorted(excluded) == sorted(planted["tiny"] + planted["no_caption"])
    assert "smaller than every bucket" in res.stderr and "missing caption" in res.stderr
    skipped = set(re.findall(r"skipping bad sample: bad sample id=(\d+)", res.stderr))
    assert skipped == {"3"}, res.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert records[-1]["skipped_samples"] == 1 + 3 and records[-1]["excluded_samples"] == 3
    assert all(np.isfinite(r["loss"]) for r in records)


def _latent_dataset(root: Path, n: int = 90) -> None:
    rng = np.random.default_rng(0)
    sizes = [(4, 4), (4, 8), (8, 4), (8, 8)]
    records = []
    for i in range(n):
        h, w = sizes[i % 4]
        records.append(encode_latent_record(i, rng.standard_normal((4, h, w)), f"a thing {i}",
                                            rng.standard_normal((3, 16))))
    desc = {"name": "test-latents", "kind": "latents", "in_channels": 4, "text": "precomputed"}
    write_dit_dataset(root, {"train": records}, desc, samples_per_shard=30)


LATENT = ["dit.in_channels=4", "dit.text_encoder=precomputed", "dit.text_dim=16", "dit.patch_size=2",
          "dit.buckets=[[4,4],[4,8],[8,4],[8,8]]", "dit.token_budget=64"]


def test_corrupt_latent_samples_are_counted_and_a_changed_shard_stops_the_run(tmp_path):
    split = tmp_path / "d" / "train"
    _latent_dataset(tmp_path / "d")
    corrupt_member(split, "latent.npy", 4)
    corrupt_member(split, "json", 40)
    index_shards(split)  # written corrupt: the checksums match, the two samples are bad
    res = _train(tmp_path / "d", tmp_path / "run", 6, *LATENT, "data.max_bad_sample_fraction=0.5")
    assert res.returncode == 0, res.stderr[-4000:]
    assert re.findall(r"excluding sample (\d+) from the plan", res.stderr) == ["40"]
    hits = len(re.findall(r"skipping bad sample: bad sample id=4 .*corrupt array member 'latent.npy'", res.stderr))
    last = read_metrics(tmp_path / "run")[-1]
    assert last["excluded_samples"] == 1 and last["skipped_samples"] == 1 + hits
    # A shard cut short after indexing: one line naming it, exit 3, before any step.
    shard = split / "shard-000002.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    res = _train(tmp_path / "d", tmp_path / "run2", 6, *LATENT, "data.max_bad_sample_fraction=0.5")
    assert res.returncode == 3, res.stderr[-4000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("data error: ")]
    assert len(lines) == 1 and f"{shard}: shard is" in lines[0] and "index.json says" in lines[0], lines
    assert "Traceback" not in res.stderr



def test_bucket_table_that_cannot_fit_the_budget_exits_2_at_start(tmp_path):
    res = run([sys.executable, "pretrain_dit.py", "--config", "examples/dit/tiny_cpu.yaml", "dit.token_budget=10"],
              timeout=180)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("config error: dit.token_budget=10: bucket dit.buckets[0]=")
    assert "raise dit.token_budget" in lines[-1] and "Traceback" not in res.stderr
