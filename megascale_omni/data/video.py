"""Video clips for LLaVA-Video / LLaVA-OneVision style samples: which frames
are kept, and how they are decoded (PyAV) and stored.

A video is a clip file (mp4, webm, mkv, ... anything FFmpeg demuxes) or a
*frame folder* (a directory of JPEG/PNG frames, in name order). Ingestion
keeps a fixed set of its frames (:class:`VideoSampling`, decided once, from
the frames counted by decoding) and stores each kept frame as an image
member (:mod:`megascale_omni.data.shards`): a clip's frames as JPEG, a
folder's frames as their own bytes. Training reads ``[frames, H, W, 3]``
uint8 and may take fewer (:func:`subsample`, ``data.video_frames``).

Why frames and not the clip: a reader of the clip would decode every frame
up to the last kept one each time the sample is read (a 30 s clip at 30 fps
is 900 decodes for 8 frames); the kept frames cost one JPEG decode each.
The price is disk: a few JPEGs against a clip's inter-frame compression
(BENCHMARKS.md, "Video decode").

Frame choice (:func:`sample_indices`) equals transformers' video processors
(``default_sample_indices_fn``, which LLaVA-OneVision's uses): ``uniform``
``N`` keeps frames ``i * total // N`` for ``i < N``; ``fps`` ``F`` keeps
``N = max(1, int(total / clip_fps * F))`` of them, at most ``max_frames``.
A clip with fewer frames than ``N`` keeps all of them (transformers raises
instead; a short clip is still a sample).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image

from megascale_omni.config import ConfigError
from megascale_omni.data.costs import IMAGE_FORMATS, IMAGE_SUFFIXES
from megascale_omni.data.integrity import decode_image_rgb

#: JPEG quality of frames decoded from a clip (PIL's scale; 95: visually lossless, ~4x smaller than PNG).
FRAME_JPEG_QUALITY = 95
#: Suffixes of the files a frame folder's frames are taken from (others are ignored).
FRAME_FILE_SUFFIXES = (".jpg", ".jpeg", ".png")


def import_av():
    """The ``av`` module (PyAV); ConfigError naming the extra when it is not installed."""
    try:
        import av
    except ImportError:
        raise ConfigError("video", None, "decoding clips needs PyAV: pip install -e '.[video]'") from None
    return av


class VideoError(ValueError):
    """A video that cannot be ingested: ``reason`` is short and stable (what
    reports count by, e.g. ``has no frames``), ``detail`` the specifics."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason} ({detail})" if detail else reason)


@dataclass(frozen=True)
class VideoSampling:
    """Which frames of a video ingestion keeps."""

    #: ``uniform``: ``frames`` evenly spread frames; ``fps``: ``fps`` frames
    #: per second of the clip, at most ``frames`` (a frame folder, which has
    #: no rate, is sampled ``uniform``).
    policy: str = "uniform"
    #: Frames kept per video (``uniform``), or their maximum (``fps``); > 0.
    frames: int = 8
    #: ``fps`` policy: frames per second of video to keep; > 0.
    fps: float = 1.0

    def __post_init__(self):
        if self.policy not in ("uniform", "fps"):
            raise ConfigError("VideoSampling.policy", self.policy, "must be uniform or fps")
        if not isinstance(self.frames, int) or self.frames <= 0:
            raise ConfigError("--video-frames", self.frames, "must be an int > 0 (e.g. 8, 32)")
        if not self.fps > 0:
            raise ConfigError("--video-fps", self.fps, "must be > 0 (e.g. 1.0)")


def sample_indices(total: int, sampling: VideoSampling, clip_fps: Optional[float] = None) -> np.ndarray:
    """Indices (int64, ascending, distinct) of the frames kept of ``total``
    decoded frames (``clip_fps``: frames per second, None for a frame folder);
    see the module docstring. ``total`` must be > 0."""
    if total <= 0:
        raise ValueError(f"total={total}: a video needs at least one frame")
    n = sampling.frames
    if sampling.policy == "fps" and clip_fps:
        n = min(n, max(1, int(total / clip_fps * sampling.fps)))
    n = min(n, total)
    return np.arange(n, dtype=np.int64) * total // n


def subsample(video: np.ndarray, frames: int) -> np.ndarray:
    """``frames`` of ``video`` (``[F, H, W, 3]``) by the uniform rule of
    :func:`sample_indices` (all of them when ``frames`` is 0 or >= F)."""
    if frames <= 0 or frames >= len(video):
        return video
    return video[sample_indices(len(video), VideoSampling(frames=frames))]


def encode_frame_jpeg(frame: np.ndarray) -> bytes:
    """uint8 ``[H, W, 3]`` -> JPEG bytes (:data:`FRAME_JPEG_QUALITY`, 4:2:0)."""
    buf = io.BytesIO()
    Image.fromarray(frame, mode="RGB").save(buf, format="JPEG", quality=FRAME_JPEG_QUALITY)
    return buf.getvalue()


