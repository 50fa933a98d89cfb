"""Bad-input matrix for the data pipeline: every corruption of a shard set,
its index, its samples, its tokenizer or a DiT set has one exact outcome.

* index / shard / tokenizer / dataset.json problems are fatal: a
  :class:`DataFileError` naming the file, which the entry point turns into
  one ``data error:`` line and exit 3 (a configured path that does not exist:
  ConfigError, exit 2);
* a sample written corrupt into an intact shard is *excluded* when the plan
  is built (its JSON) or *skipped* when read (its images / arrays), and
  counted either way.

Each case corrupts a copy of a tiny set built once per module; all run in
this process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.data.dataset_root import load_tokenizer
from megascale_omni.data.dit.buckets import Bucket
from megascale_omni.data.dit.reader import (
    DitSampleReader,
    encode_latent_record,
    encode_pixel_record,
    load_dataset_description,
)
from megascale_omni.data.errors import DataFileError
from megascale_omni.data.llava.batches import LlavaBatcher, LlavaEncoder, plan_sample
from megascale_omni.data.packing import Pack
from megascale_omni.data.shard_writer import encode_sample, write_member_shards, write_shards
from megascale_omni.data.shards import INDEX_FILENAME, BadSampleError, ShardedSampleReader
from megascale_omni.data.tokenizer import SpecialTokens, build_word_tokenizer
from megascale_omni.demo.shapes import dataset_vocabulary, generate_samples
from megascale_omni.entry import run_cli

SEED = 5
TOKENS_PER_IMAGE = 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 6-sample split in two shards, a tokenizer, and one 1-image sample."""
    root = tmp_path_factory.mktemp("base")
    samples = list(generate_samples(6, SEED))
    write_shards(samples, root / "split", samples_per_shard=3)
    tok = build_word_tokenizer(dataset_vocabulary(), root / "tokenizer.json")
    one_image = next(s for s in generate_samples(40, SEED) if s.num_images == 1)
    return root, tok, one_image


def _exit(fn: Callable[[], object], capsys) -> tuple[int, list[str]]:
    """Run ``fn`` under the entry points' ``run_cli``: (exit code, stderr lines)."""
    with pytest.raises(SystemExit) as info:
        run_cli(fn)
    return info.value.code, capsys.readouterr().err.splitlines()


def _assert_fatal(fn: Callable[[], object], path: Path, capsys) -> None:
    with pytest.raises(DataFileError) as info:
        fn()
    assert info.value.path == str(path)
    code, lines = _exit(fn, capsys)
    assert code == 3 and len(lines) == 1 and lines[0].startswith(f"data error: {path}: "), lines


