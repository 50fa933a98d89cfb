"""Small synthetic video clips, written with PyAV, for tests and benchmarks.

Each frame's brightness encodes its index (:func:`frame_pixels`), so a test
can tell which frames a sampler kept after lossy coding: the mean of frame
``i`` is ``level(i)`` within a few grey levels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from megascale_omni.data.video import import_av

#: Codec written for each container suffix (all in PyAV's wheels).
CODECS = {".mp4": "mpeg4", ".mkv": "libx264", ".webm": "libvpx", ".avi": "mpeg4"}


def level(i: int, frames: int) -> int:
    """Grey level of frame ``i`` of ``frames``: spread over [16, 240]."""
    return 16 + (224 * i) // max(1, frames - 1)


def frame_pixels(i: int, frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[height, width, 3]``: level ``level(i)`` plus mild texture (so
    a codec has something to code), mean within 1 of ``level(i)``."""
    rng = np.random.default_rng(seed * 1000 + i)
    texture = rng.integers(-8, 9, (height, width, 1))
    texture -= int(round(texture.mean()))
    return np.clip(level(i, frames) + texture, 0, 255).astype(np.uint8).repeat(3, axis=2)


def write_clip(path: str | Path, frames: int, height: int = 32, width: int = 48, fps: int = 10,
               seed: int = 0, pixels: Callable[..., np.ndarray] = frame_pixels) -> Path:
    """Write ``frames`` frames ``pixels(i, frames, height, width, seed)``
    (default :func:`frame_pixels`) to ``path`` with the codec of its suffix
    (:data:`CODECS`); ``frames=0`` writes a video stream with no frames.
    Returns ``path``."""
    av = import_av()

    path = Path(path)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(CODECS[path.suffix], rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        container.start_encoding()  # the header, also when no frame follows
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(pixels(i, frames, height, width, seed), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def write_audio_only(path: str | Path, seconds: float = 0.2) -> Path:
    """A container (``.mka``) with one audio stream and no video stream."""
    av = import_av()

    path = Path(path)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mp2", rate=16000, layout="mono")
        samples = np.zeros((1, int(16000 * seconds)), dtype=np.int16)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = 16000
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path
