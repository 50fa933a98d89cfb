"""Image preprocessing as the vision tower expects it, read from its ``preprocessor_config.json``.

Modes (:data:`IMAGE_MODES`):

* ``exact``: the historical behaviour of the shapes demo. The image must
  already be ``image_size`` square; pixels are scaled to [-1, 1].
* ``resize_crop``: CLIP's default. Resize (shortest edge to ``size``, or to
  ``height x width``) with the configured PIL filter, centre crop to
  ``crop_size``, rescale and normalise with the tower's mean/std.
* ``pad_square``: LLaVA-1.5. Pad the short side symmetrically with the mean
  colour (``int(255 * mean)`` per channel) to a square, then ``resize_crop``.
* ``anyres``: LLaVA-NeXT style tiling. Choose the best-fitting resolution of
  ``grid_pinpoints`` (most of the image's pixels kept, then least padding),
  resize keeping the aspect ratio, pad with black to that resolution and cut
  ``crop_size`` tiles, row-major; a downscaled overview of the whole image
  comes first. Each tile is one tower input.

Every mode returns a float32 tensor ``[n, 3, S, S]`` (``n = 1`` except for
``anyres``: ``1 + tiles``) with ``S`` the tower's input side, so the model can
treat each of the ``n`` views as one image of ``tokens_per_image`` tokens.

The numerics follow the PIL backends of ``transformers``' image processors
(uint8 PIL resize, integer centre-crop offsets, float64 rescale then float32
normalise); ``tests/unit/test_image_preprocess.py`` compares them.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from PIL import Image

logger = logging.getLogger(__name__)

PREPROCESSOR_FILENAME = "preprocessor_config.json"
#: What transformers 5 saves for a whole processor (``LlavaProcessor``): the
#: image processor's settings sit under its ``image_processor`` key.
PROCESSOR_FILENAME = "processor_config.json"
IMAGE_MODES = ("exact", "resize_crop", "pad_square", "anyres")

#: LLaVA-NeXT's candidate resolutions for a 336-pixel tower, ``(height, width)``.
DEFAULT_GRID_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


@dataclass(frozen=True)
class PreprocessorSpec:
    """The fields of a CLIP/SigLIP ``preprocessor_config.json`` we use.

    Sizes are ``(height, width)`` in pixels; ``resize_shortest_edge`` set
    means "resize the short side to it, keep the aspect ratio" and
    ``resize_hw`` is ignored.
    """

    resize_shortest_edge: Optional[int]
    resize_hw: tuple[int, int]
    crop_hw: Optional[tuple[int, int]]
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1 / 255
    #: PIL filter id (``PIL.Image.Resampling``; 3 = bicubic).
    resample: int = 3
    grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_GRID_PINPOINTS

    @property
    def output_hw(self) -> tuple[int, int]:
        """``(height, width)`` of a processed view."""
        if self.crop_hw is not None:
            return self.crop_hw
        if self.resize_shortest_edge is not None:
            return (self.resize_shortest_edge, self.resize_shortest_edge)
        return self.resize_hw

    @classmethod
    def plain(cls, image_size: int) -> "PreprocessorSpec":
        """No preprocessor config: resize to ``image_size`` square, mean = std = 0.5
        (the same [-1, 1] range as the ``exact`` mode)."""
        return cls(None, (image_size, image_size), None, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))

    @classmethod
    def from_dict(cls, conf: dict) -> "PreprocessorSpec":
        """From the JSON object of a ``preprocessor_config.json``."""
        size = conf.get("size", {"shortest_edge": 224})
        if isinstance(size, int):  # old configs: an int means shortest edge
            size = {"shortest_edge": size}
        shortest = size.get("shortest_edge")
        hw = (int(size.get("height", shortest or 0)), int(size.get("width", shortest or 0)))
        if conf.get("do_resize", True) is False:
            raise ValueError("preprocessor config has do_resize=false; images must be resized to the tower's size")
        crop = None
        if conf.get("do_center_crop", False):
            c = conf.get("crop_size", size)
            c = {"height": c, "width": c} if isinstance(c, int) else c
            crop = (int(c.get("height", c.get("shortest_edge"))), int(c.get("width", c.get("shortest_edge"))))
        mean = conf.get("image_mean", [0.5, 0.5, 0.5]) if conf.get("do_normalize", True) else [0.0, 0.0, 0.0]
        std = conf.get("image_std", [0.5, 0.5, 0.5]) if conf.get("do_normalize", True) else [1.0, 1.0, 1.0]
        rescale = float(conf.get("rescale_factor", 1 / 255)) if conf.get("do_rescale", True) else 1.0
        pinpoints = conf.get("image_grid_pinpoints") or DEFAULT_GRID_PINPOINTS
        return cls(
            resize_shortest_edge=int(shortest) if shortest and "height" not in size else None,
            resize_hw=hw,
            crop_hw=crop,
            image_mean=tuple(float(x) for x in mean),
            image_std=tuple(float(x) for x in std),
            rescale_factor=rescale,
            resample=int(conf.get("resample", 3)),
            grid_pinpoints=tuple((int(h), int(w)) for h, w in pinpoints),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "PreprocessorSpec":
        """From a ``preprocessor_config.json`` or ``processor_config.json``
        file, or a directory holding one (:func:`find_preprocessor_config`).
        Raises FileNotFoundError (naming the path) or ValueError (bad JSON)."""
        path = Path(path)
        if path.is_dir():
            path = find_preprocessor_config(path) or path / PREPROCESSOR_FILENAME
        try:
            conf = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(conf, dict) and isinstance(conf.get("image_processor"), dict):
            conf = conf["image_processor"]
        return cls.from_dict(conf)


def find_preprocessor_config(directory: str | os.PathLike) -> Optional[Path]:
    """The image processor's settings in ``directory`` (a tokenizer or model
    directory): its ``preprocessor_config.json``, else a ``processor_config.json``
    that holds an ``image_processor``; None when it has neither."""
    directory = Path(directory)
    if (directory / PREPROCESSOR_FILENAME).is_file():
        return directory / PREPROCESSOR_FILENAME
    processor = directory / PROCESSOR_FILENAME
    try:
        has_image_processor = "image_processor" in json.loads(processor.read_text())
    except (OSError, ValueError, TypeError):
        return None
    return processor if has_image_processor else None


def select_grid(image_hw: tuple[int, int], candidates: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The candidate ``(height, width)`` that keeps most of the image's pixels
    when the image is scaled to fit inside it, ties broken by least padding
    (then by order). ``image_hw`` is the original ``(height, width)``."""
    h, w = image_hw
    best, best_key = None, None
    for ch, cw in candidates:
        scale = min(cw / w, ch / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        key = (kept, -(cw * ch - kept))
        if best_key is None or key > best_key:
            best, best_key = (int(ch), int(cw)), key
    if best is None:
        raise ValueError("anyres needs at least one candidate resolution")
    return best


def _check_rgb(image: np.ndarray) -> None:
    if not (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3):
        raise ValueError(f"expected a uint8 [H, W, 3] image, got {getattr(image, 'dtype', type(image))} "
                         f"{getattr(image, 'shape', '')}")


class ImagePreprocessor:
    """uint8 RGB ``[H, W, 3]`` array -> float32 ``[n, 3, S, S]`` views (see module docstring).

    Picklable; holds no state beyond its settings.
    """

    def __init__(self, mode: str, spec: PreprocessorSpec, image_size: int):
        if mode not in IMAGE_MODES:
            raise ValueError(f"unknown image mode {mode!r}; expected one of {IMAGE_MODES}")
        self.mode = mode
        self.spec = spec
        self.image_size = image_size
        if mode != "exact" and spec.output_hw != (image_size, image_size):
            raise ValueError(
                f"the preprocessor produces {spec.output_hw[0]}x{spec.output_hw[1]} images but the tower takes "
                f"{image_size}x{image_size} (vision.image_size)"
            )

    @classmethod
    def from_config(cls, mode: str, image_size: int, preprocessor: Optional[str | os.PathLike]) -> "ImagePreprocessor":
        """``preprocessor``: a ``preprocessor_config.json`` (or its directory),
        or None for :meth:`PreprocessorSpec.plain`."""
        spec = PreprocessorSpec.from_file(preprocessor) if preprocessor else PreprocessorSpec.plain(image_size)
        return cls(mode, spec, image_size)

    def num_views(self, image_hw: tuple[int, int]) -> int:
        """How many tower inputs an image of ``(height, width)`` becomes."""
        if self.mode != "anyres":
            return 1
        gh, gw = select_grid(image_hw, self.spec.grid_pinpoints)
        return 1 + math.ceil(gh / self.image_size) * math.ceil(gw / self.image_size)

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        """``image``: np.uint8 ``[H, W, 3]``. Returns float32 ``[n, 3, S, S]``.
        Raises ValueError for a wrongly shaped image (``exact`` mode: not ``S x S``)."""
        _check_rgb(image)
        if self.mode == "exact":
            if image.shape[:2] != (self.image_size, self.image_size):
                raise ValueError(f"image shape {image.shape} != ({self.image_size}, {self.image_size}, 3); "
                                 "re-run data preparation at this resolution or set data.image_mode")
            x = image.astype(np.float32) / 127.5 - 1.0
            return torch.from_numpy(x).permute(2, 0, 1).contiguous()[None]
        if self.mode == "anyres":
            views = [self._resize_to(image, (self.image_size, self.image_size))] + self._tiles(image)
        else:
            if self.mode == "pad_square":
                image = pad_to_square(image, tuple(int(255 * m) for m in self.spec.image_mean))
            views = [self._resize_crop(image)]
        return torch.from_numpy(np.stack([self._normalise(v) for v in views]))

    def frame(self, frame: np.ndarray) -> torch.Tensor:
        """One video frame (uint8 ``[H, W, 3]``) -> float32 ``[1, 3, S, S]``:
        as :meth:`__call__`, except that ``anyres`` keeps only the overview
        (LLaVA-OneVision gives each frame one base-resolution view)."""
        if self.mode != "anyres":
            return self(frame)
        _check_rgb(frame)
        return torch.from_numpy(self._normalise(self._resize_to(frame, (self.image_size, self.image_size)))[None])

    # ------------------------------------------------------------- helpers
    def _resize_to(self, image: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
        if image.shape[:2] == hw:
            return image
        pil = Image.fromarray(image, mode="RGB").resize((hw[1], hw[0]), resample=self.spec.resample)
        return np.asarray(pil)

    def _resize_crop(self, image: np.ndarray) -> np.ndarray:
        s = self.spec
        if s.resize_shortest_edge is not None:
            h, w = image.shape[:2]
            short, long = (h, w) if h <= w else (w, h)
            new_long = int(s.resize_shortest_edge * long / short)
            hw = (s.resize_shortest_edge, new_long) if h <= w else (new_long, s.resize_shortest_edge)
        else:
            hw = s.resize_hw
        image = self._resize_to(image, hw)
        if s.crop_hw is not None:
            image = center_crop(image, s.crop_hw)
        return image

    def _tiles(self, image: np.ndarray) -> list[np.ndarray]:
        gh, gw = select_grid(image.shape[:2], self.spec.grid_pinpoints)
        h, w = image.shape[:2]
        # Fit inside the grid keeping the aspect ratio; the limiting side fills it exactly.
        if gw / w < gh / h:
            hw = (min(math.ceil(h * gw / w), gh), gw)
        else:
            hw = (gh, min(math.ceil(w * gh / h), gw))
        fitted = self._resize_to(image, hw)
        canvas = np.zeros((gh, gw, 3), dtype=np.uint8)
        top, left = (gh - hw[0]) // 2, (gw - hw[1]) // 2
        canvas[top : top + hw[0], left : left + hw[1]] = fitted
        side = self.image_size
        return [canvas[r : r + side, c : c + side] for r in range(0, gh, side) for c in range(0, gw, side)]

    def _normalise(self, view: np.ndarray) -> np.ndarray:
        """uint8 ``[S, S, 3]`` -> float32 ``[3, S, S]``."""
        if view.shape[:2] != (self.image_size, self.image_size):  # a ragged anyres edge tile
            view = self._resize_to(view, (self.image_size, self.image_size))
        x = (view.astype(np.float64) * self.spec.rescale_factor).astype(np.float32)
        x = (x - np.asarray(self.spec.image_mean, np.float32)) / np.asarray(self.spec.image_std, np.float32)
        return np.ascontiguousarray(x.transpose(2, 0, 1))


def pad_to_square(image: np.ndarray, fill: tuple[int, ...]) -> np.ndarray:
    """uint8 ``[H, W, 3]`` -> ``[L, L, 3]`` with ``L = max(H, W)``; the image is
    centred (extra pixel of an odd margin after it) on a ``fill`` background."""
    h, w = image.shape[:2]
    if h == w:
        return image
    side = max(h, w)
    out = np.empty((side, side, 3), dtype=np.uint8)
    out[:] = np.asarray(fill, dtype=np.uint8)
    top, left = (side - h) // 2, (side - w) // 2
    out[top : top + h, left : left + w] = image
    return out


def center_crop(image: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Crop ``[H, W, 3]`` to ``hw`` around the centre (offsets rounded down);
    a side smaller than the crop is zero-padded around the image first."""
    h, w = image.shape[:2]
    ch, cw = hw
    if h < ch or w < cw:
        big = np.zeros((max(h, ch), max(w, cw), 3), dtype=image.dtype)
        top, left = (big.shape[0] - h) // 2, (big.shape[1] - w) // 2
        big[top : top + h, left : left + w] = image
        image, h, w = big, big.shape[0], big.shape[1]
    top, left = (h - ch) // 2, (w - cw) // 2
    return image[top : top + ch, left : left + cw]
