"""Tests for LLaVA sample encoding and micro-batch collation (megascale_omni.data.llava.batches).

Everything runs on a tiny shapes dataset (60 train samples, 32x32 images) built
once per module; expected tensors are rebuilt here from the raw samples with
the word-level tokenizer, independently of the code under test.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megascale_omni.data.health import SkipCounter
from megascale_omni.data.llava.batches import (
    EncodedSample,
    LlavaBatcher,
    LlavaEncoder,
    images_to_tensor,
)
from megascale_omni.data.packing import pack_samples
from megascale_omni.data.sample import IMAGE_PLACEHOLDER, KIND_TEXT_ONLY, Sample
from megascale_omni.data.shard_writer import index_shards
from megascale_omni.data.shards import INDEX_FILENAME, BadSampleError, ShardedSampleReader
from megascale_omni.demo.llava_shapes import load_shapes_tokenizer, make_shapes_dataset, open_shapes_split

SEED = 7
NUM_TRAIN = 60
IMAGE_SIZE = 32
P = 4  # tokens per image
SEQ = 64
ROWS = 3  # rows per micro-batch in the collation tests


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llava") / "shapes"
    make_shapes_dataset(out, num_train=NUM_TRAIN, num_val=20, seed=SEED, image_size=IMAGE_SIZE,
                        samples_per_shard=20)
    return out


@pytest.fixture(scope="module")
def reader(dataset_dir) -> ShardedSampleReader:
    r = open_shapes_split(dataset_dir, "train")
    yield r
    r.close()


@pytest.fixture(scope="module")
def tok(dataset_dir):
    return load_shapes_tokenizer(dataset_dir)


@pytest.fixture(scope="module")
def encoder(tok) -> LlavaEncoder:
    return LlavaEncoder(tok, P)


@pytest.fixture(scope="module")
def samples(reader) -> list[Sample]:
    out = [reader[i] for i in range(len(reader))]
    assert len(out) == NUM_TRAIN
    return out


@pytest.fixture(scope="module")
def plan(reader, encoder):
    """A shuffled subset of reader indices (the id map) and its packs."""
    id_map = np.random.default_rng(0).permutation(NUM_TRAIN)[:45]
    lengths = [encoder.length_from_metadata(reader.read_metadata(int(i))) for i in id_map]
    packs = pack_samples(lengths, SEQ)
    return id_map, packs


# ------------------------------------------------------------------ helpers
def _prompt_len(sample: Sample) -> int:
    return 1 + sum(P if w == IMAGE_PLACEHOLDER else 1 for w in sample.user_text.split())


def _expected_tokens(tok, sample: Sample) -> list[int]:
    """Reference encoding built word by word from the vocabulary."""
    ids = [tok.bos_id]
    for w in sample.user_text.split():
        ids += [tok.image_token_id] * P if w == IMAGE_PLACEHOLDER else [tok.token_to_id(w)]
    ids += [tok.token_to_id(w) for w in sample.answer_text.split()]
    return ids + [tok.eos_id]


def _expected_masks(sample: Sample) -> tuple[list[float], list[float]]:
    n_prompt, n_answer = _prompt_len(sample), len(sample.answer_text.split())
    target = [0.0] * n_prompt + [1.0] * (n_answer + 1)
    dep = set(sample.image_dependent_positions())
    evalm = [0.0] * n_prompt + [1.0 if i in dep else 0.0 for i in range(n_answer)] + [0.0]
    return target, evalm


def _expected_row(tok, members: list[Sample]) -> dict[str, np.ndarray]:
    """Row tensors for ``members`` laid out contiguously from position 0."""
    pad = tok.pad_id
    row = {
        "tokens": np.full(SEQ, pad, np.int64),
        "labels": np.full(SEQ, pad, np.int64),
        "loss_mask": np.zeros(SEQ, np.float32),
        "eval_mask": np.zeros(SEQ, np.float32),
        "position_ids": np.zeros(SEQ, np.int64),
    }
    p = 0
    for s in members:
        toks = _expected_tokens(tok, s)
        target, evalm = _expected_masks(s)
        for j, t in enumerate(toks):
            row["tokens"][p + j] = t
            row["position_ids"][p + j] = j
            if j + 1 < len(toks):
                row["labels"][p + j] = toks[j + 1]
                row["loss_mask"][p + j] = target[j + 1]
                row["eval_mask"][p + j] = evalm[j + 1]
        p += len(toks)
    row["position_ids"][p:] = np.arange(SEQ - p)
    return row


def _expected_cu_seqlens(tok, rows: list[list[Sample]]) -> list[int]:
    """THD boundaries of rows laid out back to back: one segment per sample,
    one per non-empty padding tail."""
    bounds = [0]
    for r, members in enumerate(rows):
        p = 0
        for s in members:
            p += len(_expected_tokens(tok, s))
            bounds.append(r * SEQ + p)
        if p < SEQ:
            bounds.append((r + 1) * SEQ)
    return bounds


def _expected_images(images: list[np.ndarray]) -> torch.Tensor:
    arr = np.stack(images).astype(np.float64) / 127.5 - 1.0
    return torch.from_numpy(arr.transpose(0, 3, 1, 2).copy()).float()


def _image_blocks_row_major(tokens: torch.Tensor, image_id: int) -> int:
    """Number of P-token image placeholder blocks in a [b, s] tensor."""
    n = int((tokens == image_id).sum())
    assert n % P == 0
    return n // P


def _check_batch(batch, tok, rows: list[list[Sample]], images: list[np.ndarray]) -> None:
    b = len(rows)
    for key in ("tokens", "labels", "position_ids"):
        assert batch[key].shape == (b, SEQ) and batch[key].dtype == torch.int64, key
    for key in ("loss_mask", "eval_mask"):
        assert batch[key].shape == (b, SEQ) and batch[key].dtype == torch.float32, key
    assert "attention_mask" not in batch  # segments travel as cu_seqlens (THD), no dense mask
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == _expected_cu_seqlens(tok, rows)
    for r, members in enumerate(rows):
        exp = _expected_row(tok, members)
        for key in ("tokens", "labels", "loss_mask", "eval_mask", "position_ids"):
            np.testing.assert_array_equal(batch[key][r].numpy(), exp[key], err_msg=f"row {r} {key}")
    assert batch["images"].shape == (len(images), 3, IMAGE_SIZE, IMAGE_SIZE)
    assert batch["images"].dtype == torch.float32
    assert _image_blocks_row_major(batch["tokens"], tok.image_token_id) == len(images)
    if images:
        assert float(batch["images"].min()) >= -1.0 and float(batch["images"].max()) <= 1.0
        torch.testing.assert_close(batch["images"], _expected_images(images), rtol=0, atol=1e-6)


def _members(samples, pack, id_map) -> list[Sample]:
    return [samples[int(id_map[sid])] for sid in pack.sample_ids]


def _corrupt_png(split_dir: Path, index: int, member: str = "0.png") -> None:
    """Overwrite one member's data bytes in place (same size, tar header intact)
    and re-index, as if the sample had been written corrupt (the shard's
    checksum matches, so the sample is bad rather than the shard)."""
    doc = json.loads((split_dir / INDEX_FILENAME).read_text())
    loc = doc["samples"][index]
    offset, size = loc["members"][member]
    shard = split_dir / doc["shards"][loc["shard"]]["name"]
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write((b"\xde\xad\xbe\xef" * size)[:size])
    index_shards(split_dir)


# ------------------------------------------------------------- 1. encoder
def test_dataset_has_the_cases_the_tests_need(samples):
    kinds = {s.kind for s in samples}
    assert kinds == {"text_only", "single_image", "multi_image"}
    # a multi-word answer where only some words are image-dependent
    assert any(0 < len(s.image_dependent_words) < len(s.answer_text.split()) for s in samples)


def test_encode_known_sample_exact(tok, encoder):
    img = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    s = Sample(id=5, kind="single_image", images=[img],
               conversation=[{"role": "user", "text": "<image> describe the image ."},
                             {"role": "assistant", "text": "a magenta circle on the right"}],
               image_dependent_words=["magenta", "circle", "right"])
    enc = encoder.encode(s)
    assert isinstance(enc, EncodedSample) and enc.sample_id == 5
    w = tok.token_to_id
    assert enc.tokens == ([tok.bos_id] + [tok.image_token_id] * 4
                          + [w("describe"), w("the"), w("image"), w(".")]
                          + [w("a"), w("magenta"), w("circle"), w("on"), w("the"), w("right"), tok.eos_id])
    assert len(enc.tokens) == 16
    assert enc.target_mask == [0.0] * 9 + [1.0] * 7
    assert enc.eval_mask == [0.0] * 9 + [0.0, 1.0, 1.0, 0.0, 0.0, 1.0] + [0.0]
    assert len(enc.images) == 1 and enc.images[0] is img
    assert encoder.length_from_metadata(s.metadata()) == 16


def test_encode_every_sample(tok, encoder, reader, samples):
    for i, s in enumerate(samples):
        enc = encoder.encode(s)
        assert enc.tokens[0] == tok.bos_id and enc.tokens[-1] == tok.eos_id
        assert enc.tokens.count(tok.bos_id) == 1 and enc.tokens.count(tok.eos_id) == 1
        assert enc.tokens == _expected_tokens(tok, s), i
        assert enc.tokens.count(tok.image_token_id) == P * s.num_images
        assert encoder.length_from_metadata(reader.read_metadata(i)) == len(enc.tokens), i
        assert len(enc.target_mask) == len(enc.eval_mask) == len(enc.tokens)
        assert len(enc.images) == s.num_images
        assert all(np.array_equal(a, b) for a, b in zip(enc.images, s.images))


def test_image_placeholder_runs_have_p_tokens_per_image(tok, encoder, samples):
    for s in samples:
        toks = encoder.encode(s).tokens
        runs, run = [], 0
        for t in toks + [-1]:
            if t == tok.image_token_id:
                run += 1
            elif run:
                runs.append(run)
                run = 0
        # each maximal run of image tokens stands for k adjacent <image> words
        words = s.user_text.split()
        adjacent, k = [], 0
        for wd in words + [""]:
            if wd == IMAGE_PLACEHOLDER:
                k += 1
            elif k:
                adjacent.append(k)
                k = 0
        assert runs == [P * k for k in adjacent]


def test_target_mask_is_answer_and_eos(encoder, samples):
    for s in samples:
        enc = encoder.encode(s)
        n_prompt, n_answer = _prompt_len(s), len(s.answer_text.split())
        assert enc.target_mask == [0.0] * n_prompt + [1.0] * (n_answer + 1)
        assert sum(enc.target_mask) == n_answer + 1


def test_eval_mask_marks_image_dependent_words(tok, encoder, samples):
    checked = 0
    for s in samples:
        enc = encoder.encode(s)
        assert enc.eval_mask == _expected_masks(s)[1]
        scored = [t for t, m in zip(enc.tokens, enc.eval_mask) if m == 1.0]
        assert set(enc.eval_mask) <= {0.0, 1.0}
        assert all(t == 1.0 for t, m in zip(enc.target_mask, enc.eval_mask) if m == 1.0)
        assert enc.eval_mask[-1] == 0.0  # never the eos
        if s.kind == KIND_TEXT_ONLY:
            assert sum(enc.eval_mask) == 0.0
            assert s.image_dependent_words == []
        else:
            assert len(scored) == len(s.image_dependent_words) > 0
            assert tok.decode(scored) == " ".join(s.image_dependent_words)
            assert [tok.id_to_token(t) for t in scored] == s.image_dependent_words
            checked += 1
    assert checked > 0


def test_encode_rejects_placeholder_image_mismatch(encoder):
    img = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    s = Sample(id=3, kind="multi_image", images=[img, img],
               conversation=[{"role": "user", "text": "<image> what shape is it ?"},
                             {"role": "assistant", "text": "circle"}],
               image_dependent_words=["circle"])
    with pytest.raises(BadSampleError, match="text has 1 <image> but the sample has 2 images") as ei:
        encoder.encode(s)
    assert ei.value.sample_id == 3


# ------------------------------------------------------ 2. micro-batches
def test_microbatch_matches_reference(reader, encoder, tok, samples, plan):
    id_map, packs = plan
    assert sum(p.num_samples for p in packs) == len(id_map)
    mb = packs[:ROWS]
    assert all(p.num_samples >= 2 for p in mb)
    batcher = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE)
    batch = batcher.microbatch(mb, id_map)
    rows = [_members(samples, p, id_map) for p in mb]
    images = [img for members in rows for s in members for img in s.images]
    assert len(images) > 0
    _check_batch(batch, tok, rows, images)
    assert batcher.counter.seen == sum(p.num_samples for p in mb)
    assert batcher.counter.skipped == 0 and batcher.counter.reasons == []
    # pack offsets are honoured (nothing skipped, so layout == the plan's)
    for r, p in enumerate(mb):
        for off, length in zip(p.offsets, p.lengths):
            assert batch["tokens"][r, off] == tok.bos_id
            assert batch["tokens"][r, off + length - 1] == tok.eos_id
            assert batch["position_ids"][r, off] == 0


def test_microbatch_images_follow_row_major_placeholder_order(reader, encoder, tok, samples, plan):
    id_map, packs = plan
    mb = packs[:ROWS]
    batch = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE).microbatch(mb, id_map)
    # Walk [b, s] row-major; at each block start, find which sample/image it is.
    expected = []
    for r, p in enumerate(mb):
        toks = batch["tokens"][r].tolist()
        for sid, off, length in zip(p.sample_ids, p.offsets, p.lengths):
            s = samples[int(id_map[sid])]
            seg = toks[off:off + length]
            n_blocks = seg.count(tok.image_token_id) // P
            assert n_blocks == s.num_images
            expected.extend(s.images[:n_blocks])
    assert len(expected) == batch["images"].shape[0]
    for k, img in enumerate(expected):
        back = ((batch["images"][k].permute(1, 2, 0).numpy() + 1.0) * 127.5).round().astype(np.uint8)
        np.testing.assert_array_equal(back, img)


def test_labels_shift_within_samples_only(reader, encoder, tok, plan):
    id_map, packs = plan
    mb = packs[:ROWS]
    batch = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE).microbatch(mb, id_map)
    tokens, labels, loss = batch["tokens"], batch["labels"], batch["loss_mask"]
    on = loss == 1.0
    assert int(on.sum()) > 0
    assert torch.equal(labels[:, :-1][on[:, :-1]], tokens[:, 1:][on[:, :-1]])
    assert not bool(on[:, -1].any())
    assert set(loss.unique().tolist()) <= {0.0, 1.0}
    assert set(batch["eval_mask"].unique().tolist()) <= {0.0, 1.0}
    assert bool((batch["eval_mask"] <= loss).all())  # scored words are targets
    for r, p in enumerate(mb):
        for off, length in zip(p.offsets, p.lengths):
            last = off + length - 1
            # the last token (eos) predicts nothing: no loss across the boundary
            assert loss[r, last] == 0.0 and labels[r, last] == tok.pad_id
            assert batch["eval_mask"][r, last] == 0.0
            # the position before predicts this sample's eos
            assert loss[r, last - 1] == 1.0 and labels[r, last - 1] == tok.eos_id
        # padding: no loss, pad labels
        used = p.num_tokens
        assert float(loss[r, used:].sum()) == 0.0
        assert bool((labels[r, used:] == tok.pad_id).all())
        assert bool((tokens[r, used:] == tok.pad_id).all())


def test_cu_seqlens_separate_samples(reader, encoder, tok, plan):
    """Each sample is one THD segment of its own, in its row; position ids
    restart at each segment start (what RoPE and learned positions read)."""
    id_map, packs = plan
    mb = packs[:ROWS]
    batch = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE).microbatch(mb, id_map)
    cu = batch["cu_seqlens"].tolist()
    starts = {r * SEQ + off for r, p in enumerate(mb) for off in p.offsets}
    ends = {r * SEQ + off + n for r, p in enumerate(mb) for off, n in zip(p.offsets, p.lengths)}
    assert starts <= set(cu[:-1]) and ends <= set(cu[1:])
    assert len(cu) - 1 == sum(p.num_samples + (p.num_tokens < SEQ) for p in mb)
    positions = batch["position_ids"].reshape(-1)
    for start, end in zip(cu[:-1], cu[1:]):
        assert start // SEQ == (end - 1) // SEQ, "a segment crosses a row boundary"
        assert positions[start:end].tolist() == list(range(end - start))


# ------------------------------------------------------- 3. bad samples
@pytest.fixture
def corrupt_case(tmp_path, dataset_dir, samples, plan):
    """Copy of the train split with the first image sample of a multi-sample
    pack corrupted; returns (reader, pack, bad reader index)."""
    id_map, packs = plan
    pack = next(p for p in packs
                if p.num_samples >= 3 and samples[int(id_map[p.sample_ids[0]])].num_images >= 1
                and any(samples[int(id_map[s])].num_images for s in p.sample_ids[1:]))
    bad = int(id_map[pack.sample_ids[0]])
    split = tmp_path / "train"
    shutil.copytree(dataset_dir / "train", split)
    _corrupt_png(split, bad)
    r = ShardedSampleReader(split)
    yield r, pack, bad
    r.close()


def test_corrupt_png_is_detected_by_reader(corrupt_case):
    r, _, bad = corrupt_case
    with pytest.raises(BadSampleError, match="corrupt image member '0.png'") as ei:
        r[bad]
    assert ei.value.sample_id == bad
    r[(bad + 1) % NUM_TRAIN]  # neighbours still read


def test_bad_sample_is_skipped_and_row_relaid(corrupt_case, encoder, tok, samples, plan, caplog):
    r, pack, bad = corrupt_case
    id_map, _ = plan
    batcher = LlavaBatcher(r, encoder, SEQ, tok.pad_id, IMAGE_SIZE)
    with caplog.at_level(logging.WARNING, logger="megascale_omni.data.llava.batches"):
        batch = batcher.microbatch([pack], id_map)
    assert batcher.counter.skipped == 1
    assert batcher.counter.seen == pack.num_samples - 1
    assert len(batcher.counter.reasons) == 1 and f"id={bad}" in batcher.counter.reasons[0]
    assert any("skipping bad sample" in rec.getMessage() for rec in caplog.records)

    survivors = _members(samples, pack, id_map)[1:]
    images = [img for s in survivors for img in s.images]
    _check_batch(batch, tok, [survivors], images)
    # survivors are contiguous from position 0; only padding grew
    n_used = sum(len(_expected_tokens(tok, s)) for s in survivors)
    assert n_used == pack.num_tokens - pack.lengths[0]
    assert batch["tokens"][0, 0] == tok.bos_id and batch["position_ids"][0, 0] == 0
    assert bool((batch["tokens"][0, n_used:] == tok.pad_id).all())
    all_images = sum(s.num_images for s in _members(samples, pack, id_map))
    assert batch["images"].shape[0] == all_images - samples[bad].num_images

    # the counter accumulates over calls
    batcher.microbatch([pack], id_map)
    assert (batcher.counter.skipped, batcher.counter.seen) == (2, 2 * (pack.num_samples - 1))


def test_all_samples_of_a_row_skipped_gives_padding_row(tmp_path, dataset_dir, encoder, tok, samples):
    split = tmp_path / "train"
    shutil.copytree(dataset_dir / "train", split)
    bad = next(i for i, s in enumerate(samples) if s.num_images)
    _corrupt_png(split, bad)
    packs = pack_samples([len(_expected_tokens(tok, samples[bad]))], SEQ)
    with ShardedSampleReader(split) as r:
        batcher = LlavaBatcher(r, encoder, SEQ, tok.pad_id, IMAGE_SIZE)
        batch = batcher.microbatch(packs, [bad])
    assert (batcher.counter.skipped, batcher.counter.seen) == (1, 0)
    assert bool((batch["tokens"] == tok.pad_id).all())
    assert float(batch["loss_mask"].sum()) == 0.0 and float(batch["eval_mask"].sum()) == 0.0
    assert torch.equal(batch["position_ids"][0], torch.arange(SEQ))
    assert batch["images"].shape == (0, 3, 1, 1)


def test_wrong_image_size_is_skipped(reader, tok, encoder, samples):
    idx = next(i for i, s in enumerate(samples) if s.num_images)
    batcher = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, image_size=16)
    batch = batcher.microbatch(pack_samples([len(_expected_tokens(tok, samples[idx]))], SEQ), [idx])
    assert (batcher.counter.skipped, batcher.counter.seen) == (1, 0)
    assert "image shape (32, 32, 3) != (16, 16, 3)" in batcher.counter.reasons[0]
    assert batch["images"].shape[0] == 0


def test_image_donor_replaces_images_keeps_text(reader, encoder, tok, samples, plan):
    id_map, packs = plan
    mb = packs[:ROWS]
    rows = [_members(samples, p, id_map) for p in mb]
    recipients = [int(id_map[sid]) for p in mb for sid in p.sample_ids if samples[int(id_map[sid])].num_images]
    # donor: another sample (outside or inside the batch) with the same image count
    sources = {}
    for rid in recipients:
        n = samples[rid].num_images
        donor = next(i for i in range(NUM_TRAIN)
                     if i != rid and samples[i].num_images == n
                     and not all(np.array_equal(a, b) for a, b in zip(samples[i].images, samples[rid].images)))
        sources[rid] = donor
    plain = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE).microbatch(mb, id_map)
    batcher = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE)
    swapped = batcher.microbatch(mb, id_map, image_sources=sources)
    assert batcher.counter.seen == sum(p.num_samples for p in mb) and batcher.counter.skipped == 0
    for key in ("tokens", "labels", "loss_mask", "eval_mask", "position_ids", "cu_seqlens"):
        assert torch.equal(plain[key], swapped[key]), key
    expected = []
    for members in rows:
        for s in members:
            src = samples[sources.get(s.id, s.id)]
            expected.extend(src.images)
    _check_batch(swapped, tok, rows, expected)
    assert not torch.equal(plain["images"], swapped["images"])
    # the reader's own samples are untouched by the swap
    for rid in recipients:
        assert all(np.array_equal(a, b) for a, b in zip(reader[rid].images, samples[rid].images))


def test_image_donor_identity_and_unmapped_are_noops(reader, encoder, tok, plan):
    id_map, packs = plan
    mb = packs[:ROWS]
    plain = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE).microbatch(mb, id_map)
    ids = [int(id_map[sid]) for p in mb for sid in p.sample_ids]
    same = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE).microbatch(
        mb, id_map, image_sources={ids[0]: ids[0]})
    empty = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE).microbatch(mb, id_map, image_sources={})
    for other in (same, empty):
        for key, val in plain.items():
            assert torch.equal(val, other[key]), key


def test_image_donor_with_other_image_count_raises(reader, encoder, tok, samples):
    one = next(i for i, s in enumerate(samples) if s.num_images == 1)
    two = next(i for i, s in enumerate(samples) if s.num_images == 2)
    batcher = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, IMAGE_SIZE)
    packs = pack_samples([len(_expected_tokens(tok, samples[one]))], SEQ)
    with pytest.raises(ValueError, match=f"image donor {two} has 2 images"):
        batcher.microbatch(packs, [one], image_sources={one: two})


def test_bad_donor_skips_the_recipient(tmp_path, dataset_dir, encoder, tok, samples):
    split = tmp_path / "train"
    shutil.copytree(dataset_dir / "train", split)
    ones = [i for i, s in enumerate(samples) if s.num_images == 1]
    recipient, donor = ones[0], ones[1]
    _corrupt_png(split, donor)
    packs = pack_samples([len(_expected_tokens(tok, samples[recipient]))], SEQ)
    with ShardedSampleReader(split) as r:
        batcher = LlavaBatcher(r, encoder, SEQ, tok.pad_id, IMAGE_SIZE)
        batch = batcher.microbatch(packs, [recipient], image_sources={recipient: donor})
    assert (batcher.counter.skipped, batcher.counter.seen) == (1, 0)
    assert f"id={donor}" in batcher.counter.reasons[0]
    assert batch["images"].shape[0] == 0


def test_skip_counter_keeps_at_most_20_reasons():
    c = SkipCounter()
    for i in range(25):
        c.record_skip(BadSampleError(i, "/x", "boom"))
    assert c.skipped == 25 and c.seen == 0 and len(c.reasons) == 20
    assert c.reasons[0] == "bad sample id=0 in /x: boom"


# --------------------------------------------------- 4. images_to_tensor
def test_images_to_tensor_empty():
    out = images_to_tensor([])
    assert out.shape == (0, 3, 1, 1) and out.dtype == torch.float32
    assert images_to_tensor([], dtype=torch.bfloat16).dtype == torch.bfloat16


def test_images_to_tensor_known_values():
    a = np.zeros((2, 3, 3), np.uint8)
    a[..., 0] = 0
    a[..., 1] = 255
    a[0, 0, 2], a[1, 2, 2] = 51, 204
    b = np.full((2, 3, 3), 255, np.uint8)
    b[1, 1] = (0, 255, 0)
    out = images_to_tensor([a, b])
    assert out.shape == (2, 3, 2, 3) and out.dtype == torch.float32 and out.is_contiguous()
    assert bool((out[0, 0] == -1.0).all())  # channel 0 of a: pixel 0 -> exactly -1
    assert bool((out[0, 1] == 1.0).all())   # channel 1 of a: pixel 255 -> exactly +1
    assert out[0, 2, 0, 0].item() == pytest.approx(51 / 127.5 - 1.0, abs=1e-7)   # -0.6
    assert out[0, 2, 1, 2].item() == pytest.approx(204 / 127.5 - 1.0, abs=1e-7)  # +0.6
    assert out[0, 2, 0, 1].item() == -1.0
    assert out[1, :, 1, 1].tolist() == [-1.0, 1.0, -1.0]
    assert bool((out[1, :, 0] == 1.0).all())
    half = images_to_tensor([a], dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert half[0, 0, 0, 0].item() == -1.0 and half[0, 1, 0, 0].item() == 1.0
