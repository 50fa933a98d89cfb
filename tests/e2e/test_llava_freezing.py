"""LLaVA stage-1 / stage-2 freezing: exactly the chosen towers stay trainable and training runs."""

from __future__ import annotations

import re
import sys

import pytest

from megascale_omni.demo.llava_shapes import make_shapes_dataset
from tests.launcher import finish, kill_group, read_metrics, spawn

pytestmark = pytest.mark.timeout(300)

# vision_projection: fc1 64->128 (+bias), fc2 128->128 (+bias) in tiny_cpu.yaml.
PROJECTOR_PARAMS = 64 * 128 + 128 + 128 * 128 + 128


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes") / "d"
    make_shapes_dataset(root, num_train=200, num_val=20, seed=5, image_size=32, samples_per_shard=100)
    return root


def _start(dataset, out, flags):
    return spawn([sys.executable, "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml",
                  f"data.path={dataset}", "train.steps=3", "train.eval_interval=0", f"logging.output_dir={out}",
                  "logging.tensorboard=false", *flags], timeout=200)


def _counts(proc, out):
    res = finish(proc, timeout=200)
    assert res.returncode == 0, res.stderr[-4000:]
    m = re.search(r"parameters on this rank: (\d+), trainable (\d+)", res.stderr)
    assert m, res.stderr[-2000:]
    records = read_metrics(out)
    assert len(records) == 3 and all(r["grad_norm"] > 0 for r in records)
    return int(m.group(1)), int(m.group(2))


def test_freezing_stages(dataset, tmp_path):
    # Three independent one-process runs, started together: one busy core each, so on the
    # 2-core CI host none waits for another's interpreter and megatron start-up.
    stages = {"full": [], "stage2": ["vision.freeze=true"], "stage1": ["vision.freeze=true", "model.freeze=true"]}
    procs = {name: _start(dataset, tmp_path / name, flags) for name, flags in stages.items()}
    try:
        counts = {name: _counts(proc, tmp_path / name) for name, proc in procs.items()}
    finally:
        for proc in procs.values():  # after a failure: no run outlives the test
            kill_group(proc)
            proc.wait()
    total, full = counts["full"]
    assert full == total
    _, stage2 = counts["stage2"]
    _, stage1 = counts["stage1"]
    assert stage1 == PROJECTOR_PARAMS
    assert stage1 < stage2 < full
