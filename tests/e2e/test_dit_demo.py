"""The DiT demo: the pipeline runs end to end (fast), and the full demo
config learns the colour prompts (slow, `make test-all`)."""

from __future__ import annotations

import json
import sys

import pytest
from PIL import Image

from megascale_omni.checkpoint import layout
from megascale_omni.demo.dit_shapes import ensure_dit_shapes_dataset
from tests.launcher import read_metrics, run, run_tool_in_process, torchrun

CONFIG = "examples/dit/tiny_cpu.yaml"


@pytest.mark.timeout(300)
def test_train_evaluate_and_sample_tool_run_end_to_end(tmp_path):
    data = ensure_dit_shapes_dataset(tmp_path / "d", num_train=300, num_val=10, seed=3)
    out = tmp_path / "run"
    res = run([sys.executable, "pretrain_dit.py", "--config", CONFIG, f"data.path={data}", "train.steps=6",
               "model.num_layers=2", "dit.sample_steps=2", "dit.eval_samples_per_prompt=1",
               f"logging.output_dir={out}", "logging.tensorboard=false"], timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "padding waste" in res.stderr and "pad to largest" in res.stderr
    records = read_metrics(out)
    assert len(records) == 6 and records[0]["excluded_samples"] == 0
    # Model FLOPs follow each step's packages (their buckets and image counts differ), not a nominal package.
    assert len({r["model_tflop"] for r in records}) == 6
    result = json.loads((out / "color_accuracy-step6.json").read_text())
    assert result["color_samples"] == 14 and 0.0 <= result["color_accuracy"] <= 1.0
    grid = Image.open(out / "samples-step6.png")
    assert grid.width > 4 * 32 and grid.height > 14 * 16  # 7 colours x 2 resolutions, 4x upscaled
    # The demo config checkpoints into the run directory; the tool samples from it. In this process:
    # its command line runs in tests/e2e/test_dit_checkpoint.py.
    [saved] = layout.scan_tier(out / "checkpoints", "persistent")
    assert saved.complete and saved.step == 6 and saved.commit["reason"] == "end"

    res = run_tool_in_process("tools/sample_dit.py", "--checkpoint", out / "checkpoints", "--prompt",
                              "a red circle", "--prompt", "a blue square", "--size", "12x20", "--per-prompt", "2",
                              "--steps", "2", "--out", tmp_path / "grid.png", "--score-colors")
    assert res.returncode == 0, res.stderr[-4000:]
    assert Image.open(tmp_path / "grid.png").height > 2 * 12 * 4
    scores = json.loads(res.stdout[res.stdout.index("{"):])
    assert set(scores["per_prompt"]) == {"a red circle @ 12x20", "a blue square @ 12x20"}

    res = run_tool_in_process("tools/sample_dit.py", "--checkpoint", out / "checkpoints", "--prompt",
                              "a red circle", "--size", "10x20", "--out", tmp_path / "bad.png")
    assert res.returncode == 2 and "--size='10x20'" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(2400)
def test_demo_learns_the_prompted_colours(tmp_path):
    out = tmp_path / "demo"
    res = torchrun(2, "pretrain_dit.py", ["--config", CONFIG, f"logging.output_dir={out}", "logging.tensorboard=false"],
                   timeout=2300)
    assert res.returncode == 0, res.stderr[-4000:]
    result = json.loads(sorted(out.glob("color_accuracy-step*.json"))[-1].read_text())
    assert result["color_accuracy"] >= 0.8, result
    assert (out / "samples-step1200.png").is_file()
    # the sampling tool reproduces it from the final checkpoint, in one process
    res = run([sys.executable, "tools/sample_dit.py", "--checkpoint", str(out / "checkpoints"), "--prompt",
               "a green square", "--prompt", "a magenta circle", "--size", "16x16", "--size", "24x12",
               "--out", str(out / "tool-samples.png"), "--score-colors"], timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    assert json.loads(res.stdout[res.stdout.index("{"):])["color_accuracy"] >= 0.75