@dataclass
class LoadedVideo:
    """A video as ingestion keeps it: frames and their stored form."""

    #: uint8 ``[F, H, W, 3]``, the kept frames in order.
    frames: np.ndarray
    #: Per kept frame, ``(PIL format name, bytes)`` to store (JPEG for a clip's frames).
    sources: list[tuple[str, bytes]]
    #: Frames the video has (counted by decoding; a folder's frame files).
    total_frames: int


def load_video(path: str, sampling: VideoSampling) -> LoadedVideo:
    """Decode ``path`` (a clip file or a frame folder) and keep the frames
    ``sampling`` chooses. Raises :class:`VideoError` with the reason: empty
    file, not a container FFmpeg reads, no video stream, a stream that does
    not decode, zero frames, frames of differing sizes."""
    if os.path.isdir(path):
        return _load_folder(path, sampling)
    if os.path.getsize(path) == 0:
        raise VideoError("is empty (0 bytes)")
    total, clip_fps = _count_frames(path)
    keep = sample_indices(total, sampling, clip_fps)
    frames = _decode_frames(path, keep)
    if len(frames) != len(keep):  # a second decode that ends early: the file changed meanwhile
        raise VideoError("changed while read", f"decoded {len(frames)} of the {len(keep)} frames chosen "
                         f"from {total}")
    return LoadedVideo(np.stack(frames), [("JPEG", encode_frame_jpeg(f)) for f in frames], total)


def _open(path: str):
    av = import_av()

    try:
        container = av.open(path)
    except (av.FFmpegError, OSError, UnicodeDecodeError) as e:
        raise VideoError("cannot be opened as a video", f"{type(e).__name__}: {e}") from None
    if not container.streams.video:
        container.close()
        raise VideoError("has no video stream")
    return container


def _count_frames(path: str) -> tuple[int, Optional[float]]:
    """(frames, frames per second) of the first video stream, by decoding all
    of it: containers may report no count (webm, mkv) or a wrong one."""
    av = import_av()

    container = _open(path)
    try:
        stream = container.streams.video[0]
        rate = float(stream.average_rate) if stream.average_rate else None
        total = sum(1 for _ in container.decode(stream))
    except (av.FFmpegError, ValueError) as e:
        raise VideoError("cannot be decoded", f"{type(e).__name__}: {e}") from None
    finally:
        container.close()
    if total == 0:
        raise VideoError("has no frames")
    return total, rate


def _decode_frames(path: str, keep: np.ndarray) -> list[np.ndarray]:
    """RGB frames ``keep`` (ascending indices) of the first video stream."""
    av = import_av()

    wanted, frames = set(int(i) for i in keep), []
    container = _open(path)
    try:
        for i, frame in enumerate(container.decode(container.streams.video[0])):
            if i in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
            if i >= keep[-1]:
                break
    except (av.FFmpegError, ValueError) as e:
        raise VideoError("cannot be decoded", f"{type(e).__name__}: {e}") from None
    finally:
        container.close()
    _check_sizes([f.shape for f in frames])
    return frames


def _load_folder(path: str, sampling: VideoSampling) -> LoadedVideo:
    names = sorted(n for n in os.listdir(path) if n.lower().endswith(FRAME_FILE_SUFFIXES))
    if not names:
        raise VideoError("is a folder without JPEG or PNG frames")
    keep = sample_indices(len(names), sampling)
    frames, sources = [], []
    for i in keep:
        with open(os.path.join(path, names[i]), "rb") as f:
            data = f.read()
        try:
            with Image.open(io.BytesIO(data)) as img:
                fmt = img.format
        except Exception as e:  # noqa: BLE001 - PIL reports malformed files with many types
            raise VideoError("has a frame that cannot be decoded", f"{names[i]}: {type(e).__name__}: {e}") from None
        if fmt not in IMAGE_FORMATS:
            raise VideoError("has a frame that is not JPEG or PNG", f"{names[i]} is {fmt}")
        try:
            frames.append(decode_image_rgb(data, IMAGE_SUFFIXES[IMAGE_FORMATS[fmt]]))
        except ValueError as e:
            raise VideoError("has a frame that cannot be decoded", f"{names[i]}: {e}") from None
        sources.append((fmt, data))
    _check_sizes([f.shape for f in frames])
    return LoadedVideo(np.stack(frames), sources, len(names))


def _check_sizes(shapes: list[tuple[int, ...]]) -> None:
    if len(set(shapes)) > 1:
        raise VideoError("has frames of different sizes", f"{sorted(set(s[:2] for s in shapes))}")
