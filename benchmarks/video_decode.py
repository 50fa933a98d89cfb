"""Video decode throughput at ingest and at read time, and the bytes stored.

    .venv/bin/python benchmarks/video_decode.py [--clips 8] [--frames 150] [--size 240x320] [--keep 8] [--quick]

Synthesizes ``--clips`` clips of ``--frames`` frames at 30 fps (a panning
photo-like texture with sensor noise; half H.264 in mkv, whose container
reports no frame count, half MPEG-4 Part 2 in mp4), then, in one process
(one core):

* ingest: ``tools/ingest_llava.py``'s ``ingest()`` of one record per clip
  keeping ``--keep`` frames (uniform): every frame decoded once to count
  them, again up to the last kept one to take them, kept frames
  JPEG-encoded. Reported as decoded frames/s and clips/s.
* read: ``ShardedSampleReader[i]`` of every ingested sample (the stored
  JPEG frames decoded into ``[keep, H, W, 3]``), as kept frames/s.
* read from the clip (what storing the clip instead of its frames would
  cost each time a sample is read): PyAV decoding each clip up to its last
  kept frame, as kept frames/s.

Rates are by the process's CPU time (the host is shared; wall beside).
Bytes: the shards (tars + ``index.json``) against the clips. ``--quick``:
2 clips of 30 frames at 48x64.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.data.llava.ingest import IngestInputs, ingest  # noqa: E402
from megascale_omni.data.shards import ShardedSampleReader  # noqa: E402
from megascale_omni.data.video import VideoSampling, import_av, sample_indices  # noqa: E402
from megascale_omni.demo.clips import write_clip  # noqa: E402

QUICK = {"clips": 2, "frames": 30, "size": "48x64"}
FPS = 30
PAN = 2  # pixels the view moves per frame


def panning(seed: int, height: int, width: int, frames: int):
    """``pixels(i, ...)`` for :func:`write_clip`: a smooth random colour field
    with texture, seen through a window moving :data:`PAN` pixels a frame, plus noise."""
    rng = np.random.default_rng(seed)
    wide = width + PAN * frames
    field = Image.fromarray(rng.integers(0, 256, (4, 8, 3), dtype=np.uint8)).resize((wide, height), Image.BICUBIC)
    fine = Image.fromarray(rng.integers(0, 256, (height // 4 + 1, wide // 4 + 1, 3), dtype=np.uint8))
    base = 0.7 * np.asarray(field, np.float32) + 0.3 * np.asarray(fine.resize((wide, height), Image.BICUBIC))

    def pixels(i: int, _frames: int, h: int, w: int, _seed: int) -> np.ndarray:
        view = base[:, PAN * i: PAN * i + w] + rng.normal(0, 3, (h, w, 3))
        return np.clip(view, 0, 255).astype(np.uint8)

    return pixels


def make_clips(root: Path, clips: int, frames: int, height: int, width: int) -> Path:
    """``root/clips/*`` + ``root/llava.json`` (one record per clip); returns the JSON's path."""
    (root / "clips").mkdir(parents=True)
    records = []
    for c in range(clips):
        name = f"clips/{c:04d}{'.mkv' if c % 2 == 0 else '.mp4'}"
        write_clip(root / name, frames, height, width, FPS, pixels=panning(c, height, width, frames))
        records.append({"id": str(c), "video": name, "conversations": [
            {"from": "human", "value": "<video>\nWhat happens in the video?"},
            {"from": "gpt", "value": "The camera pans across a textured scene."}]})
    path = root / "llava.json"
    path.write_text(json.dumps(records))
    return path


def timed(fn):
    t_cpu, t_wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - t_cpu, time.perf_counter() - t_wall


def decode_from_clip(path: Path, keep: np.ndarray) -> int:
    """The kept frames straight from the clip (decoding up to the last one); returns how many."""
    av = import_av()
    wanted, got = set(int(i) for i in keep), 0
    with av.open(str(path)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in wanted:
                frame.to_ndarray(format="rgb24")
                got += 1
            if i >= keep[-1]:
                break
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clips", type=int, default=8)
    p.add_argument("--frames", type=int, default=150, help="frames per clip (30 fps)")
    p.add_argument("--size", default="240x320", help="HxW of the clips")
    p.add_argument("--keep", type=int, default=8, help="frames kept per clip (--video-frames)")
    p.add_argument("--json", help="also write the results here as JSON")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    height, width = map(int, args.size.split("x"))
    keep = sample_indices(args.frames, VideoSampling(frames=args.keep))
    with tempfile.TemporaryDirectory(prefix="video-decode-") as tmp:
        json_path = make_clips(Path(tmp) / "src", args.clips, args.frames, height, width)
        clips = sorted((Path(tmp) / "src" / "clips").iterdir())
        source = sum(f.stat().st_size for f in clips)
        out = Path(tmp) / "train"
        inputs = IngestInputs(llava_json=[str(json_path)], image_root=str(json_path.parent))
        report, ingest_cpu, ingest_wall = timed(lambda: ingest(inputs, out, samples_per_shard=100, workers=1,
                                                               video=VideoSampling(frames=args.keep)))
        assert report.rejected == 0, report.to_dict()
        stored = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".tar" or f.name == "index.json")
        reader = ShardedSampleReader(out)
        videos, read_cpu, read_wall = timed(lambda: [reader[i].videos[0] for i in range(len(reader))])
        assert all(v.shape == (len(keep), height, width, 3) for v in videos)
        got, clip_cpu, clip_wall = timed(lambda: sum(decode_from_clip(c, keep) for c in clips))
        assert got == len(keep) * args.clips
    decoded = args.clips * (args.frames + int(keep[-1]) + 1)  # the count pass + the take pass
    kept = args.clips * len(keep)
    rows = {
        "ingest (count + take + JPEG)": (decoded / ingest_cpu, decoded / ingest_wall, "decoded frames/s"),
        "read stored JPEG frames": (kept / read_cpu, kept / read_wall, "kept frames/s"),
        "read from the clip": (kept / clip_cpu, kept / clip_wall, "kept frames/s"),
    }
    print(f"clips {args.clips} x {args.frames} frames at {height}x{width}, {FPS} fps (H.264 mkv / MPEG-4 mp4), "
          f"keeping {len(keep)} per clip, one process")
    print(f"{'stage':<30}{'frames/s (cpu)':>16}{'frames/s (wall)':>17}  unit")
    for name, (cpu, wall, unit) in rows.items():
        print(f"{name:<30}{cpu:>16.1f}{wall:>17.1f}  {unit}")
    print(f"ingest: {args.clips / ingest_cpu:.2f} clips/s (cpu); decoded {decoded / args.clips:.0f} frames a clip")
    print(f"read per sample: stored frames {read_cpu / args.clips * 1e3:.1f} ms, from the clip "
          f"{clip_cpu / args.clips * 1e3:.1f} ms (cpu); ratio {clip_cpu / read_cpu:.1f}x")
    print(f"bytes: clips {source / 1e6:.3f} MB, shards {stored / 1e6:.3f} MB, shards / clips {stored / source:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "clips": args.clips, "frames": args.frames, "size": [height, width], "keep": len(keep),
            "rates": {k: {"cpu": v[0], "wall": v[1], "unit": v[2]} for k, v in rows.items()},
            "source_bytes": source, "stored_bytes": stored}, indent=2) + "\n")


if __name__ == "__main__":
    main()
