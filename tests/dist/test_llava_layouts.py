"""LLaVA under TP2, PP2, CP2 and 4-process layouts (with DP, or TP2xCP2 and
PP2xCP2) matches TP1/PP1/CP1.

Same seed, same data, fp32: the per-step loss of 20 steps must agree within
1e-6 relative with the single-process run (measured: below 1e-7), the grad
norm within 1e-5 (measured: below 3.1e-6, PP2). The ViT and projector live on
pipeline stage 0, so PP2 checks that image features cross the stage boundary
correctly, and TP2 that the ViT/projector/LM shards recombine exactly;
``pp2-workers`` that micro-batches built in ``data.num_workers`` processes
train the same model as those built in the training process. CP layouts
split every packed row over the CP ranks (ring attention; each CP rank runs
the ViT on all images and keeps the features of its placeholders).
Sequence-parallel layouts (TP2 + SP, alone and with selective recompute and
the distributed optimizer, PP2, CP2 or DP2) scatter the embeddings with the
image features spliced in over the TP ranks. Every layout runs the same
config with default settings (``data.pad_to_multiple_of`` included, whose
default is the same at every layout).

Video (issue 32): TP2, PP2, DP2 and CP2 match one process at the same
tolerances on a mix of text, image, video and image-then-video samples,
with LLaVA-OneVision's layout (frames pooled 2x2, the ``image_newline``
parameter after each image and video): the frames cross PP's stage
boundary as features, TP recombines tower and projector shards for them,
DP balances videos by their frames, CP ranks keep the pooled features of
their own video placeholders.
"""

from __future__ import annotations

import pytest

from tests.dist.conftest import LLAVA_CONFIG, LLAVA_STEPS, llava_args
from tests.launcher import assert_same_training, train_and_read

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

STEPS = LLAVA_STEPS
RTOL = 1e-6
GRAD_RTOL = 1e-5
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2-dp2": (4, ["parallel.tp=2"]),
    "pp2-dp2": (4, ["parallel.pp=2"]),
    # Micro-batches built in a worker process per rank (data.num_workers): the same training.
    "pp2-workers": (2, ["parallel.pp=2", "data.num_workers=1"]),
    # Context parallelism: every packed row split over 2 ranks, ring attention,
    # the ViT on all images on each CP rank.
    "cp2": (2, ["parallel.cp=2"]),
    "tp2-cp2": (4, ["parallel.tp=2", "parallel.cp=2"]),
    "pp2-cp2": (4, ["parallel.pp=2", "parallel.cp=2"]),
    # Sequence parallelism (docs/memory.md): the spliced embedding scattered
    # over TP, norm gradients all-reduced. The 2-process case is the 7B
    # recipes' memory levers together: SP, selective recompute, distributed optimizer.
    "tp2-sp-selective-distopt": (2, SP + ["model.recompute=selective", "parallel.use_distributed_optimizer=true"]),
    "tp2-sp": (2, SP),
    "tp2-sp-pp2": (4, SP + ["parallel.pp=2"]),
    "tp2-sp-cp2": (4, SP + ["parallel.cp=2"]),
    "tp2-sp-dp2-distopt": (4, SP + ["parallel.use_distributed_optimizer=true"]),
}

SLOW = {'pp2-dp2', 'tp2-dp2', 'pp2-workers', 'tp2-cp2', 'pp2-cp2', 'tp2-sp', 'tp2-sp-pp2', 'tp2-sp-cp2',
        'tp2-sp-dp2-distopt'}


def _train(tmp_path_factory, llava_dataset, name, nproc, overrides):
    # Default settings: the default sample padding (8) serves CP2 and is the
    # same at every layout, so all of them pack identical rows.
    out = tmp_path_factory.mktemp(f"llava-{name}")
    return train_and_read("pretrain_llava.py", nproc, llava_args(llava_dataset, *overrides), out, STEPS, timeout=400)


@pytest.fixture(scope="module")
def baseline(llava_baseline):
    return llava_baseline[0]


# 4-process variants run in make test-all (2 cores: each takes ~40 s); the 2-process ones in make test.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_llava_layout_matches_single_process(tmp_path_factory, llava_dataset, baseline, name):
    nproc, overrides = LAYOUTS[name]
    records = _train(tmp_path_factory, llava_dataset, name, nproc, overrides)
    assert_same_training(baseline, records, name, RTOL, GRAD_RTOL, counters=("samples", "loss_tokens"))


VIDEO_STEPS = 10
VIDEO_LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2": [], "cp2": ["parallel.cp=2"]}
# make test runs CP2 (each CP rank picks its own rows of the pooled video
# features) and PP2 (the frames go to stage 0 only, the pooled features cross
# the stage boundary); TP2 and DP2 run in make test-all (~25 s each on 2 cores).
VIDEO_SLOW = {"tp2", "dp2"}


def _video_args(dataset, *extra: str) -> list[str]:
    return ["--config", LLAVA_CONFIG, f"data.path={dataset}", f"train.steps={VIDEO_STEPS}", "data.video_frames=4",
            "vision.image_newline=true", "train.global_batch_size=4", *extra]


@pytest.fixture(scope="module")
def video_baseline(tmp_path_factory, llava_video_dataset):
    records = train_and_read("pretrain_llava.py", 1, _video_args(llava_video_dataset),
                             tmp_path_factory.mktemp("llava-video-base"), VIDEO_STEPS, timeout=400)
    assert records[-1]["loss"] < records[0]["loss"]  # it trains
    return records


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in VIDEO_SLOW else n
                                  for n in VIDEO_LAYOUTS])
def test_llava_video_layout_matches_single_process(tmp_path_factory, llava_video_dataset, video_baseline, name):
    records = train_and_read("pretrain_llava.py", 2, _video_args(llava_video_dataset, *VIDEO_LAYOUTS[name]),
                             tmp_path_factory.mktemp(f"llava-video-{name}"), VIDEO_STEPS, timeout=400)
    assert_same_training(video_baseline, records, f"video-{name}", RTOL, GRAD_RTOL,
                         counters=("samples", "loss_tokens"))
