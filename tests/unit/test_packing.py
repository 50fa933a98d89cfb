"""Unit tests for megascale_omni.data.packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megascale_omni.data.packing import (
    PAD_SEGMENT_ID,
    Pack,
    collate_pack,
    pack_samples,
    packed_cu_seqlens,
    packing_efficiency,
    packing_report,
    pad_to_max_efficiency,
)


def _synthetic_lengths(n: int, seed: int) -> np.ndarray:
    """LLaVA-like lengths: uniform 10..80 tokens inclusive."""
    return np.random.default_rng(seed).integers(10, 81, size=n)


def _brute_force_cu_seqlens(rows: list[list[int]]) -> list[int]:
    """Reference THD boundaries, run by run: each maximal run of one segment
    id inside a row is a segment; rows follow each other."""
    bounds, start = [0], 0
    for seg in rows:
        for i in range(1, len(seg) + 1):
            if i == len(seg) or seg[i] != seg[i - 1]:
                bounds.append(start + i)
        start += len(seg)
    return bounds


def _check_partition(packs: list[Pack], expected_ids: set[int], lengths: dict[int, int], cap: int):
    seen = [sid for p in packs for sid in p.sample_ids]
    assert len(seen) == len(set(seen)), "a sample was packed twice"
    assert set(seen) == expected_ids
    for p in packs:
        assert p.num_tokens <= cap
        # Offsets are contiguous from 0 and lengths match the input.
        assert p.offsets[0] == 0
        for k in range(1, p.num_samples):
            assert p.offsets[k] == p.offsets[k - 1] + p.lengths[k - 1]
        for sid, length in zip(p.sample_ids, p.lengths):
            assert length == min(lengths[sid], cap)


# ---------------------------------------------------------------- pack_samples


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("window", [16, 1024, None])
def test_pack_samples_partitions_every_sample(seed: int, window):
    lengths = _synthetic_lengths(500, seed)
    ids = np.arange(1000, 1500)
    packs = pack_samples(lengths, 256, sample_ids=ids, window=window)
    _check_partition(packs, set(ids.tolist()), dict(zip(ids.tolist(), lengths.tolist())), 256)


def test_pack_samples_is_deterministic():
    lengths = _synthetic_lengths(3000, 7)
    assert pack_samples(lengths, 256) == pack_samples(lengths.tolist(), 256)


def test_pack_samples_sums_costs():
    packs = pack_samples([3, 4, 5], 16, sample_ids=[10, 11, 12], costs=[1.0, 2.0, 4.5])
    assert len(packs) == 1
    assert packs[0].sample_ids == (10, 11, 12)  # members kept in stream order
    assert packs[0].offsets == (0, 3, 7)
    assert packs[0].cost == pytest.approx(7.5)


def test_pack_samples_best_fit_hand_example():
    # Decreasing order: 6, 5, 4, 3, 2. 6 -> bin0 (rem 2); 5 -> bin1 (rem 3);
    # 4 -> bin2 (rem 4); 3 -> bin1 exactly; 2 -> bin0 exactly.
    packs = pack_samples([5, 6, 2, 4, 3], 8, window=None)
    members = sorted(p.sample_ids for p in packs)
    assert members == [(0, 4), (1, 2), (3,)]
    # Packs are emitted by their earliest member.
    assert [p.sample_ids[0] for p in packs] == [0, 1, 3]


def test_window_keeps_locality():
    lengths = _synthetic_lengths(4096, 3)
    packs = pack_samples(lengths, 256, window=512)
    # With a 512-sample window no pack may mix samples from different windows.
    for p in packs:
        assert len({sid // 512 for sid in p.sample_ids}) == 1


def test_overlong_error_names_sample():
    with pytest.raises(ValueError, match=r"sample 42 has length 300 > seq_length 256"):
        pack_samples([10, 300], 256, sample_ids=[41, 42])


def test_overlong_truncate_and_drop():
    packs = pack_samples([10, 300], 256, sample_ids=[41, 42], overlong="truncate")
    by_id = {sid: length for p in packs for sid, length in zip(p.sample_ids, p.lengths)}
    assert by_id == {41: 10, 42: 256}

    packs = pack_samples([10, 300], 256, sample_ids=[41, 42], overlong="drop")
    assert [p.sample_ids for p in packs] == [(41,)]


def test_invalid_inputs_rejected():
    with pytest.raises(ValueError, match="non-positive length"):
        pack_samples([10, 0], 256)
    with pytest.raises(ValueError, match="overlong"):
        pack_samples([10], 256, overlong="squash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must match"):
        pack_samples([10, 20], 256, sample_ids=[1])


# ---------------------------------------------------------------- efficiency


def test_efficiency_on_llava_like_distribution():
    lengths = _synthetic_lengths(20_000, 0)
    report = packing_report(lengths, 256)
    assert report.packed_efficiency >= 0.95
    assert report.pad_to_max_efficiency < 0.6  # ~45/80: why packing matters
    assert report.packed_efficiency > report.pad_to_max_efficiency
    packs = pack_samples(lengths, 256)
    assert packing_efficiency(packs, 256) == pytest.approx(report.packed_efficiency)


def test_pad_to_max_efficiency_values():
    assert pad_to_max_efficiency([2, 4]) == pytest.approx(6 / 8)
    assert pad_to_max_efficiency([2, 4], max_len=8) == pytest.approx(6 / 16)
    assert pad_to_max_efficiency([2, 10], max_len=4) == pytest.approx(6 / 8)  # truncation
    with pytest.raises(ValueError):
        packing_efficiency([], 256)


# ---------------------------------------------------------------- collate


def _hand_pack():
    # Two samples (lengths 3 and 4) in a row of 9: positions 7, 8 are padding.
    pack = Pack(sample_ids=(5, 9), offsets=(0, 3), lengths=(3, 4), cost=0.0)
    tokens = [[11, 12, 13], [21, 22, 23, 24]]
    labels = [[11, 12, 13], [21, 22, 23, 24]]
    masks = [[0, 1, 1], [0, 0, 1, 1]]
    return pack, tokens, labels, masks


def test_collate_hand_example():
    pack, tokens, labels, masks = _hand_pack()
    out = collate_pack(pack, tokens, labels, masks, seq_length=9, pad_id=0)

    assert out["tokens"].tolist() == [11, 12, 13, 21, 22, 23, 24, 0, 0]
    assert out["labels"].tolist() == [12, 13, 0, 22, 23, 24, 0, 0, 0]
    assert out["loss_mask"].tolist() == [1, 1, 0, 0, 1, 1, 0, 0, 0]
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1]
    assert out["segment_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, PAD_SEGMENT_ID, PAD_SEGMENT_ID]
    assert out["tokens"].dtype == torch.int64
    assert out["labels"].dtype == torch.int64
    assert out["position_ids"].dtype == torch.int64
    assert out["segment_ids"].dtype == torch.int64
    assert out["loss_mask"].dtype == torch.float32
    assert all(t.shape == (9,) for t in out.values())


def test_collate_defaults_to_next_token_everywhere():
    pack, tokens, _, _ = _hand_pack()
    out = collate_pack(pack, tokens, None, None, seq_length=9, pad_id=0)
    assert out["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1, 0, 0, 0]


def test_collate_rejects_inconsistent_lengths():
    pack, tokens, labels, masks = _hand_pack()
    with pytest.raises(ValueError, match="sample 9"):
        collate_pack(pack, [tokens[0], tokens[1][:3]], None, None, seq_length=9, pad_id=0)
    with pytest.raises(ValueError, match="exceeds|> seq_length"):
        collate_pack(pack, tokens, labels, masks, seq_length=6, pad_id=0)


def test_collate_truncated_sample():
    packs = pack_samples([6], 4, overlong="truncate")
    out = collate_pack(packs[0], [[1, 2, 3, 4, 5, 6]], None, None, seq_length=4, pad_id=0)
    assert out["tokens"].tolist() == [1, 2, 3, 4]
    assert out["labels"].tolist() == [2, 3, 4, 0]
    assert out["loss_mask"].tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_labels_never_cross_boundaries_randomized(seed: int):
    rng = np.random.default_rng(seed)
    seq_length = 128
    lengths = rng.integers(1, 40, size=60)
    # Token ids encode (sample, position) so a cross-sample label is detectable.
    tokens = {sid: [1000 * (sid + 1) + j for j in range(n)] for sid, n in enumerate(lengths)}
    for pack in pack_samples(lengths, seq_length, window=None):
        toks = [tokens[sid] for sid in pack.sample_ids]
        out = collate_pack(pack, toks, None, None, seq_length, pad_id=0)
        seg, lab, msk = out["segment_ids"], out["labels"], out["loss_mask"]
        pos, tok = out["position_ids"], out["tokens"]
        for p in range(seq_length):
            if msk[p] > 0:
                # Target is the next token of the same sample.
                assert p + 1 < seq_length and seg[p + 1] == seg[p] >= 0
                assert lab[p] == tok[p + 1]
                assert lab[p] // 1000 == tok[p] // 1000
        for k, (off, n) in enumerate(zip(pack.offsets, pack.lengths)):
            assert pos[off : off + n].tolist() == list(range(n))
            assert msk[off + n - 1] == 0
            assert (seg[off : off + n] == k).all()
        assert (msk[pack.num_tokens :] == 0).all()


# ---------------------------------------------------------------- THD segments


def test_cu_seqlens_hand_example():
    pack, tokens, labels, masks = _hand_pack()
    seg = collate_pack(pack, tokens, labels, masks, seq_length=9, pad_id=0)["segment_ids"]
    assert seg.tolist() == [0, 0, 0, 1, 1, 1, 1, PAD_SEGMENT_ID, PAD_SEGMENT_ID]
    # Two rows: the second row's first sample starts a new segment although
    # the first row ends in padding, and its padding tail is a segment too.
    cu = packed_cu_seqlens(torch.stack([seg, seg]))
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 7, 9, 12, 16, 18]


def test_cu_seqlens_rows_without_padding_or_one_sample_each():
    assert packed_cu_seqlens(torch.zeros(3, 5, dtype=torch.int64)).tolist() == [0, 5, 10, 15]
    full = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 2, 2, 2]])
    assert packed_cu_seqlens(full).tolist() == [0, 2, 5, 6, 7, 10]
    empty_row = torch.full((1, 4), PAD_SEGMENT_ID)  # an evaluation filler row
    assert packed_cu_seqlens(empty_row).tolist() == [0, 4]


@pytest.mark.parametrize("seed", [0, 1])
def test_cu_seqlens_randomized_batch_matches_brute_force(seed: int):
    rng = np.random.default_rng(seed)
    batch = []
    for _ in range(3):
        seg, k = [], 0
        while len(seg) < 24:
            n = int(rng.integers(1, 8))
            seg.extend([k] * n)
            k += 1
        seg = seg[:24]
        pad = int(rng.integers(0, 5))
        seg[24 - pad :] = [PAD_SEGMENT_ID] * pad
        batch.append(seg)
    cu = packed_cu_seqlens(torch.tensor(batch, dtype=torch.int64)).tolist()
    assert cu == _brute_force_cu_seqlens(batch)
    flat = [x for row in batch for x in row]
    for start, end in zip(cu[:-1], cu[1:]):
        assert end > start and start // 24 == (end - 1) // 24  # non-empty, inside one row
        assert len(set(flat[start:end])) == 1  # one sample (or one padding tail)


def test_cu_seqlens_rejects_non_rows():
    with pytest.raises(ValueError, match=r"\[b, s\]"):
        packed_cu_seqlens(torch.zeros(5, dtype=torch.int64))


def test_collate_shifts_extra_masks_like_the_loss_mask():
    from megascale_omni.data.packing import Pack, collate_pack

    pack = Pack(sample_ids=(0, 1), offsets=(0, 3), lengths=(3, 2))
    tokens = [[5, 6, 7], [8, 9]]
    masks = [[0, 1, 1], [0, 1]]
    extra = [[0, 0, 1], [0, 1]]
    row = collate_pack(pack, tokens, None, masks, seq_length=6, pad_id=0, extra_masks={"eval_mask": extra})
    assert row["loss_mask"].tolist() == [1, 1, 0, 1, 0, 0]
    assert row["eval_mask"].tolist() == [0, 1, 0, 1, 0, 0]
    assert row["eval_mask"].dtype == torch.float32
    with pytest.raises(ValueError, match="eval_mask has 2 entries for 3 tokens"):
        collate_pack(pack, tokens, None, masks, 6, 0, extra_masks={"eval_mask": [[0, 1], [0, 1]]})
