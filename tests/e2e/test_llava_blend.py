"""LLaVA training on a blend of two datasets (data.blend) runs end to end:
the blend's per-epoch counts follow the weights and the steps train."""

from __future__ import annotations

import re
import sys

import pytest

from megascale_omni.demo.llava_shapes import make_shapes_dataset
from tests.launcher import read_metrics, run

pytestmark = pytest.mark.timeout(240)


def test_training_on_two_blended_datasets(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_shapes_dataset(a, num_train=120, num_val=8, seed=1, samples_per_shard=60)
    make_shapes_dataset(b, num_train=40, num_val=8, seed=2, samples_per_shard=40)
    out = tmp_path / "run"
    res = run([sys.executable, "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml", f"data.path={a}",
               f"data.blend=[{{path: {a}, weight: 1}}, {{path: {b}, weight: 3}}]", "train.steps=3",
               "train.eval_interval=0", f"logging.output_dir={out}", "logging.tensorboard=false",
               "checkpoint.save_at_end=false"], timeout=220)
    assert res.returncode == 0, res.output[-4000:]
    # 160 usable samples per blended epoch: a quarter from a (120), three quarters from b (40, upsampled).
    counts = re.search(r"blend: \[(\d+), (\d+)\] samples per epoch", res.output)
    assert counts and (int(counts[1]), int(counts[2])) == (40, 120), res.output[-3000:]
    records = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)
