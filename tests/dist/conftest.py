"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import pytest

from megascale_omni.demo.llava_shapes import make_shapes_dataset
from tests.launcher import train_and_read

#: The tiny GPT run that multi-process layouts are compared with, step by step.
GPT_CONFIG = "examples/gpt/tiny.yaml"
GPT_STEPS = 10
#: Per-step relative tolerances of a layout against that run: loss and grad
#: norm (fp32 rounding of another summation order; measured margins in
#: tests/dist/test_layout_equivalence.py).
LAYOUT_RTOL = 1e-6
LAYOUT_GRAD_RTOL = 1e-5


@pytest.fixture(scope="session")
def llava_dataset(tmp_path_factory):
    """A small shapes dataset (600 train / 40 val samples, 32 px) built once per session."""
    root = tmp_path_factory.mktemp("shapes")
    make_shapes_dataset(root / "d", num_train=600, num_val=40, seed=7, image_size=32, samples_per_shard=200)
    return root / "d"


@pytest.fixture(scope="session")
def gpt_baseline(tmp_path_factory) -> list[dict]:
    """Per-step records of the tiny GPT (:data:`GPT_CONFIG`, :data:`GPT_STEPS`
    steps) on one process, run once per session."""
    records = train_and_read("megascale_omni.smoke", 1, ["--config", GPT_CONFIG, f"train.steps={GPT_STEPS}"],
                             tmp_path_factory.mktemp("gpt-base"), GPT_STEPS, timeout=240)
    # The run must actually optimise something, or equality proves nothing.
    assert all(r["grad_norm"] > 0 for r in records)
    return records


#: The tiny LLaVA run that LLaVA layouts and resumes are compared with.
LLAVA_CONFIG = "examples/llava/tiny_cpu.yaml"
LLAVA_STEPS = 20


def llava_args(llava_dataset, *extra: str) -> list[str]:
    """The LLaVA comparison runs' arguments: :data:`LLAVA_CONFIG` with default
    settings on ``llava_dataset`` for :data:`LLAVA_STEPS` steps, evaluation at the end only."""
    return ["--config", LLAVA_CONFIG, f"data.path={llava_dataset}", f"train.steps={LLAVA_STEPS}",
            "train.eval_interval=0", *extra]


@pytest.fixture(scope="session")
def llava_baseline(tmp_path_factory, llava_dataset) -> tuple[list[dict], dict[int, list[int]]]:
    """Per-step records of the tiny LLaVA (:func:`llava_args`) on one process,
    and the samples of each step from its ledger (0-based steps), run once per session."""
    from megascale_omni.elastic.ledger import consumed_samples, read_ledger

    out = tmp_path_factory.mktemp("llava-base")
    records = train_and_read("pretrain_llava.py", 1, llava_args(llava_dataset, f"elastic.ledger_dir={out / 'ledger'}"),
                             out, LLAVA_STEPS, timeout=400)
    assert records[-1]["loss"] < records[0]["loss"]  # it trains
    return records, consumed_samples(read_ledger(out / "ledger"))


def _as_video(sample, frames: int):
    """``sample`` with its last image turned into a ``frames``-frame video
    (the image shifted right one pixel a frame) and its last ``<image>``
    marker into ``<video>``: single-image samples become videos, two-image
    ones an image and a video interleaved in their text order."""
    import dataclasses

    import numpy as np

    image = sample.images[-1]
    video = np.stack([np.roll(image, f, axis=1) for f in range(frames)])
    turns = [dict(t) for t in sample.conversation]
    user = turns[0]["text"]
    at = user.rindex("<image>")
    turns[0]["text"] = user[:at] + "<video>" + user[at + len("<image>"):]
    return dataclasses.replace(sample, kind="video", images=sample.images[:-1], videos=[video], conversation=turns)


@pytest.fixture(scope="session")
def llava_video_dataset(tmp_path_factory):
    """The shapes data (160 train samples, 32 px, no val split) with every
    other image sample holding a video instead of its last image: 3- and
    4-frame videos, alone or after an image, among text-only and image
    samples. Its word tokenizer has ``<video>``."""
    from megascale_omni.data.llava.batches import LlavaEncoder
    from megascale_omni.data.shard_writer import write_shards
    from megascale_omni.data.tokenizer import TOKENIZER_FILENAME, build_word_tokenizer
    from megascale_omni.demo.shapes import ShapesConfig, dataset_vocabulary, generate_samples

    root = tmp_path_factory.mktemp("shapes-video") / "d"
    tokenizer = build_word_tokenizer([*dataset_vocabulary(), "<video>"], root / TOKENIZER_FILENAME)
    samples = []
    for i, sample in enumerate(generate_samples(160, seed=7, config=ShapesConfig(image_size=32))):
        samples.append(_as_video(sample, 3 + i % 2) if sample.images and i % 2 else sample)
    assert sum(s.kind == "video" for s in samples) >= 40 and any(s.images and s.videos for s in samples)
    write_shards(samples, root / "train", samples_per_shard=80, coster=LlavaEncoder(tokenizer, 1))
    return root
