"""Deterministic synthetic video clips whose questions need the frame order
(the data half of the embedded demo's video part, issue 32 item 6).

Every clip is ``frames`` frames of one or two bold shapes of the image demo
(:mod:`megascale_omni.demo.shapes`: its colours and shapes) on a black
canvas. Three tasks, each answered by one word that flips when the frames
are played backwards, so a model that ignores the order (or a control fed
the frames shuffled in time) is at chance on them::

    motion        <video> which way does the shape move ?     -> left | right | up | down
    color_change  <video> what color does the shape turn ?    -> the colour of the last frames
                  <video> what color is the shape at first ?  -> the colour of the first frames
    event_order   <video> which shape appears first ?         -> the shape of the first event
                  <video> which color appears last ?          -> the colour of the second event

``motion``: the shape slides across the canvas in a straight line, one step
per frame. ``color_change``: the shape stays put and changes colour half way
through. ``event_order``: two different shapes of different colours show in
turn, the first in the first half of the clip, the second in the second half,
in opposite halves of the canvas drawn at random (which half an event is in
says nothing about when it happens, so only the order answers).

Determinism: clip ``index`` of stream ``stream`` is a pure function of
``(seed, stream, index, config)`` through its own RNG
(:func:`~megascale_omni.demo.shapes.sample_rng` on stream ``CLIP_STREAM +
stream``, so the clips never share random state with the image demo's samples).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from megascale_omni.data.sample import KIND_VIDEO, VIDEO_PLACEHOLDER, Sample
from megascale_omni.demo.shapes import COLORS, SHAPES, ShapeSpec, render_shape, sample_rng

TASKS = ("motion", "color_change", "event_order")
#: Motion directions and their reverse (what the clip shows played backwards).
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
#: Offset of the clips' RNG streams from the image demo's (train 0, val 1).
CLIP_STREAM = 16

_QUESTIONS = {
    "motion": ("which way does the shape move ?",),
    "color_change": ("what color does the shape turn ?", "what color is the shape at first ?"),
    "event_order": ("which shape appears first ?", "which color appears last ?"),
}


@dataclass(frozen=True)
class ClipConfig:
    """Clip geometry: ``frames`` frames of ``size`` x ``size`` pixels, shapes
    of ``extent`` pixels (the motion path leaves a 1-pixel margin)."""

    frames: int = 8
    size: int = 32
    extent: int = 8

    def __post_init__(self) -> None:
        if self.frames < 4 or self.size < 2 * self.extent + 4 or self.extent < 3 or self.size % 2:
            raise ValueError(f"{self}: needs frames >= 4, extent >= 3 and an even size >= 2 * extent + 4")


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _frame(size: int, *specs: ShapeSpec) -> np.ndarray:
    """The canvas with ``specs`` drawn in order (later ones on top)."""
    out = np.zeros((size, size, 3), dtype=np.uint8)
    for spec in specs:
        lit = render_shape(spec, size)
        mask = lit.any(axis=2)
        out[mask] = lit[mask]
    return out


def _motion(rng: np.random.Generator, c: ClipConfig) -> tuple[list[np.ndarray], str, str]:
    color, shape, direction = _pick(rng, list(COLORS)), _pick(rng, SHAPES), _pick(rng, list(OPPOSITE))
    far = c.size - 1 - c.extent
    along = np.linspace(1, far, c.frames).round().astype(int)  # start to end, one step per frame
    if direction in ("left", "up"):
        along = along[::-1]
    across = int(rng.integers(1, far + 1))
    frames = []
    for a in along.tolist():
        x0, y0 = (a, across) if direction in ("left", "right") else (across, a)
        frames.append(_frame(c.size, ShapeSpec(color, shape, "left", x0, y0, c.extent)))
    return frames, _QUESTIONS["motion"][0], direction


def _color_change(rng: np.random.Generator, c: ClipConfig) -> tuple[list[np.ndarray], str, str]:
    first, last = (str(x) for x in rng.choice(list(COLORS), size=2, replace=False))
    shape = _pick(rng, SHAPES)
    x0, y0 = (int(v) for v in rng.integers(1, c.size - c.extent, size=2))
    frames = [_frame(c.size, ShapeSpec(first if i < c.frames // 2 else last, shape, "left", x0, y0, c.extent))
              for i in range(c.frames)]
    k = int(rng.integers(2))
    return frames, _QUESTIONS["color_change"][k], (last, first)[k]


def _event_order(rng: np.random.Generator, c: ClipConfig) -> tuple[list[np.ndarray], str, str]:
    colors = [str(x) for x in rng.choice(list(COLORS), size=2, replace=False)]
    shapes = [str(x) for x in rng.choice(SHAPES, size=2, replace=False)]
    half = c.size // 2
    y = [int(v) for v in rng.integers(1, c.size - c.extent, size=2)]
    x = [int(rng.integers(1, half - c.extent)), int(rng.integers(half + 1, c.size - c.extent))]
    sides = ["left", "right"]
    if rng.integers(2):  # the first event on the right half as often as on the left
        x, sides = x[::-1], sides[::-1]
    events = [ShapeSpec(colors[k], shapes[k], sides[k], x[k], y[k], c.extent) for k in range(2)]
    frames = [_frame(c.size, events[0] if i < c.frames // 2 else events[1]) for i in range(c.frames)]
    k = int(rng.integers(2))
    return frames, _QUESTIONS["event_order"][k], (shapes[0], colors[1])[k]


_TASK_BUILDERS = {"motion": _motion, "color_change": _color_change, "event_order": _event_order}


def generate_clip(index: int, seed: int, config: ClipConfig = ClipConfig(), stream: int = 0) -> Sample:
    """Clip ``index`` of ``stream`` as a video :class:`Sample` (``videos``:
    one uint8 ``[frames, size, size, 3]``); tasks cycle ``index % 3``."""
    rng = sample_rng(seed, index, CLIP_STREAM + stream)
    task = TASKS[index % len(TASKS)]
    frames, question, answer = _TASK_BUILDERS[task](rng, config)
    sample = Sample(
        id=index, kind=KIND_VIDEO, images=[],
        conversation=[{"role": "user", "text": f"{VIDEO_PLACEHOLDER} {question}"},
                      {"role": "assistant", "text": answer}],
        image_dependent_words=[answer], videos=[np.stack(frames)],
    )
    sample.validate()
    return sample


def generate_clips(num: int, seed: int, config: ClipConfig = ClipConfig(), stream: int = 0) -> Iterator[Sample]:
    """Clips ``0..num-1`` of ``stream``."""
    for index in range(num):
        yield generate_clip(index, seed, config, stream)


def task_of(question: str) -> str:
    """The task a clip's question (its user text, ``<video>`` included or not) belongs to."""
    text = question.replace(VIDEO_PLACEHOLDER, "").strip()
    for task, questions in _QUESTIONS.items():
        if text in questions:
            return task
    raise ValueError(f"not a clip question: {question!r}")


