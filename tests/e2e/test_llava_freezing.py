"""LLaVA stage-1 / stage-2 freezing: exactly the chosen towers stay trainable and training runs."""

from __future__ import annotations

import re
import sys

import pytest

from megascale_omni.data.llava.shapes_dataset import make_shapes_dataset
from tests.launcher import read_metrics, run

pytestmark = pytest.mark.timeout(300)

# vision_projection: fc1 64->128 (+bias), fc2 128->128 (+bias) in tiny_cpu.yaml.
PROJECTOR_PARAMS = 64 * 128 + 128 + 128 * 128 + 128


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes") / "d"
    make_shapes_dataset(root, num_train=200, num_val=20, seed=5, image_size=32, samples_per_shard=100)
    return root


def _counts(dataset, out, flags):
    res = run([sys.executable, "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml",
               f"data.path={dataset}", "train.steps=3", "train.eval_interval=0", f"logging.output_dir={out}",
               "logging.tensorboard=false", *flags], timeout=200)
    assert res.returncode == 0, res.stderr[-4000:]
    m = re.search(r"parameters on this rank: (\d+), trainable (\d+)", res.stderr)
    assert m, res.stderr[-2000:]
    records = read_metrics(out)
    assert len(records) == 3 and all(r["grad_norm"] > 0 for r in records)
    return int(m.group(1)), int(m.group(2))


def test_freezing_stages(dataset, tmp_path):
    total, full = _counts(dataset, tmp_path / "full", [])
    assert full == total
    _, stage2 = _counts(dataset, tmp_path / "stage2", ["vision.freeze=true"])
    _, stage1 = _counts(dataset, tmp_path / "stage1", ["vision.freeze=true", "model.freeze=true"])
    assert stage1 == PROJECTOR_PARAMS
    assert stage1 < stage2 < full
