"""The `make demo` job: the tiny LLaVA looks at the image, and at the frame
order of the clips (the learning check of issue 32 item 6).

The demo's embedded set is one fifth 4-frame clips whose answers need the
frame order (a shape that moves, a colour that changes, two events in order;
megascale_omni/demo/video_shapes.py). Held-out accuracy on the image
samples' image-dependent answer words must reach 0.95 (shape words 0.9) while
the shuffled-image control stays at or below 0.5; on the clips' answer words
(motion, colour, shape) 0.9 with the frames in order, while the control - the
same trained model fed each clip's frames in a random order - stays at or
below 0.6: the frames and their content are the same, only their order is
lost, so the gap is what the model reads from the order. Runs the full demo
(``make demo``: the tiny config with the ViT at 0.3 x train.lr, several
minutes), so it is marked slow (`make test-all`).
"""

from __future__ import annotations

import json

import pytest

from tests.launcher import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.timeout(1500)]


def test_demo_uses_the_image_and_the_frame_order(tmp_path):
    out = tmp_path / "demo"
    res = torchrun(2, "pretrain_llava.py", ["--config", "examples/llava/tiny_cpu.yaml", "vision.lr_mult=0.3",
                                            f"logging.output_dir={out}",
                                            "logging.tensorboard=false"], timeout=1400)
    assert res.returncode == 0, res.stderr[-4000:]
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval/real/loss" in r]
    final = evals[-1]
    assert final["eval/real/accuracy/image"] >= 0.95, final
    assert final["eval/real/accuracy/shape"] >= 0.9, final
    assert final["eval/shuffled/accuracy/image"] <= 0.5, final
    assert final["eval/real/accuracy/video"] >= 0.9, final
    assert final["eval/shuffled/accuracy/video"] <= 0.6, final
    assert "shuffled (control)" in res.stderr and "video motion words" in res.stderr  # the table ends the demo
