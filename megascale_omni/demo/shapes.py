"""Deterministic synthetic "shapes" image-text conversations.

Every image is one bold, solid, axis-aligned shape (square / circle / triangle)
in one of seven saturated colours, placed in the left or right half of a black
canvas. Questions are built so that their answers *require* the image: a model
that ignores the pixels can do no better than chance on the image-dependent
answer words (1/7 colour, 1/3 shape, 1/2 position, 1/2 yes/no), while a tiny
ViT can read every attribute almost perfectly, since the classes differ in
hue, area (1 : pi/4 : 1/2 of the bounding box) and which half of the image is lit.

Determinism: sample ``index`` of stream ``stream`` is a pure function of
``(seed, stream, index, config)``; the RNG is
``np.random.default_rng(SeedSequence([seed, stream, index]))``, so any sample
can be regenerated on its own and different streams (train / val) never share
random state.

Sample kinds (default fractions 15% / 65% / 20%) and their templates
(``<image>`` is :data:`~megascale_omni.data.sample.IMAGE_PLACEHOLDER`)::

    text_only     what number comes after three ?              -> four
                  repeat : red circle                          -> red circle
    single_image  <image> what color is the shape ?            -> red
                  <image> what shape is it ?                   -> circle
                  <image> where is the shape ?                 -> left
                  <image> describe the image .                 -> a red circle on the left
    multi_image   <image> <image> what color is the shape in the second image ?  -> blue
                  <image> <image> what shape is in the first image ?           -> square
                  <image> <image> do the two images have the same color ?      -> yes
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np
from PIL import Image, ImageDraw

from megascale_omni.data.sample import (
    IMAGE_PLACEHOLDER,
    KIND_MULTI_IMAGE,
    KIND_SINGLE_IMAGE,
    KIND_TEXT_ONLY,
    SAMPLE_KINDS,
    Sample,
)

# Saturated RGB triples that stay far apart after any reasonable resize/normalise.
# Blue is lifted slightly in green so it is not nearly as dark as the background.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 90, 255),
    "yellow": (255, 255, 0),
    "magenta": (255, 0, 255),
    "cyan": (0, 255, 255),
    "white": (255, 255, 255),
}
SHAPES = ("square", "circle", "triangle")
POSITIONS = ("left", "right")
ORDINALS = ("first", "second")
NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen twenty"
).split()

# Question templates. ``{...}`` fields are filled per sample; every other word
# is literal and goes into the vocabulary (see dataset_vocabulary()).
SINGLE_IMAGE_TEMPLATES: dict[str, tuple[str, str]] = {
    "color": ("what color is the shape ?", "{color}"),
    "shape": ("what shape is it ?", "{shape}"),
    "position": ("where is the shape ?", "{position}"),
    "caption": ("describe the image .", "a {color} {shape} on the {position}"),
}
MULTI_IMAGE_TEMPLATES: dict[str, tuple[str, str]] = {
    "color_nth": ("what color is the shape in the {ordinal} image ?", "{color}"),
    "shape_nth": ("what shape is in the {ordinal} image ?", "{shape}"),
    "same_color": ("do the two images have the same color ?", "{yes_no}"),
}
TEXT_ONLY_TEMPLATES: dict[str, tuple[str, str]] = {
    "successor": ("what number comes after {number} ?", "{next_number}"),
    "repeat": ("repeat : {phrase}", "{phrase}"),
}
# Multi-image templates speak of "the two images", so this is not configurable.
IMAGES_PER_MULTI_SAMPLE = 2

_MIN_IMAGE_SIZE = 16  # below this a 1-pixel margin plus jitter no longer fits


@dataclass(frozen=True)
class ShapesConfig:
    """Knobs of the generator. Changing any field changes the dataset.

    Attributes:
        image_size: side of the square RGB canvas in pixels (>= 16).
        text_only_fraction / single_image_fraction / multi_image_fraction:
            expected share of each sample kind; must sum to 1.
        single_image_questions / multi_image_questions / text_only_questions:
            template names drawn uniformly for each kind (keys of the
            ``*_TEMPLATES`` dicts). Listing a name twice doubles its weight.
        min_extent / max_extent: shape bounding-box side as a fraction of
            ``image_size``; the default 0.36-0.44 gives 12-14 px at 32x32,
            large enough for circle / square / triangle to differ clearly.
    """

    image_size: int = 32
    text_only_fraction: float = 0.15
    single_image_fraction: float = 0.65
    multi_image_fraction: float = 0.20
    single_image_questions: tuple[str, ...] = tuple(SINGLE_IMAGE_TEMPLATES)
    multi_image_questions: tuple[str, ...] = tuple(MULTI_IMAGE_TEMPLATES)
    text_only_questions: tuple[str, ...] = tuple(TEXT_ONLY_TEMPLATES)
    min_extent: float = 0.36
    max_extent: float = 0.44

    def __post_init__(self) -> None:
        if self.image_size < _MIN_IMAGE_SIZE:
            raise ValueError(f"image_size must be >= {_MIN_IMAGE_SIZE}, got {self.image_size}")
        fracs = self.kind_fractions
        if min(fracs) < 0 or abs(sum(fracs) - 1.0) > 1e-6:
            raise ValueError(f"kind fractions must be >= 0 and sum to 1, got {fracs}")
        for names, table in (
            (self.single_image_questions, SINGLE_IMAGE_TEMPLATES),
            (self.multi_image_questions, MULTI_IMAGE_TEMPLATES),
            (self.text_only_questions, TEXT_ONLY_TEMPLATES),
        ):
            unknown = [n for n in names if n not in table]
            if not names or unknown:
                raise ValueError(f"question list {names} must be non-empty and from {sorted(table)}")
        if not 0.0 < self.min_extent <= self.max_extent < 0.5:
            raise ValueError("need 0 < min_extent <= max_extent < 0.5 (a shape must fit in half the image)")

    @property
    def kind_fractions(self) -> tuple[float, float, float]:
        """Fractions in :data:`SAMPLE_KINDS` order."""
        return (self.text_only_fraction, self.single_image_fraction, self.multi_image_fraction)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "ShapesConfig":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass(frozen=True)
class ShapeSpec:
    """One shape on a canvas: attributes plus its integer bounding box.

    The box spans pixels ``[x0, x0 + extent)`` x ``[y0, y0 + extent)`` and lies
    entirely inside the half named by ``position`` with a >= 1 px margin.
    """

    color: str
    shape: str
    position: str
    x0: int
    y0: int
    extent: int


def sample_shape_spec(rng: np.random.Generator, image_size: int, config: ShapesConfig,
                      color: str | None = None) -> ShapeSpec:
    """Draw random attributes and a jittered box; ``color`` pins the colour."""
    color_names = list(COLORS)
    if color is None:
        color = color_names[int(rng.integers(len(color_names)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    position = POSITIONS[int(rng.integers(len(POSITIONS)))]
    lo = max(3, int(round(config.min_extent * image_size)))
    hi = max(lo, int(round(config.max_extent * image_size)))
    extent = int(rng.integers(lo, hi + 1))
    half = image_size // 2
    # 1 px margin from the canvas border and from the vertical midline.
    x_lo = 1 if position == "left" else half + 1
    x_hi = (half - 1 - extent) if position == "left" else (image_size - 1 - extent)
    x0 = int(rng.integers(x_lo, max(x_lo, x_hi) + 1))
    y0 = int(rng.integers(1, image_size - extent))
    return ShapeSpec(color, shape, position, x0, y0, extent)


def render_shape(spec: ShapeSpec, image_size: int) -> np.ndarray:
    """Draw ``spec`` on a black canvas; returns np.uint8 ``[image_size, image_size, 3]``.

    No anti-aliasing: every lit pixel has exactly the class colour, which keeps
    the colour task trivially separable.
    """
    img = Image.new("RGB", (image_size, image_size), (0, 0, 0))
    draw = ImageDraw.Draw(img)
    fill = COLORS[spec.color]
    x1, y1 = spec.x0 + spec.extent - 1, spec.y0 + spec.extent - 1
    if spec.shape == "square":
        draw.rectangle((spec.x0, spec.y0, x1, y1), fill=fill)
    elif spec.shape == "circle":
        draw.ellipse((spec.x0, spec.y0, x1, y1), fill=fill)
    elif spec.shape == "triangle":
        draw.polygon([(spec.x0, y1), (x1, y1), ((spec.x0 + x1) / 2.0, spec.y0)], fill=fill)
    else:
        raise ValueError(f"unknown shape {spec.shape!r}")
    return np.asarray(img, dtype=np.uint8).copy()


def sample_rng(seed: int, index: int, stream: int = 0) -> np.random.Generator:
    """The RNG that fully determines sample ``index`` of ``stream``."""
    if min(seed, index, stream) < 0:
        raise ValueError(f"seed, stream and index must be >= 0, got {(seed, stream, index)}")
    return np.random.default_rng(np.random.SeedSequence([seed, stream, index]))


def _pick(rng: np.random.Generator, options) -> str:
    options = list(options)
    return options[int(rng.integers(len(options)))]


def _user(n_images: int, question: str) -> str:
    return " ".join([IMAGE_PLACEHOLDER] * n_images + [question])


def _text_only(rng: np.random.Generator, config: ShapesConfig) -> tuple[list[ShapeSpec], str, str, list[str]]:
    qtype = _pick(rng, config.text_only_questions)
    q, a = TEXT_ONLY_TEMPLATES[qtype]
    if qtype == "successor":
        i = int(rng.integers(len(NUMBERS) - 1))
        fields = {"number": NUMBERS[i], "next_number": NUMBERS[i + 1]}
    else:  # repeat: 2-3 attribute words, so copying is the only way to be right
        pool = list(COLORS) + list(SHAPES) + list(POSITIONS)
        n = int(rng.integers(2, 4))
        fields = {"phrase": " ".join(_pick(rng, pool) for _ in range(n))}
    return [], q.format(**fields), a.format(**fields), []


def _single_image(rng: np.random.Generator, config: ShapesConfig) -> tuple[list[ShapeSpec], str, str, list[str]]:
    qtype = _pick(rng, config.single_image_questions)
    spec = sample_shape_spec(rng, config.image_size, config)
    q, a = SINGLE_IMAGE_TEMPLATES[qtype]
    fields = {"color": spec.color, "shape": spec.shape, "position": spec.position}
    dependent = {
        "color": [spec.color],
        "shape": [spec.shape],
        "position": [spec.position],
        "caption": [spec.color, spec.shape, spec.position],
    }[qtype]
    return [spec], _user(1, q.format(**fields)), a.format(**fields), dependent


def _multi_image(rng: np.random.Generator, config: ShapesConfig) -> tuple[list[ShapeSpec], str, str, list[str]]:
    qtype = _pick(rng, config.multi_image_questions)
    q, a = MULTI_IMAGE_TEMPLATES[qtype]
    first = sample_shape_spec(rng, config.image_size, config)
    if qtype == "same_color":
        # Balance yes/no 50:50; independent colours would make "no" right 6/7
        # of the time and let a blind model score well above chance.
        same = bool(rng.integers(2))
        second_color = first.color if same else _pick(rng, [c for c in COLORS if c != first.color])
        second = sample_shape_spec(rng, config.image_size, config, color=second_color)
        answer = "yes" if same else "no"
        return [first, second], _user(2, q), answer, [answer]
    second = sample_shape_spec(rng, config.image_size, config)
    which = int(rng.integers(IMAGES_PER_MULTI_SAMPLE))
    target = (first, second)[which]
    fields = {"ordinal": ORDINALS[which], "color": target.color, "shape": target.shape}
    dependent = [target.color] if qtype == "color_nth" else [target.shape]
    return [first, second], _user(2, q.format(**fields)), a.format(**fields), dependent


_KIND_BUILDERS = {
    KIND_TEXT_ONLY: _text_only,
    KIND_SINGLE_IMAGE: _single_image,
    KIND_MULTI_IMAGE: _multi_image,
}


def generate_sample(index: int, seed: int, config: ShapesConfig | None = None, stream: int = 0) -> Sample:
    """Sample ``index`` of ``stream``; ``Sample.id == index``.

    Pure function of its arguments (see module docstring). The returned sample
    satisfies :meth:`Sample.validate`.
    """
    config = config or ShapesConfig()
    rng = sample_rng(seed, index, stream)
    kind = SAMPLE_KINDS[int(rng.choice(len(SAMPLE_KINDS), p=config.kind_fractions))]
    specs, user, answer, dependent = _KIND_BUILDERS[kind](rng, config)
    return Sample(
        id=index,
        kind=kind,
        images=[render_shape(s, config.image_size) for s in specs],
        conversation=[{"role": "user", "text": user}, {"role": "assistant", "text": answer}],
        image_dependent_words=dependent,
    )


def generate_samples(num_samples: int, seed: int, config: ShapesConfig | None = None,
                     stream: int = 0, start: int = 0) -> Iterator[Sample]:
    """Samples ``start .. start + num_samples - 1`` of ``stream``, lazily."""
    config = config or ShapesConfig()
    for index in range(start, start + num_samples):
        yield generate_sample(index, seed, config, stream)


def dataset_vocabulary() -> list[str]:
    """Every word any generated sample can contain, sorted; excludes ``<image>``.

    Derived from the template literals plus the attribute/answer word lists, so
    it does not depend on which samples happen to be drawn.
    """
    words: set[str] = set(COLORS) | set(SHAPES) | set(POSITIONS) | set(ORDINALS) | set(NUMBERS)
    words |= {"yes", "no"}
    for table in (SINGLE_IMAGE_TEMPLATES, MULTI_IMAGE_TEMPLATES, TEXT_ONLY_TEMPLATES):
        for question, answer in table.values():
            literal = re.sub(r"\{[a-z_]+\}", " ", f"{question} {answer}")
            words.update(literal.split())
    return sorted(words)
