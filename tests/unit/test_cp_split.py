"""The context-parallel sequence split (megascale_omni.parallel.context) and
the THD micro-batch sharding built on it (models.attention.cp_shard_batch)."""

from __future__ import annotations

import pytest
import torch

from megascale_omni.data.llava.batches import EncodedSample, pad_encoded, padded_length
from megascale_omni.models.attention import cp_shard_batch, thd_inputs
from megascale_omni.parallel.context import cp_token_index, local_segments, pad_segments


def test_each_rank_holds_chunk_r_and_its_mirror_of_every_segment():
    cu = torch.tensor([0, 8, 12])  # segments of 8 and 4 tokens, cp = 2: chunks of 2 and 1
    assert cp_token_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_token_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ranks_partition_the_sequence_and_balance_causal_work(cp):
    cu = torch.tensor([0, 16 * cp, 24 * cp, 32 * cp])
    parts = [cp_token_index(cu, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(32 * cp))
    # Causal work of a token ~ its position in its segment + 1: equal on every rank.
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    work = [int((idx - starts[idx] + 1).sum()) for idx in parts]
    assert len(set(work)) == 1


def test_a_segment_not_divisible_by_2cp_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"segment 1 \[8, 14\) has 6 tokens, not a multiple of 2 \* cp = 4"):
        cp_token_index(torch.tensor([0, 8, 14]), 2, 0)


def test_pad_segments_and_the_local_layout():
    padded = pad_segments(torch.tensor([0, 5, 6, 15]), 4)
    assert padded.cu_seqlens_padded.tolist() == [0, 8, 12, 24]
    assert padded.position.tolist() == [0, 1, 2, 3, 4, 8, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    layout = local_segments(padded.cu_seqlens, padded.cu_seqlens_padded, 2)
    assert [(s.offset, s.chunk, s.valid) for s in layout] == [(0, 2, 5), (4, 1, 1), (6, 3, 9)]


def test_shard_batch_splits_per_token_tensors_and_keeps_cu_seqlens_global():
    rows, s = 2, 8
    batch = {
        "tokens": torch.arange(rows * s).view(rows, s),
        "labels": torch.arange(rows * s).view(rows, s) + 100,
        "loss_mask": torch.ones(rows, s),
        "position_ids": torch.arange(s).repeat(rows, 1),
        "cu_seqlens": torch.tensor([0, 4, 8, 16], dtype=torch.int32),
        "images": torch.zeros(3, 3, 4, 4),
    }
    local = cp_shard_batch(batch, 2, 1)
    assert local["tokens"].tolist() == [[1, 2, 5, 6, 10, 11, 12, 13]]
    assert local["labels"].tolist() == [[101, 102, 105, 106, 110, 111, 112, 113]]
    assert local["cu_seqlens"] is batch["cu_seqlens"] and local["images"] is batch["images"]
    tokens, position_ids, labels, packed = thd_inputs(local, cp_size=2)
    assert tokens.shape == (1, 8) and packed.max_seqlen_q == 8 and packed.cu_seqlens_q_padded is packed.cu_seqlens_q
    with pytest.raises(ValueError, match="cu_seqlens ends at 16"):
        thd_inputs(local)


def test_samples_are_padded_inside_their_segment_without_loss():
    enc = EncodedSample(3, [5, 6, 7], [0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [])
    out = pad_encoded(enc, 4, pad_id=0)
    assert out.tokens == [5, 6, 7, 0] and out.target_mask == [0.0, 1.0, 1.0, 0.0] and out.eval_mask[-1] == 0.0
    assert pad_encoded(enc, 1, pad_id=0) is enc
    assert [padded_length(n, 4) for n in (1, 4, 5)] == [4, 4, 8]
