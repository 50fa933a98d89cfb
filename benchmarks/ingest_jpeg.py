"""Ingesting a JPEG set: source bytes stored as they are vs the old PNG re-encode.

    .venv/bin/python benchmarks/ingest_jpeg.py [--images 300] [--rounds 2] [--json OUT] [--quick]

Synthesizes ``--images`` photo-like JPEGs (quality 90) at typical LLaVA-665k
sizes (COCO-like 640x480, 500x375, 427x640, ...: smooth random colour
fields, a few shapes, texture at several scales and sensor-like noise) with one short
conversation each in a LLaVA JSON, then ingests them both ways in one
process (``workers=1``), alternating order over ``--rounds``:

* source bytes (this code): ``megascale_omni.data.llava.ingest.ingest``;
* PNG re-encode (the path before it, rebuilt from the same pieces): every
  record through the same checks and decode (``to_sample``), each image
  then PNG-encoded (``encode_sample`` without sources) and written with
  ``write_member_shards``.

Reports images/s (by the process's CPU time, which on a shared host counts
the work and not the waits for a core; wall time beside it) and the bytes
on disk (shard tars + ``index.json``) against the source (image files + the
LLaVA JSON), and what the shards add per sample (tar headers and padding,
the JSON member, the index entry): the ratio is 1 + that / the average
image size. Each record has its own image here; LLaVA records that share
an image store it once per record. ``--quick``: 40 images, one round (the
size ratio still holds: the image sizes stay LLaVA's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.data.llava.ingest import IngestInputs, ingest, read_records, to_sample  # noqa: E402
from megascale_omni.data.shard_writer import encode_sample, write_member_shards  # noqa: E402

QUICK = {"images": 40, "rounds": 1}
#: (height, width) of typical LLaVA-665k images (COCO, GQA/VG, TextVQA, OCR-VQA covers).
SIZES = [(480, 640), (640, 480), (375, 500), (500, 375), (427, 640), (640, 427), (512, 512), (600, 400)]
QUESTION = "<image>\nWhat is shown in this picture? Answer in one sentence."


def _octave(rng: np.random.Generator, h: int, w: int, cell: int, amplitude: float) -> np.ndarray:
    """Noise with features of about ``cell`` pixels: a coarse random grid, bicubically upsampled."""
    small = rng.normal(0, amplitude, (max(2, h // cell), max(2, w // cell), 3)).astype(np.float32)
    return np.stack([np.asarray(Image.fromarray(small[..., c]).resize((w, h), Image.BICUBIC)) for c in range(3)], -1)


def photo(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """A photo-like image: an upsampled random colour field (large smooth
    regions), a few filled shapes, texture at 32, 8 and 2 pixels and
    sensor-like noise; about 135 kB a quality-90 JPEG on average over
    :data:`SIZES`, near a COCO train2017 photo's average (about 160 kB)."""
    field = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
    draw = ImageDraw.Draw(field)
    for _ in range(int(rng.integers(3, 8))):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        box = (x0, y0, x0 + int(rng.integers(20, w // 2)), y0 + int(rng.integers(20, h // 2)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    img = (np.asarray(field, dtype=np.float32) + _octave(rng, h, w, 32, 25) + _octave(rng, h, w, 8, 30)
           + _octave(rng, h, w, 2, 30) + rng.normal(0, 4, (h, w, 3)))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def make_set(root: Path, n: int, seed: int) -> Path:
    """``root/images/*.jpg`` + ``root/llava.json``; returns the JSON's path."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    records = []
    for i in range(n):
        h, w = SIZES[i % len(SIZES)]
        photo(rng, h, w).save(root / "images" / f"{i:06d}.jpg", quality=90)
        records.append({"id": f"{i:06d}", "image": f"images/{i:06d}.jpg", "conversations": [
            {"from": "human", "value": QUESTION}, {"from": "gpt", "value": f"Shapes on a background, picture {i}."}]})
    path = root / "llava.json"
    path.write_text(json.dumps(records))
    return path


def ingest_source_bytes(inputs: IngestInputs, out: Path) -> None:
    report = ingest(inputs, out, samples_per_shard=100, workers=1)
    assert report.rejected == 0, report.to_dict()


def ingest_png(inputs: IngestInputs, out: Path) -> None:
    """The path before source bytes: the same checks and decode, then a PNG per image."""
    members = (encode_sample(to_sample(i, record, inputs.image_root)[0])
               for i, (_, record) in enumerate(read_records(inputs)))
    write_member_shards(members, out, samples_per_shard=100)


def stored_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.suffix == ".tar" or p.name == "index.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2, help="each path runs once per round, alternating order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here as JSON")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    paths = {"source bytes (new)": ingest_source_bytes, "PNG re-encode (old)": ingest_png}
    cpu = {name: [] for name in paths}
    wall = {name: [] for name in paths}
    stored = {}
    with tempfile.TemporaryDirectory(prefix="ingest-jpeg-") as tmp:
        json_path = make_set(Path(tmp) / "src", args.images, args.seed)
        source = sum(f.stat().st_size for f in (Path(tmp) / "src" / "images").iterdir()) + json_path.stat().st_size
        inputs = IngestInputs(llava_json=[str(json_path)], image_root=str(json_path.parent))
        for r in range(args.rounds):
            for k, (name, fn) in enumerate(sorted(paths.items(), reverse=r % 2 == 1)):
                out = Path(tmp) / f"out-{r}-{k}"
                t_cpu, t_wall = time.process_time(), time.perf_counter()
                fn(inputs, out)
                cpu[name].append(time.process_time() - t_cpu)
                wall[name].append(time.perf_counter() - t_wall)
                stored[name] = stored_bytes(out)
    n = args.images
    print(f"images {n} JPEG quality 90 at {len(SIZES)} LLaVA sizes ({min(h * w for h, w in SIZES) / 1e3:.0f}-"
          f"{max(h * w for h, w in SIZES) / 1e3:.0f} kpixel), one process, {args.rounds} round(s), median")
    print(f"source {source / 1e6:.2f} MB (images + LLaVA JSON), {source / n / 1e3:.1f} kB per record")
    print(f"{'path':<22}{'images/s (cpu)':>16}{'images/s (wall)':>17}{'stored MB':>11}{'stored / source':>17}")
    result = {"images": n, "rounds": args.rounds, "source_bytes": source, "paths": {}}
    for name in paths:
        rate_cpu, rate_wall = n / float(np.median(cpu[name])), n / float(np.median(wall[name]))
        ratio = stored[name] / source
        result["paths"][name] = {"images_per_s_cpu": rate_cpu, "images_per_s_wall": rate_wall,
                                 "stored_bytes": stored[name], "stored_over_source": ratio}
        print(f"{name:<22}{rate_cpu:>16.1f}{rate_wall:>17.1f}{stored[name] / 1e6:>11.2f}{ratio:>16.3f}x")
    new, old = (result["paths"][name] for name in paths)
    print(f"shard overhead of source bytes: {(new['stored_bytes'] - source) / n:.0f} bytes per sample over the source")
    print(f"new / old: {new['images_per_s_cpu'] / old['images_per_s_cpu']:.2f}x images/s (cpu), "
          f"{new['stored_bytes'] / old['stored_bytes']:.3f}x bytes on disk")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
