"""The learning check of issue 32 item 6: the demo's tiny LLaVA, trained on
the demo's mix, looks at the image and at the frame order of the clips.

The embedded set is one fifth 4-frame clips whose answers need the frame
order (a shape that moves, a colour that changes, two events in order;
megascale_omni/demo/video_shapes.py). The control pass gives every image
sample another's images and plays every clip's frames in a random order: the
same trained model and the same frames, only the order lost, so the gap on
the clips is what the model reads from the order.

The run is ``make demo``'s config (the ViT at 0.3 x train.lr) with
:data:`CHECK_OVERRIDES`: twice the demo's 1200 steps (at 1200 the clips
reach 0.77) and every patch feature of a frame in the LM (the 2x2 pooling
leaves 4 tokens of a 4 x 4 grid), on one process (docs/video.md). The
thresholds are the issue's goals, not the measured run (BENCHMARKS.md "Demo
runs" has it): clips >= 0.9 with their frames in order and <= 0.6 shuffled
in time, image samples >= 0.95. About 20 minutes on one free core (45 on
the shared host), so it is marked slow (`make test-all`).
"""

from __future__ import annotations

import json

import pytest

from tests.launcher import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.timeout(4000)]

#: The learning check's run on top of examples/llava/tiny_cpu.yaml: `make demo`'s
#: ViT lr factor, twice its steps, unpooled frames (16 LM tokens a frame, not 4).
CHECK_OVERRIDES = ["vision.lr_mult=0.3", "train.steps=2400", "vision.video_pool_stride=1"]


def test_demo_model_learns_the_image_and_the_frame_order(tmp_path):
    out = tmp_path / "check"
    res = torchrun(1, "pretrain_llava.py", ["--config", "examples/llava/tiny_cpu.yaml", *CHECK_OVERRIDES,
                                            f"logging.output_dir={out}", "logging.tensorboard=false"],
                   timeout=3900)
    assert res.returncode == 0, res.stderr[-4000:]
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval/real/loss" in r]
    final = evals[-1]
    assert final["eval/real/accuracy/image"] >= 0.95, final
    assert final["eval/shuffled/accuracy/image"] <= 0.5, final
    assert final["eval/real/accuracy/video"] >= 0.9, final
    assert final["eval/shuffled/accuracy/video"] <= 0.6, final
    assert "shuffled (control)" in res.stderr and "video motion words" in res.stderr  # the table ends the run
