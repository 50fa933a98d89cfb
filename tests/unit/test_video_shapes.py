"""The demo's synthetic video clips (megascale_omni/demo/video_shapes.py,
issue 32 item 6, data half): deterministic like the image shapes, every
answer read back from the pixels by a plain reader, and every answer
changed when the frames are played backwards (the questions need the
order); clips written as mp4 ingest and, after lossy coding and frame
sampling, still give every answer in order."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_omni.data.llava.ingest import IngestInputs, ingest
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.data.video import VideoSampling
from megascale_omni.demo.shapes import COLORS
from megascale_omni.demo.video_shapes import (
    TASKS,
    ClipConfig,
    clip_vocabulary,
    generate_clip,
    generate_clips,
    task_of,
    write_clips_llava_json,
)


def _lit(frame: np.ndarray) -> np.ndarray:
    return frame.max(axis=2) > 100


def _color(frame: np.ndarray) -> str:
    mean = frame[_lit(frame)].astype(float).mean(axis=0)
    return min(COLORS, key=lambda c: float(np.abs(np.asarray(COLORS[c]) - mean).sum()))


def _shape(frame: np.ndarray) -> str:
    ys, xs = np.nonzero(_lit(frame))
    fill = ys.size / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    return "square" if fill > 0.9 else "circle" if fill > 0.68 else "triangle"


def _read(question: str, frames: np.ndarray) -> str:
    """The answer a reader of the pixels gives, taking the frames in the order given."""
    task, first, last = task_of(question), frames[0], frames[-1]
    if task == "motion":
        (y0, x0), (y1, x1) = (np.argwhere(_lit(f)).mean(axis=0) for f in (first, last))
        dx, dy = x1 - x0, y1 - y0
        return ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
    if question.endswith("turn ?") or question.endswith("last ?"):
        return _color(last)
    if question.endswith("at first ?"):
        return _color(first)
    return _shape(first)  # which shape appears first


def test_clips_are_deterministic_and_cycle_the_tasks():
    a, b = generate_clip(4, seed=3), generate_clip(4, seed=3)
    assert np.array_equal(a.videos[0], b.videos[0]) and a.conversation == b.conversation
    assert not np.array_equal(a.videos[0], generate_clip(4, seed=4).videos[0])
    clips = list(generate_clips(12, seed=3, config=ClipConfig(frames=6)))
    assert [task_of(c.user_text) for c in clips] == list(TASKS) * 4
    assert all(c.videos[0].shape == (6, 32, 32, 3) and c.videos[0].dtype == np.uint8 for c in clips)
    vocab = set(clip_vocabulary())
    assert all(set(c.user_text.split()) | set(c.answer_text.split()) <= vocab for c in clips)
    assert len({c.answer_text for c in clips}) > 6  # answers vary
    with pytest.raises(ValueError, match="extent"):
        ClipConfig(size=10)


def test_every_answer_is_in_the_pixels_and_flips_when_the_clip_plays_backwards():
    for clip in generate_clips(60, seed=11):
        video, question, answer = clip.videos[0], clip.user_text, clip.answer_text
        assert _read(question, video) == answer, (clip.id, question)
        assert _read(question, video[::-1]) != answer, (clip.id, question)


def test_clips_ingest_from_mp4_and_keep_their_answers_in_order(tmp_path):
    clips = list(generate_clips(9, seed=5))
    json_path = write_clips_llava_json(clips, tmp_path / "src")
    report = ingest(IngestInputs(llava_json=[str(json_path)], image_root=str(tmp_path / "src")),
                    tmp_path / "train", samples_per_shard=4, video=VideoSampling(frames=4))
    assert report.kept == 9 and not report.rejected
    reader = ShardedSampleReader(tmp_path / "train")
    for i, clip in enumerate(clips):
        stored = reader[i]
        assert stored.videos[0].shape == (4, 32, 32, 3)
        assert stored.user_text == clip.user_text and stored.answer_text == clip.answer_text
        assert _read(stored.user_text, stored.videos[0]) == clip.answer_text, (i, clip.user_text)
