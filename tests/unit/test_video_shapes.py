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


def test_the_canvas_half_does_not_tell_which_event_came_first():
    """Event-order clips put their first event on either half of the canvas,
    so only the frame order answers (not where the shape is)."""
    halves = [np.argwhere(_lit(clip.videos[0][0]))[:, 1].mean() < 16 for clip in generate_clips(90, seed=11)
              if task_of(clip.user_text) == "event_order"]
    assert len(halves) == 30 and 10 <= sum(halves) <= 20, sum(halves)


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


def test_the_control_plays_clip_frames_out_of_order_and_scores_split_by_modality(tmp_path):
    """The evaluation's control (``shuffle_frames``) gives each clip its own
    frames in a random order fixed by the sample id, tokens unchanged;
    ``video_mask`` marks every token of a clip's sample; the score splits
    image-sample and clip accuracy, categories counting their own modality."""
    import torch

    from megascale_omni.data.llava.batches import LlavaBatcher, LlavaEncoder
    from megascale_omni.data.packing import Pack
    from megascale_omni.data.tokenizer import build_word_tokenizer
    from megascale_omni.demo.llava_shapes import make_shapes_dataset, open_shapes_split
    from megascale_omni.demo.vocabulary import vocabulary
    from megascale_omni.evaluation.chat import score_tokens

    make_shapes_dataset(tmp_path / "ds", num_train=10, num_val=2, seed=3, samples_per_shard=10, video_fraction=0.2)
    reader = open_shapes_split(tmp_path / "ds", "train")
    tok = build_word_tokenizer(vocabulary(), tmp_path / "tok.json")
    batcher = LlavaBatcher(reader, LlavaEncoder(tok, 16, tok.token_to_id("<video>"), lambda f: 4 * f), 128, 0, 32)
    ids = list(range(10))
    packs = [Pack((i,), (0,), (len(batcher._load(i, None).tokens),)) for i in (3, 4, 9)]  # an image sample, 2 clips
    real, control = batcher.microbatch(packs, ids), batcher.microbatch(packs, ids, shuffle_frames=True)
    assert torch.equal(real["tokens"], control["tokens"]) and torch.equal(real["images"], control["images"])
    assert real["video_frames"].tolist() == [4, 4]
    for v in range(2):
        mine, theirs = real["videos"][4 * v: 4 * v + 4], control["videos"][4 * v: 4 * v + 4]
        order = np.random.default_rng([7, (4, 9)[v]]).permutation(4)
        assert torch.equal(theirs, mine[order])
    assert not torch.equal(real["videos"], control["videos"])
    lengths = [p.lengths[0] for p in packs]
    # Shifted like the loss mask (on the labels): a sample's tokens but its last.
    assert real["video_mask"].sum(1).tolist() == [0, lengths[1] - 1, lengths[2] - 1]
    # Right on every image-sample token, wrong on every clip token.
    labels, clip = real["labels"], real["video_mask"]
    logits = torch.nn.functional.one_hot(torch.where(clip > 0, (labels + 1) % tok.vocab_size, labels),
                                         tok.vocab_size).float().reshape(1, -1, tok.vocab_size)
    colors = torch.tensor([tok.token_to_id(c) for c in COLORS])
    _, _, report = score_tokens(logits, real, "eval_mask", {"color": colors}, {"color": colors})
    scored = real["eval_mask"]
    assert report["accuracy/image"].tolist() == [float((scored * (1 - clip)).sum())] * 2
    assert report["accuracy/video"].tolist() == [0.0, float((scored * clip).sum())] and float((scored * clip).sum()) == 2
    in_colors = torch.isin(labels, colors).float() * scored
    assert report["accuracy/color"][1] == (in_colors * (1 - clip)).sum()
    assert report["accuracy/video color"].tolist() == [0.0, float((in_colors * clip).sum())]
