"""GPT (dense and MoE), LLaVA (images, and clips with frames) and DiT train 20 steps on the device: every parameter there in
the run's precision, every micro-batch handed to the model there, at every
step (tests/gpu/device_probe.py), and the loss goes down.

One process each, the tiny configs of examples/ (the same scenarios as
tests/e2e's demos), local layer spec with torch SDPA unless
transformer-engine is installed (``model.layer_impl: auto``).
"""

from __future__ import annotations

import math

import pytest

from megascale_omni.demo.dit_shapes import ensure_dit_shapes_dataset
from tests.gpu.conftest import PROBE, probed, read_probe
from tests.launcher import train_and_read

pytestmark = pytest.mark.timeout(300)

STEPS = 20


def _train_probed(target, tmp_path, entry: str, args: list[str]) -> tuple[list[dict], dict]:
    report = tmp_path / "probe"
    records = train_and_read(PROBE, 1, probed(target, report, entry, [*args, f"train.steps={STEPS}"]),
                             tmp_path / "run", STEPS, timeout=240)
    [seen] = read_probe(report, 1)
    return records, seen


def _check(target, records: list[dict], seen: dict) -> None:
    losses = [r["loss"] for r in records]
    print(f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f}; probe: {seen}")
    assert all(math.isfinite(x) for x in losses)
    assert seen["steps"] == STEPS
    assert seen["param_dtypes"] == [target.dtype]
    assert all(d.startswith(target.device) for d in seen["param_devices"] + seen["batch_devices"])
    assert seen["batches"] >= STEPS and seen["batch_tensors"] > 0
    # Over 20 steps the noise of single steps is below the decrease of every model here.
    assert min(losses[-5:]) < losses[0]


def test_gpt_trains_on_device(target, tmp_path):
    _check(target, *_train_probed(target, tmp_path, "megascale_omni.smoke", ["--config", "examples/gpt/tiny.yaml"]))


def test_llava_trains_on_device(target, tmp_path, llava_dataset):
    args = ["--config", "examples/llava/tiny_cpu.yaml", f"data.path={llava_dataset}", "train.eval_interval=0",
            "train.lr_warmup_steps=2"]
    _check(target, *_train_probed(target, tmp_path, "pretrain_llava.py", args))


def test_moe_gpt_trains_on_device(target, tmp_path):
    """Routed experts (megatron's MoE layer: router, token dispatch, expert MLPs) in the run's precision."""
    _check(target, *_train_probed(target, tmp_path, "megascale_omni.smoke",
                                  ["--config", "examples/gpt/tiny_moe.yaml"]))


def test_llava_video_trains_on_device(target, tmp_path, llava_video_dataset):
    """Clips of 3-4 frames through the tower, pooled 2x2 per frame, with newline tokens (docs/video.md)."""
    args = ["--config", "examples/llava/tiny_cpu.yaml", f"data.path={llava_video_dataset}", "data.video_frames=4",
            "vision.image_newline=true", "train.eval_interval=0", "train.lr_warmup_steps=2"]
    _check(target, *_train_probed(target, tmp_path, "pretrain_llava.py", args))


def test_dit_trains_on_device(target, tmp_path_factory, tmp_path):
    dataset = ensure_dit_shapes_dataset(tmp_path_factory.mktemp("dit") / "d", num_train=400, num_val=10, seed=5)
    args = ["--config", "examples/dit/tiny_cpu.yaml", f"data.path={dataset}", "dit.eval_resolutions=[]", "train.lr_warmup_steps=2"]
    _check(target, *_train_probed(target, tmp_path, "pretrain_dit.py", args))