def clip_vocabulary() -> list[str]:
    """Every word of the clips' questions and answers (for a word-level tokenizer)."""
    words = {VIDEO_PLACEHOLDER, *COLORS, *SHAPES, *OPPOSITE}
    for questions in _QUESTIONS.values():
        for q in questions:
            words.update(q.split())
    return sorted(words)


def write_clips_llava_json(samples: Sequence[Sample], out_dir: str | os.PathLike, suffix: str = ".mp4",
                           fps: int = 8, name: str = "llava.json") -> Path:
    """Write video ``samples`` in LLaVA-Video's JSON format: ``OUT/<name>``
    plus ``OUT/clips/<id><suffix>`` (a container PyAV writes,
    :data:`~megascale_omni.demo.clips.CODECS`) - input for
    ``tools/ingest_llava.py``. Returns the JSON file's path."""
    from megascale_omni.demo.clips import write_clip

    out = Path(out_dir)
    (out / "clips").mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    for sample in samples:
        (video,) = sample.videos
        rel = f"clips/{sample.id:09d}{suffix}"
        write_clip(out / rel, len(video), video.shape[1], video.shape[2], fps=fps,
                   pixels=lambda i, *_, v=video: v[i])
        records.append({"id": str(sample.id), "video": rel, "conversations": [
            {"from": {"user": "human", "assistant": "gpt"}[t["role"]], "value": t["text"]}
            for t in sample.conversation]})
    path = out / name
    path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return path