# ------------------------------------------------------------------ index.json
def _edit(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        doc = json.loads(path.read_text())
        change(doc)
        path.write_text(json.dumps(doc))
    return apply


def _member(doc: dict, sample: int, suffix: str = "json") -> list:
    return doc["samples"][sample]["members"][suffix]


INDEX_CASES: dict[str, Callable[[Path], None]] = {
    "missing": lambda p: p.unlink(),
    "empty": lambda p: p.write_bytes(b""),
    "binary garbage": lambda p: p.write_bytes(bytes(range(256)) * 4),
    "cut in half": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "a JSON list": lambda p: p.write_text("[]"),
    "other format_version": _edit(lambda d: d.update(format_version=5)),
    "format 1 with costs": _edit(lambda d: d.update(format_version=1)),
    "cost_basis missing": _edit(lambda d: d.pop("cost_basis")),
    "cost_basis not a sha256": _edit(lambda d: d.update(cost_basis={"format": "words", "tokenizer": "x"})),
    "a sample's cost missing": _edit(lambda d: d["samples"][0].pop("cost")),
    "cost tokens negative": _edit(lambda d: d["samples"][0]["cost"].update(tokens=-1)),
    "cost tokens without a cost_basis": _edit(lambda d: d["samples"][0]["cost"].update(tokens=5)),
    "cost image size not a pair": _edit(lambda d: d["samples"][0]["cost"].update(images=[[32]])),
    "cost sizes for no image member": _edit(lambda d: d["samples"][0]["cost"].update(images=[[1, 1]] * 9)),
    "samples field missing": _edit(lambda d: d.pop("samples")),
    "shards not a list": _edit(lambda d: d.update(shards={})),
    "num_samples too high": _edit(lambda d: d.update(num_samples=d["num_samples"] + 1)),
    "num_samples a string": _edit(lambda d: d.update(num_samples=str(d["num_samples"]))),
    "a shard's count wrong": _edit(lambda d: d["shards"][0].update(num_samples=2)),
    "sample names shard 9": _edit(lambda d: d["samples"][0].update(shard=9)),
    "sample id a string": _edit(lambda d: d["samples"][0].update(id="zero")),
    "duplicate key": _edit(lambda d: d["samples"][1].update(key=d["samples"][0]["key"])),
    "member past the shard's end": _edit(lambda d: _member(d, 5).__setitem__(0, 10**9)),
    "negative member size": _edit(lambda d: _member(d, 0).__setitem__(1, -1)),
    "member offset off the tar grid": _edit(lambda d: _member(d, 0).__setitem__(0, _member(d, 0)[0] + 1)),
    "member not a pair": _edit(lambda d: d["samples"][0]["members"].update(json="x")),
    "sha256 not hex": _edit(lambda d: d["shards"][0].update(sha256="z" * 64)),
    "shard name leaves the split": _edit(lambda d: d["shards"][0].update(name="../shard-000000.tar")),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_broken_index_is_fatal_and_names_it(case, base, tmp_path, capsys):
    split = tmp_path / "split"
    shutil.copytree(base[0] / "split", split)
    INDEX_CASES[case](split / INDEX_FILENAME)
    _assert_fatal(lambda: ShardedSampleReader(split), split / INDEX_FILENAME, capsys)


# ---------------------------------------------------------------------- shards
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _offset(split: Path, sample: int, suffix: str) -> int:
    return json.loads((split / INDEX_FILENAME).read_text())["samples"][sample]["members"][suffix][0]


def _set_sha(split: Path) -> None:
    _edit(lambda d: d["shards"][1].update(sha256="0" * 64))(split / INDEX_FILENAME)


def _as_directory(shard: Path) -> None:
    shard.unlink()
    shard.mkdir()


SHARD_CASES: dict[str, Callable[[Path, Path], None]] = {
    "a byte flipped in an image": lambda split, shard: _flip(shard, _offset(split, 3, "0.png") + 40),
    "a byte flipped in a json member": lambda split, shard: _flip(shard, _offset(split, 4, "json") + 3),
    "a byte flipped in a tar header": lambda split, shard: _flip(shard, _offset(split, 4, "json") - 512 + 2),
    "cut in half": lambda split, shard: shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2]),
    "garbage appended": lambda split, shard: shard.write_bytes(shard.read_bytes() + b"\0" * 1024),
    "emptied": lambda split, shard: shard.write_bytes(b""),
    "missing": lambda split, shard: shard.unlink(),
    "a directory": lambda split, shard: _as_directory(shard),
    "garbage of the same size": lambda split, shard: shard.write_bytes(os.urandom(shard.stat().st_size)),
    "overwritten by the other shard": lambda split, shard: shutil.copyfile(split / "shard-000000.tar", shard),
    "checksum in index.json edited": lambda split, shard: _set_sha(split),
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_shard_not_matching_its_index_is_fatal_and_names_it(case, base, tmp_path, capsys):
    split = tmp_path / "split"
    shutil.copytree(base[0] / "split", split)
    shard = split / "shard-000001.tar"  # samples 3..5
    SHARD_CASES[case](split, shard)
    reader = ShardedSampleReader(split)
    for i in range(3):  # the intact shard still reads
        reader[i]
    for i in range(3, 6):  # the plan's scan and a read of any sample of the shard stop alike
        with pytest.raises(DataFileError):
            reader.read_metadata(i)
    assert list(reader.verify_shards()) == [shard.name]
    _assert_fatal(lambda: ShardedSampleReader(split).read_metadata(4), shard, capsys)


# ------------------------------------------------- samples written corrupt
def _png(mode: str, size: int) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (size, size)).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(size: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size)).save(buf, format="JPEG")
    return buf.getvalue()


def _as(suffix: str, data: bytes) -> Callable[[dict], None]:
    """Replace image 0 by member ``0.<suffix>`` holding ``data``."""
    def apply(members: dict) -> None:
        members.pop("0.png")
        members[f"0.{suffix}"] = data
    return apply


