"""Ingestion at LLaVA-665k scale: images stored as their source bytes
(JPEG, PNG, WebP), checked by a decode at ingest and by the shard's size and
checksum when read; the val split made at ingest; bad records rejected with
a reason naming the role, field, type or file; resumable reruns whatever the
spelling of the input paths."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megascale_omni.config import ConfigError
from megascale_omni.data.errors import DataFileError
from megascale_omni.data.llava.ingest import (
    REJECTED_FILE,
    REPORT_FILE,
    IngestInputs,
    ValSplit,
    in_val,
    ingest,
    record_key,
)
from megascale_omni.data.llava.plan_scan import check_exact_sizes
from megascale_omni.data.shard_writer import write_shards
from megascale_omni.data.shards import INDEX_FILENAME, ShardedSampleReader
from megascale_omni.demo.shapes import generate_samples
from tests.launcher import run_tool_in_process

CONV = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A photo."}]
TEXT_CONV = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]


def _photo(h: int, w: int, seed: int) -> np.ndarray:
    """A natural-ish RGB image: gradients plus noise (compresses like a photo, not like a flat PNG)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (h + w)], axis=-1)
    return np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


def _save(path: Path, image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


# file name -> (PIL image, format, save options): every stored kind, non-square
SOURCES = {
    "a.jpg": (lambda: Image.fromarray(_photo(48, 80, 0)), "JPEG", {"quality": 90}),
    "b.jpg": (lambda: Image.fromarray(_photo(64, 40, 1)).convert("L"), "JPEG", {"quality": 90}),
    "c.jpg": (lambda: Image.fromarray(_photo(30, 30, 2)).convert("CMYK"), "JPEG", {"quality": 90}),
    "d.png": (lambda: Image.fromarray(_photo(20, 50, 3)).convert("RGBA"), "PNG", {}),
    "e.png": (lambda: Image.fromarray(_photo(33, 17, 4)).convert("P"), "PNG", {}),
    "f.webp": (lambda: Image.fromarray(_photo(40, 72, 5)), "WEBP", {"quality": 90}),
    # A camera's multi-picture JPEG: stored as a .jpg, read as its first picture.
    "g.jpg": (lambda: Image.fromarray(_photo(24, 36, 7)), "MPO",
              {"quality": 90, "save_all": True, "append_images": [Image.fromarray(_photo(24, 36, 8))]}),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    for name, (make, fmt, kw) in SOURCES.items():
        _save(root / "img" / name, make(), fmt, **kw)
    return root


def _json(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records))
    return path


def test_source_bytes_are_stored_as_they_are_and_decode_as_pil_does(sources, tmp_path):
    records = [{"id": name, "image": f"img/{name}", "conversations": CONV} for name in SOURCES]
    records.append({"id": "two", "images": ["img/a.jpg", "img/f.webp"],
                    "conversations": [{"from": "human", "value": "<image> <image> same?"}, CONV[1]]})
    path = _json(tmp_path / "in.json", records)
    report = ingest(IngestInputs(llava_json=[str(path)], image_root=str(sources)), tmp_path / "out",
                    samples_per_shard=3)
    assert (report.kept, report.rejected, report.shards) == (len(records), 0, 3)
    reader = ShardedSampleReader(tmp_path / "out")
    assert reader.index.format_version == 3
    for i, record in enumerate(records):
        loc, _, members = reader.read_members(i)
        names = record.get("images") or [record["image"]]
        suffixes = sorted(s for s in members if s != "json")
        assert suffixes == [f"{k}.{Path(n).suffix[1:]}" for k, n in enumerate(names)]
        sample = reader[i]
        for k, name in enumerate(names):
            source = (sources / name).read_bytes()
            assert members[suffixes[k]] == source  # no re-encoding
            expected = np.asarray(Image.open(io.BytesIO(source)).convert("RGB"))
            assert np.array_equal(sample.images[k], expected)
            assert loc.cost.image_hw[k] == expected.shape[:2]
    # On disk: the sources' bytes plus tar headers and JSON, never a re-encoded copy.
    stored = sum(member_size for s in reader.index.samples for k, (_, member_size) in s.members.items()
                 if k != "json")
    assert stored == sum((sources / n).stat().st_size for r in records for n in (r.get("images") or [r["image"]]))


def test_bad_images_and_turns_are_rejected_naming_the_file_role_and_field(sources, tmp_path):
    jpeg = (sources / "img" / "a.jpg").read_bytes()
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "cut.jpg").write_bytes(jpeg[: len(jpeg) * 3 // 4])
    (tmp_path / "img" / "noise.jpg").write_bytes(b"\xff\xd8\xff" + bytes(range(256)) * 4)
    (tmp_path / "img" / "a.jpg").write_bytes(jpeg)
    _save(tmp_path / "img" / "g.gif", Image.fromarray(_photo(8, 8, 6)).convert("P"), "GIF")
    (tmp_path / "img" / "folder.jpg").mkdir()
    cases = [  # (record, exact reason)
        ({"image": "img/cut.jpg", "conversations": CONV},
         "image cannot be decoded: img/cut.jpg (does not decode: OSError: image file is truncated"),
        ({"image": "img/noise.jpg", "conversations": CONV}, "image cannot be decoded: img/noise.jpg ("),
        ({"image": "img/g.gif", "conversations": CONV},
         "image format GIF is not stored: img/g.gif (convert it to JPEG, PNG or WebP)"),
        ({"image": "img/folder.jpg", "conversations": CONV}, "image path is a directory: img/folder.jpg"),
        ({"image": 7, "conversations": CONV}, "image is an int, expected a path or a list of paths"),
        ({"images": ["img/a.jpg", 3], "conversations": CONV}, "images[1] is an int, expected a path"),
        ({"conversations": [{"from": "bot", "value": "hi"}, CONV[1]]},
         "bad conversation: conversations[0].from is 'bot', expected human, gpt or system"),
        ({"conversations": [TEXT_CONV[0], {"from": "gpt", "value": 3}]},
         "bad conversation: conversations[1].value is an int, expected a string"),
        ({"conversations": [TEXT_CONV[0], {"role": "robot", "content": "x"}]},
         "bad conversation: conversations[1].role is 'robot', expected user, assistant or system"),
        ({"conversations": [TEXT_CONV[0], TEXT_CONV[0]]},
         "bad conversation: conversations[1] is from 'human' (user), expected 'assistant'"),
        ({"conversations": [TEXT_CONV[1], TEXT_CONV[0]]},
         "bad conversation: conversations[0] is from 'gpt' (assistant), expected 'user'"),
        ({"conversations": [TEXT_CONV[0], {"from": "gpt", "value": "see <image>"}]},
         "bad conversation: conversations[1] is from 'gpt' (assistant) and contains <image>"),
        ({"conversations": "hi"}, "conversations is a str, expected a list of turns"),
        ({"conversations": [TEXT_CONV[0], ["gpt", "x"]]},
         "bad conversation: conversations[1] is a list, expected an object with 'from' and 'value'"),
        (["not", "a", "record"], "record is a list, expected an object"),
    ]
    good = {"image": "img/a.jpg", "conversations": CONV}
    path = _json(tmp_path / "in.json", [good] + [record for record, _ in cases])
    report = ingest(IngestInputs(llava_json=[str(path)], image_root=str(tmp_path)), tmp_path / "out")
    rejected = [json.loads(line) for line in (tmp_path / "out" / REJECTED_FILE).read_text().splitlines()]
    assert (report.kept, report.rejected) == (1, len(cases)) and [r["position"] for r in rejected] == list(
        range(1, len(cases) + 1))
    for r, (_, reason) in zip(rejected, cases):
        assert r["reason"].startswith(reason), (r["reason"], reason)
    counts = json.loads((tmp_path / "out" / REPORT_FILE).read_text())["rejected_by_reason"]
    assert counts["image cannot be decoded"] == 2 and counts["image path is a directory"] == 1
    assert counts["image format not stored"] == 1 and counts["bad conversation"] == 7


def test_val_split_is_chosen_by_id_and_seed_and_val_json_goes_whole(sources, tmp_path):
    records = [{"id": f"r{i}", "conversations": TEXT_CONV} for i in range(400)]
    path = _json(tmp_path / "in.json", records)
    val_json = _json(tmp_path / "val.json", [{"id": "v", "image": "img/a.jpg", "conversations": CONV}])
    inputs = IngestInputs(llava_json=[str(path)], image_root=str(sources))
    split = ValSplit(str(tmp_path / "ds" / "val"), fraction=0.1, seed=3, llava_json=[str(val_json)])
    report = ingest(inputs, tmp_path / "ds" / "train", samples_per_shard=100, val=split)
    chosen = {r["id"] for r in records if in_val(record_key("", r), 0.1, 3)}
    assert 20 <= len(chosen) <= 60  # 10% of 400, binomial
    assert (report.kept, report.val.kept) == (400 - len(chosen), len(chosen) + 1)
    val = ShardedSampleReader(tmp_path / "ds" / "val")
    assert val[0].num_images == 1 and val.index.samples[0].cost.image_hw == ((48, 80),)
    # The choice is a function of (seed, id) alone: another order or a subset chooses the same records.
    assert {r["id"] for r in records[::-1][:200] if in_val(record_key("", r), 0.1, 3)} == \
        {r["id"] for r in records[200:] if r["id"] in chosen}
    assert chosen != {r["id"] for r in records if in_val(record_key("", r), 0.1, 4)}
    # The command line: the val split lands beside --out; a fraction of 1 is refused with the fix.
    res = run_tool_in_process("tools/ingest_llava.py", "--out", tmp_path / "cli" / "train", "--llava-json", path,
                              "--val-fraction", "0.1", "--val-seed", "3", "--workers", "1")
    assert res.returncode == 0, res.stderr
    assert len(ShardedSampleReader(tmp_path / "cli" / "val")) == len(chosen)
    bad = run_tool_in_process("tools/ingest_llava.py", "--out", tmp_path / "x" / "train", "--llava-json", path,
                              "--val-fraction", "1")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "config error: --val-fraction=1.0: must be >= 0 and < 1 (e.g. 0.01)")


def test_rerun_with_another_spelling_of_the_paths_resumes(sources, tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    _json(tmp_path / "data" / "in.json", [{"id": i, "image": "img/a.jpg", "conversations": CONV} for i in range(6)])
    (tmp_path / "data" / "img").symlink_to(sources / "img")
    (tmp_path / "alias").symlink_to(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    first = ingest(IngestInputs(llava_json=["./alias/in.json"], image_root="alias"), "out", samples_per_shard=2)
    again = ingest(IngestInputs(llava_json=[str(tmp_path / "data" / "in.json")], image_root=str(tmp_path / "data")),
                   tmp_path / "out", samples_per_shard=2)
    assert (first.chunks_resumed, again.chunks_resumed, again.kept) == (0, 3, 6)
    with pytest.raises(ConfigError, match="other inputs or settings"):
        ingest(IngestInputs(llava_json=["data/in.json"], image_root="data"), "out", samples_per_shard=3)


def test_a_changed_jpeg_byte_in_a_shard_is_fatal_and_names_the_shard(sources, tmp_path):
    path = _json(tmp_path / "in.json", [{"id": i, "image": "img/a.jpg", "conversations": CONV} for i in range(4)])
    ingest(IngestInputs(llava_json=[str(path)], image_root=str(sources)), tmp_path / "out", samples_per_shard=2)
    offset, size = json.loads((tmp_path / "out" / INDEX_FILENAME).read_text())["samples"][3]["members"]["0.jpg"]
    shard = tmp_path / "out" / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[offset + size // 2] ^= 0x10  # a JPEG has no checksum: it would still decode, into other pixels
    shard.write_bytes(bytes(data))
    reader = ShardedSampleReader(tmp_path / "out")
    reader[0]  # the other shard still reads
    with pytest.raises(DataFileError, match="differs from index.json") as info:
        reader[3]
    assert info.value.path == str(shard)
    shard.write_bytes(bytes(data[: offset + size // 2]))  # cut inside the image
    with pytest.raises(DataFileError, match="truncated or rewritten after indexing"):
        ShardedSampleReader(tmp_path / "out")[2]


def test_format_2_png_shards_still_read(tmp_path):
    samples = list(generate_samples(4, 1))
    write_shards(samples, tmp_path / "split", samples_per_shard=2)
    index = tmp_path / "split" / INDEX_FILENAME
    index.write_text(index.read_text().replace('"format_version":3', '"format_version":2'))
    reader = ShardedSampleReader(tmp_path / "split")
    assert reader.index.format_version == 2 and all(reader[i].equals(s) for i, s in enumerate(samples))


def test_exact_image_mode_refuses_a_set_of_other_sizes_at_start(sources, tmp_path):
    records = [{"id": i, "image": "img/a.jpg" if i < 2 else "img/c.jpg", "conversations": CONV} for i in range(100)]
    path = _json(tmp_path / "in.json", records)
    ingest(IngestInputs(llava_json=[str(path)], image_root=str(sources)), tmp_path / "out", samples_per_shard=50)
    reader = ShardedSampleReader(tmp_path / "out")
    check_exact_sizes(reader, 30, limit=0.02)  # 2 of 100 other sizes: skipped when read, counted
    with pytest.raises(ConfigError) as info:
        check_exact_sizes(reader, 30, limit=0.01)
    assert str(info.value) == (
        "config error: data.image_mode='exact': needs every image 30x30 (vision.image_size), but 2 of 100 "
        f"samples have other sizes (e.g. {tmp_path / 'out'} sample 0: 48x80, height x width); set "
        "data.image_mode=pad_square (LLaVA-1.5), resize_crop or anyres to preprocess them")
