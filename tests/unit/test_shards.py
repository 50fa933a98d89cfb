"""Tests for WebDataset shard writing, indexing and random-access reading."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset

from megascale_omni.data.errors import DataFileError
from megascale_omni.data.sample import Sample
from megascale_omni.data.shard_writer import encode_image_png, encode_sample, index_shards, write_shards
from megascale_omni.data.shards import INDEX_FILENAME, BadSampleError, ShardedSampleReader, decode_sample
from megascale_omni.demo.shapes import generate_samples

SEED = 99
NUM = 40
PER_SHARD = 16  # -> shards of 16, 16, 8 samples


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    return list(generate_samples(NUM, SEED))


@pytest.fixture
def split_dir(tmp_path, samples) -> Path:
    write_shards(samples, tmp_path / "split", PER_SHARD)
    return tmp_path / "split"


def _read_all(reader: ShardedSampleReader) -> dict[int, Sample | BadSampleError | DataFileError]:
    out = {}
    for i in range(len(reader)):
        try:
            out[i] = reader[i]
        except (BadSampleError, DataFileError) as exc:
            out[i] = exc
    return out


def _fatal(results) -> list[int]:
    return sorted(i for i, r in results.items() if isinstance(r, DataFileError))


def _bad(results) -> list[int]:
    return sorted(i for i, r in results.items() if isinstance(r, BadSampleError))


# -------------------------------------------------------------- happy path
def test_random_access_matches_generator(split_dir, samples):
    reader = ShardedSampleReader(split_dir)
    assert len(reader) == NUM
    order = np.random.default_rng(0).permutation(NUM)
    for i in order:
        assert reader[int(i)].equals(samples[i]), i
    assert reader[-1].equals(samples[-1])
    with pytest.raises(IndexError):
        reader[NUM]
    assert [s.id for s in reader] == list(range(NUM))


def test_index_manifest(split_dir, samples):
    doc = json.loads((split_dir / INDEX_FILENAME).read_text())
    assert doc["format_version"] == 3 and doc["num_samples"] == NUM
    # Costs: each image's (height, width) from its PNG header; no token counts without a coster.
    assert doc["cost_basis"] is None
    assert [s["cost"] for s in doc["samples"][:3]] == [
        {"tokens": None, "images": [[32, 32]] * len(sample.images)} for sample in samples[:3]]
    assert [s["name"] for s in doc["shards"]] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert [s["num_samples"] for s in doc["shards"]] == [16, 16, 8]
    for shard in doc["shards"]:
        assert shard["size"] == (split_dir / shard["name"]).stat().st_size
        assert len(shard["sha256"]) == 64
    assert ShardedSampleReader(split_dir).verify_shards() == {}

    # Offsets/sizes point exactly at the member data written by tarfile.
    entry = doc["samples"][20]
    assert entry["key"] == "000000020" and entry["shard"] == 1 and entry["id"] == 20
    with tarfile.open(split_dir / "shard-000001.tar") as tar:
        for suffix, (offset, size) in entry["members"].items():
            member = tar.getmember(f"000000020.{suffix}")
            assert (member.offset_data, member.size) == (offset, size)
            assert member.mtime == 0 and member.uid == 0 and member.uname == ""


def test_shards_are_plain_webdataset_tars(split_dir, samples):
    ds = webdataset.WebDataset(str(split_dir / "shard-000000.tar"), shardshuffle=False)
    first = next(iter(ds))
    assert first["__key__"] == "000000000"
    assert json.loads(first["json"]) == samples[0].metadata()
    assert sum(1 for k in first if k.endswith(".png")) == samples[0].num_images


def test_write_is_byte_identical(tmp_path, samples):
    write_shards(samples, tmp_path / "a", PER_SHARD)
    write_shards(samples, tmp_path / "b", PER_SHARD)
    for path in sorted((tmp_path / "a").iterdir()):
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


def test_write_refuses_existing_dataset(split_dir, samples):
    with pytest.raises(FileExistsError, match="overwrite"):
        write_shards(samples[:5], split_dir, PER_SHARD)
    index = write_shards(samples[:5], split_dir, PER_SHARD, overwrite=True)
    assert index.num_samples == 5 and sorted(p.name for p in split_dir.glob("*.tar")) == ["shard-000000.tar"]


def test_encode_decode_roundtrip(samples):
    for s in samples[:10]:
        assert decode_sample(encode_sample(s)).equals(s)


def test_reader_pickles_and_survives_fork(split_dir, samples):
    reader = ShardedSampleReader(split_dir)
    reader[0]  # opens a descriptor, which must not travel through pickle
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._fds == {} and clone[33].equals(samples[33])

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:  # reader pickled into the workers
        ids = pool.map(_read_id, [(reader, i) for i in range(0, NUM, 3)])
    assert ids == list(range(0, NUM, 3))

    global _INHERITED
    _INHERITED = reader  # workers inherit the open descriptors through fork
    try:
        with ctx.Pool(2) as pool:
            ids = pool.map(_read_inherited_id, range(NUM))
    finally:
        _INHERITED = None
    assert ids == list(range(NUM))
    assert reader[5].equals(samples[5])  # parent's descriptors unaffected by the children
    reader.close()


_INHERITED: ShardedSampleReader | None = None


def _read_id(args) -> int:
    reader, i = args
    return reader[i].id


def _read_inherited_id(i: int) -> int:
    return _INHERITED[i].id


# ---------------------------------------------------------------- bad data
def _member_location(split_dir: Path, idx: int, suffix: str) -> tuple[Path, int, int]:
    doc = json.loads((split_dir / INDEX_FILENAME).read_text())
    entry = doc["samples"][idx]
    offset, size = entry["members"][suffix]
    return split_dir / doc["shards"][entry["shard"]]["name"], offset, size


def _first_with_images(samples, n_images: int, start: int = 0) -> int:
    return next(i for i, s in enumerate(samples) if i >= start and s.num_images == n_images)


def test_corrupt_png_in_place_is_fatal_until_reindexed(split_dir, samples):
    victim = _first_with_images(samples, 1, start=17)
    shard, offset, size = _member_location(split_dir, victim, "0.png")
    with open(shard, "r+b") as f:  # same-length garbage: bit rot, layout unchanged
        f.seek(offset)
        f.write(bytes(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)))

    # The shard no longer matches its checksum: every sample in it is refused
    # with a fatal error naming the shard; the other shards read fine.
    results = _read_all(ShardedSampleReader(split_dir))
    assert _fatal(results) == list(range(16, 32)) and _bad(results) == []
    assert results[16].path == str(shard) and "sha256" in results[16].problem
    assert all(results[i].equals(samples[i]) for i in list(range(16)) + list(range(32, NUM)))
    assert "sha256" in ShardedSampleReader(split_dir).verify_shards()[shard.name]

    index_shards(split_dir)  # accept the shard as written: now only the victim is bad
    results = _read_all(ShardedSampleReader(split_dir))
    assert _bad(results) == [victim] and _fatal(results) == []
    err = results[victim]
    assert err.sample_id == victim and err.shard_path == str(shard)
    assert "corrupt image member '0.png'" in err.reason and str(shard) in str(err)
    for i, r in results.items():
        if i != victim:
            assert r.equals(samples[i])


def test_rewritten_tar_with_garbage_member(split_dir, samples):
    """Rewrite a shard with one member replaced by (longer) garbage."""
    victim = _first_with_images(samples, 2, start=16)
    shard, _, _ = _member_location(split_dir, victim, "1.png")
    buf = io.BytesIO()
    with tarfile.open(shard) as src, tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as dst:
        for member in src:
            data = src.extractfile(member).read()
            if member.name == f"{victim:09d}.1.png":
                data = b"\x89PNG garbage" * 100
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    shard.write_bytes(buf.getvalue())

    assert _fatal(_read_all(ShardedSampleReader(split_dir))) == list(range(16, 32))
    # Without the checksum check the tar headers still catch the stale index: reported, never misread.
    stale = _read_all(ShardedSampleReader(split_dir, verify=False))
    later_in_shard = [i for i in range(victim + 1, 32)]
    assert set(later_in_shard) <= set(_bad(stale))
    assert "changed after indexing" in stale[later_in_shard[0]].reason
    assert all(not isinstance(stale[i], BadSampleError) for i in list(range(16)) + list(range(32, NUM)))

    index_shards(split_dir)  # re-index: now only the garbage member's sample is bad
    results = _read_all(ShardedSampleReader(split_dir))
    assert _bad(results) == [victim]
    assert "'1.png'" in results[victim].reason


def _write_custom_shard(split_dir: Path, metas: list[dict], images: list[list[np.ndarray]]) -> None:
    split_dir.mkdir(parents=True)
    with open(split_dir / "shard-000000.tar", "wb") as f, webdataset.TarWriter(f, encoder=False, mtime=0.0) as w:
        for pos, (meta, imgs) in enumerate(zip(metas, images)):
            record = {"__key__": f"{pos:09d}", "json": json.dumps(meta).encode()}
            record.update({f"{i}.png": encode_image_png(img) for i, img in enumerate(imgs)})
            w.write(record)
    index_shards(split_dir)


def test_missing_json_field_and_member_and_corrupt_json(tmp_path, samples):
    good = next(s for s in samples if s.num_images == 2)
    no_conversation = {k: v for k, v in good.metadata().items() if k != "conversation"}
    split_dir = tmp_path / "custom"
    _write_custom_shard(
        split_dir,
        [no_conversation, good.metadata(), good.metadata(), good.metadata()],
        [good.images, good.images, good.images[:1], good.images],
    )
    # Corrupt the last sample's json in place.
    _, offset, size = _member_location(split_dir, 3, "json")
    with open(split_dir / "shard-000000.tar", "r+b") as f:
        f.seek(offset)
        f.write(b"{" * size)
    index_shards(split_dir)  # written corrupt: the shard's checksum is right

    reader = ShardedSampleReader(split_dir)
    with pytest.raises(BadSampleError, match="lacks field.*conversation") as info:
        reader[0]
    assert info.value.sample_id == good.id
    assert reader[1].equals(good)
    with pytest.raises(BadSampleError, match=r"member '1.<jpg\|png\|webp>' missing"):
        reader[2]
    with pytest.raises(BadSampleError, match="corrupt json"):
        reader[3]


def test_truncated_shard(split_dir, samples):
    last = split_dir / "shard-000002.tar"  # samples 32..39
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    results = _read_all(ShardedSampleReader(split_dir))
    assert _fatal(results) == list(range(32, NUM)) and "index.json says" in results[32].problem
    assert all(results[i].equals(samples[i]) for i in range(32))
    # verify=False: the samples past the cut are bad, the rest of the shard reads.
    results = _read_all(ShardedSampleReader(split_dir, verify=False))
    bad = _bad(results)
    assert bad and bad == list(range(bad[0], NUM)) and bad[0] > 32  # a suffix of the last shard
    assert "truncated shard" in results[NUM - 1].reason
    assert all(results[i].equals(samples[i]) for i in range(bad[0]))
    assert "index.json says" in ShardedSampleReader(split_dir).verify_shards()["shard-000002.tar"]


def test_missing_shard_file(split_dir, samples):
    (split_dir / "shard-000001.tar").unlink()
    results = _read_all(ShardedSampleReader(split_dir))
    assert _fatal(results) == list(range(16, 32)) and _bad(results) == []
    assert "shard missing or unreadable" in results[16].problem
    assert results[16].path == str(split_dir / "shard-000001.tar")
    assert all(results[i].equals(samples[i]) for i in list(range(16)) + list(range(32, NUM)))
    assert ShardedSampleReader(split_dir).verify_shards() == {"shard-000001.tar": "missing"}


def test_missing_directory_or_index(tmp_path, split_dir):
    with pytest.raises(FileNotFoundError) as info:
        ShardedSampleReader(tmp_path / "does-not-exist")
    assert str(tmp_path / "does-not-exist") in str(info.value)
    assert "make_shapes_dataset.py" in str(info.value)

    (split_dir / INDEX_FILENAME).unlink()
    with pytest.raises(DataFileError, match="index.json: shard index missing"):
        ShardedSampleReader(split_dir)


def test_index_format_version_checked(split_dir):
    path = split_dir / INDEX_FILENAME
    doc = json.loads(path.read_text())
    doc["format_version"] = 999
    path.write_text(json.dumps(doc))
    with pytest.raises(DataFileError, match="format_version"):
        ShardedSampleReader(split_dir)


def test_bad_sample_error_pickles():
    err = pickle.loads(pickle.dumps(BadSampleError(7, "/x/shard-000000.tar", "boom")))
    assert (err.sample_id, err.shard_path, err.reason) == (7, "/x/shard-000000.tar", "boom")
    assert str(err) == "bad sample id=7 in /x/shard-000000.tar: boom"


def test_reader_is_context_manager(split_dir):
    with ShardedSampleReader(split_dir) as reader:
        reader[0]
        fds = list(reader._fds.values())
        assert fds
    assert reader._fds == {}
    with pytest.raises(OSError):
        os.fstat(fds[0])