def _flipped(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x01
    return bytes(out)


def _meta(change: Callable[[dict], object]) -> Callable[[dict], None]:
    def apply(members: dict) -> None:
        meta = json.loads(members["json"])
        change(meta)
        members["json"] = json.dumps(meta).encode()
    return apply


def _set_turn(turn: int, **fields) -> Callable[[dict], object]:
    return lambda m: m["conversation"][turn].update(fields)


def _two_user_turns(m: dict) -> None:
    m["conversation"].insert(1, {"role": "user", "text": "and"})


def _answer_placeholder(m: dict) -> None:
    m["conversation"][-1]["text"] += " <image>"


# case -> (corrupt the members of a 1-image sample, outcome, words of the reason)
SAMPLE_CASES: dict[str, tuple[Callable[[dict], None], str, str]] = {
    "png byte flipped": (lambda m: m.update({"0.png": _flipped(m["0.png"], len(m["0.png"]) // 2)}),
                         "skipped", "corrupt image member '0.png'"),
    "png cut in half": (lambda m: m.update({"0.png": m["0.png"][: len(m["0.png"]) // 2]}), "skipped", "0.png"),
    "png empty": (lambda m: m.update({"0.png": b""}), "skipped", "0.png"),
    "png random bytes": (lambda m: m.update({"0.png": bytes(range(200))}), "skipped", "0.png"),
    "a JPEG named .png": (lambda m: m.update({"0.png": _jpeg(32)}), "skipped", "is JPEG, expected PNG"),
    "a PNG named .jpg": (_as("jpg", _png("RGB", 32)), "skipped", "is PNG, expected JPEG"),
    "a jpeg cut short": (_as("jpg", _jpeg(32)[:-30]), "skipped", "corrupt image member '0.jpg'"),
    "16-bit grayscale png": (lambda m: m.update({"0.png": _png("I;16", 32)}), "skipped", "has mode I;16"),
    "png of the wrong size": (lambda m: m.update({"0.png": _png("RGB", 20)}), "skipped", "image shape"),
    "png member missing": (lambda m: m.pop("0.png"), "skipped", "member '0.<jpg|png|webp>' missing"),
    "two members for one image": (lambda m: m.update({"0.jpg": _jpeg(32)}), "skipped", "image 0 has 2 members"),
    "json member missing": (lambda m: m.pop("json"), "excluded", "member 'json' missing"),
    "json binary garbage": (lambda m: m.update(json=bytes(range(256))), "excluded", "corrupt json"),
    "json cut in half": (lambda m: m.update(json=m["json"][: len(m["json"]) // 2]), "excluded", "corrupt json"),
    "json a list": (lambda m: m.update(json=b"[1, 2]"), "excluded", "not an object"),
    "field missing": (_meta(lambda d: d.pop("conversation")), "excluded", "lacks field"),
    "id a string": (_meta(lambda d: d.update(id="seven")), "excluded", "'id'"),
    "num_images a string": (_meta(lambda d: d.update(num_images="1")), "excluded", "'num_images'"),
    "num_images a bool": (_meta(lambda d: d.update(num_images=True)), "excluded", "'num_images'"),
    "num_images negative": (_meta(lambda d: d.update(num_images=-1)), "excluded", "'num_images'"),
    "num_images 10**12": (_meta(lambda d: d.update(num_images=10**12)), "excluded", "placeholders"),
    "num_images 2 for 1 placeholder": (_meta(lambda d: d.update(num_images=2)), "excluded", "placeholders"),
    "conversation a string": (_meta(lambda d: d.update(conversation="hi")), "excluded", "'conversation'"),
    "turn text an int": (_meta(_set_turn(0, text=3)), "excluded", "'conversation'"),
    "turn without role": (_meta(lambda d: d["conversation"][0].pop("role")), "excluded", "'conversation'"),
    "turn with an extra key": (_meta(_set_turn(0, extra="x")), "excluded", "keys 'role' and 'text'"),
    "two user turns in a row": (_meta(_two_user_turns), "excluded", "expected 'assistant'"),
    "unknown kind": (_meta(lambda d: d.update(kind="audio")), "excluded", "unknown kind"),
    "dependent words not in the answer": (_meta(lambda d: d.update(image_dependent_words=["zzz"])),
                                          "excluded", "subsequence"),
    "dependent words a string": (_meta(lambda d: d.update(image_dependent_words="red")),
                                 "excluded", "image_dependent_words"),
    "placeholder in the answer": (_meta(_answer_placeholder), "excluded", "assistant text contains"),
}


def _outcome(split: Path, tok) -> tuple[str, str]:
    """What the LLaVA pipeline does with sample 0: plan it (like the task's
    scan), then read it into a micro-batch. ("excluded" | "skipped" | "ok", reason)."""
    reader = ShardedSampleReader(split)
    encoder = LlavaEncoder(tok, TOKENS_PER_IMAGE)
    try:
        n, _ = plan_sample(reader, encoder, 0)
    except BadSampleError as err:
        assert err.shard_path == str(split / "shard-000000.tar")
        return "excluded", str(err)
    batcher = LlavaBatcher(reader, encoder, 4 * n, tok.pad_id, image_size=32)
    batch = batcher.microbatch([Pack((0,), (0,), (n,))], [0])
    if batcher.counter.skipped:
        assert batcher.counter.skipped == 1 and batcher.counter.seen == 0 and batch["images"].shape[0] == 0
        return "skipped", batcher.counter.reasons[0]
    return "ok", ""


def test_intact_sample_is_used(base, tmp_path):
    _, tok, sample = base
    write_member_shards([encode_sample(sample)], tmp_path / "split", 1)
    assert _outcome(tmp_path / "split", tok) == ("ok", "")


@pytest.mark.parametrize("case", list(SAMPLE_CASES))
def test_sample_written_corrupt_is_excluded_or_skipped_and_counted(case, base, tmp_path):
    _, tok, sample = base
    corrupt, outcome, words = SAMPLE_CASES[case]
    members = encode_sample(sample)
    corrupt(members)
    write_member_shards([members], tmp_path / "split", 1)  # index and checksum describe it as written
    got, reason = _outcome(tmp_path / "split", tok)
    assert got == outcome and words in reason, reason


# ------------------------------------------------------------------ DiT samples
def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def _latent(m: dict) -> np.ndarray:
    return np.load(io.BytesIO(m["latent.npy"]))


def _with(name: str, fn: Callable[[np.ndarray], object]) -> Callable[[dict], None]:
    return lambda m: m.update({name: _npy(fn(np.load(io.BytesIO(m[name]))))})


def _poison(value: float) -> Callable[[np.ndarray], np.ndarray]:
    def apply(a: np.ndarray) -> np.ndarray:
        a = a.copy()
        a.flat[3] = value
        return a
    return apply


# case -> (kind, corrupt the members, outcome, words of the reason)
DIT_CASES: dict[str, tuple[str, Callable[[dict], None], str, str]] = {
    "latent NaN": ("latents", _with("latent.npy", _poison(np.nan)), "skipped", "NaN or Inf"),
    "latent Inf": ("latents", _with("latent.npy", _poison(np.inf)), "skipped", "NaN or Inf"),
    "latent int32": ("latents", _with("latent.npy", lambda a: a.astype(np.int32)), "skipped", "dtype int32"),
    "latent complex": ("latents", _with("latent.npy", lambda a: a.astype(np.complex64)), "skipped", "dtype"),
    "latent 2-D": ("latents", _with("latent.npy", lambda a: a[0]), "skipped", "3 dimensions"),
    "latent of another size": ("latents", _with("latent.npy", lambda a: a[:, :, :4]), "skipped", "json says 8x8"),
    "latent garbage": ("latents", lambda m: m.update({"latent.npy": b"\x93NUMPY garbage"}), "skipped",
                       "corrupt array member"),
    "latent pickled objects": ("latents", lambda m: m.update({"latent.npy": _npy(np.array([{}], dtype=object))}),
                               "skipped", "corrupt array member"),
    "latent missing": ("latents", lambda m: m.pop("latent.npy"), "skipped", "member 'latent.npy' missing"),
    "text states NaN": ("latents", _with("text.npy", _poison(np.nan)), "skipped", "NaN or Inf"),
    "text states 1-D": ("latents", _with("text.npy", lambda a: a[0]), "skipped", "2 dimensions"),
    "text states empty": ("latents", _with("text.npy", lambda a: a[:0]), "skipped", "empty"),
    "text states missing": ("latents", lambda m: m.pop("text.npy"), "skipped", "member 'text.npy' missing"),
    "height a string": ("latents", _meta(lambda d: d.update(height="8")), "excluded", "'height'"),
    "width zero": ("latents", _meta(lambda d: d.update(width=0)), "excluded", "'width'"),
    "height missing": ("latents", _meta(lambda d: d.pop("height")), "excluded", "lacks field"),
    "id a float": ("latents", _meta(lambda d: d.update(id=1.5)), "excluded", "'id'"),
    "caption an int": ("latents", _meta(lambda d: d.update(caption=3)), "excluded", "'caption'"),
    "json a list": ("latents", lambda m: m.update(json=b"[]"), "excluded", "not an object"),
    "png grayscale": ("pixels", lambda m: m.update(png=_png("L", 8)), "skipped", "mode L"),
    "png byte flipped": ("pixels", lambda m: m.update(png=_flipped(m["png"], len(m["png"]) // 2)), "skipped",
                         "corrupt image member 'png'"),
    "png of another size": ("pixels", lambda m: m.update(png=_png("RGB", 12)), "skipped", "json says 8x8"),
    "png missing": ("pixels", lambda m: m.pop("png"), "skipped", "member 'png' missing"),
}


def _dit_outcome(split: Path, kind: str) -> tuple[str, str]:
    reader = DitSampleReader(split, kind)
    try:
        reader.metadata(0)
    except BadSampleError as err:
        return "excluded", str(err)
    try:
        reader.load(0, Bucket(8, 8), need_text_states=kind == "latents")
    except BadSampleError as err:
        return "skipped", str(err)
    return "ok", ""


def _dit_record(kind: str) -> dict:
    rng = np.random.default_rng(0)
    if kind == "latents":
        return encode_latent_record(0, rng.standard_normal((4, 8, 8)), "a red square", rng.standard_normal((3, 16)))
    return encode_pixel_record(0, rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), "a red square")


@pytest.mark.parametrize("kind", ["latents", "pixels"])
def test_intact_dit_sample_is_used(kind, tmp_path):
    write_member_shards([_dit_record(kind)], tmp_path / "split", 1)
    assert _dit_outcome(tmp_path / "split", kind) == ("ok", "")


@pytest.mark.parametrize("case", list(DIT_CASES))
def test_dit_sample_written_corrupt_is_excluded_or_skipped(case, tmp_path):
    kind, corrupt, outcome, words = DIT_CASES[case]
    members = _dit_record(kind)
    corrupt(members)
    write_member_shards([members], tmp_path / "split", 1)
    got, reason = _dit_outcome(tmp_path / "split", kind)
    assert got == outcome and words in reason, reason


# ------------------------------------------------------------ tokenizer files
def _no_special(token: str) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        build_word_tokenizer(["red", "square"], path, SpecialTokens(**{token: f"<x{token}>"}))
    return apply


TOKENIZER_CASES: dict[str, Callable[[Path], None]] = {
    "empty": lambda p: p.write_bytes(b""),
    "binary garbage": lambda p: p.write_bytes(bytes(range(256))),
    "cut in half": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "a JSON object without a model": lambda p: p.write_text("{}"),
    "a JSON list": lambda p: p.write_text("[]"),
    "no image token": _no_special("image"),
    "no pad token": _no_special("pad"),
    "no eos token": _no_special("eos"),
}


@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_broken_tokenizer_is_fatal_and_names_it(case, base, tmp_path, capsys):
    path = tmp_path / "tokenizer.json"
    shutil.copyfile(base[0] / "tokenizer.json", path)
    TOKENIZER_CASES[case](path)
    cfg = JobConfig()
    cfg.data.tokenizer = str(path)
    _assert_fatal(lambda: load_tokenizer(cfg, tmp_path), path, capsys)


@pytest.mark.parametrize("case", ["path does not exist", "directory without a tokenizer"])
def test_wrong_tokenizer_path_is_a_config_error(case, tmp_path, capsys):
    path = tmp_path / "nope"
    if case == "directory without a tokenizer":
        path.mkdir()
    cfg = JobConfig()
    cfg.data.tokenizer = str(path)
    with pytest.raises(ConfigError) as info:
        load_tokenizer(cfg, tmp_path)
    assert info.value.field == "data.tokenizer" and info.value.value == str(path)
    code, lines = _exit(lambda: load_tokenizer(cfg, tmp_path), capsys)
    assert code == 2 and len(lines) == 1 and str(path) in lines[0]


# ------------------------------------------------------- DiT dataset.json
DESCRIPTION_CASES = {
    "binary garbage": bytes(range(256)),
    "a JSON list": b"[]",
    "unknown kind": b'{"kind": "video", "in_channels": 3}',
    "in_channels a string": b'{"kind": "latents", "in_channels": "4"}',
    "in_channels zero": b'{"kind": "latents", "in_channels": 0}',
    "unknown text source": b'{"kind": "pixels", "in_channels": 3, "text": "audio"}',
}


@pytest.mark.parametrize("case", list(DESCRIPTION_CASES))
def test_broken_dit_description_is_fatal_and_names_it(case, tmp_path, capsys):
    (tmp_path / "dataset.json").write_bytes(DESCRIPTION_CASES[case])
    _assert_fatal(lambda: load_dataset_description(tmp_path), tmp_path / "dataset.json", capsys)
