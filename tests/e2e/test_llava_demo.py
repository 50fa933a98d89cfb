"""The `make demo` job: the tiny LLaVA looks at the image.

Held-out accuracy on image-dependent answer words must reach 0.95 with the
real images (shape words 0.9) while the shuffled-image control stays at or
below 0.5. Runs the full demo (``make demo``: the tiny config with the ViT at
0.3 x train.lr, several minutes), so it is marked slow (`make test-all`).
"""

from __future__ import annotations

import json

import pytest

from tests.launcher import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.timeout(1500)]


def test_demo_uses_the_image(tmp_path):
    out = tmp_path / "demo"
    res = torchrun(2, "pretrain_llava.py", ["--config", "examples/llava/tiny_cpu.yaml", "vision.lr_mult=0.3",
                                            f"logging.output_dir={out}",
                                            "logging.tensorboard=false"], timeout=1400)
    assert res.returncode == 0, res.stderr[-4000:]
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval/real/loss" in r]
    final = evals[-1]
    assert final["eval/real/image_word_accuracy"] >= 0.95, final
    assert final["eval/real/accuracy/shape"] >= 0.9, final
    assert final["eval/shuffled/image_word_accuracy"] <= 0.5, final
    assert "shuffled (control)" in res.stderr  # the table ends the demo output
