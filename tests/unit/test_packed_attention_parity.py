"""The torch-only packed attention path equals the per-segment path it
replaced (tests/attention_reference.py), fp32, within PARITY = 1e-5
(absolute, on outputs and on every gradient).

Claims checked here (one process):
- core attention: causal and bidirectional THD, grouped-query heads, empty
  and equal-length segments, one SDPA call per distinct length (CPU); the
  padded batches of CUDA (forced on CPU) in fewer calls than segments;
- RoPE positions computed on the device equal megatron's per-segment THD
  RoPE, at CP 1 and on each rank of CP 2 and CP 4;
- whole models: packed GPT (RoPE, GQA) and LLaVA (images through the
  bidirectional vision tower, RoPE in the LM): logits and all parameter
  gradients of the new path equal the reference path's.
CP 2 (ring attention) is checked against full attention in
tests/dist/test_ring_attention.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megascale_omni.config import load_job_config
from megascale_omni.data.packing import packed_cu_seqlens
from megascale_omni.models.attention import PackedCoreAttention, packed_seq_params, thd_inputs
from megascale_omni.models.packed_kernels import SegmentBatches
from megascale_omni.models.packed_rope import thd_rope_positions
from tests.attention_reference import PerSegmentCoreAttention, use_reference_attention
from tests.launcher import REPO

PARITY = 1e-5


@pytest.fixture(scope="module")
def one_rank():
    from megascale_omni.models.standalone import one_process

    with one_process(seed=0):
        yield


def _config(heads=4, groups=2):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                             attention_dropout=0.0, hidden_dropout=0.0, pipeline_dtype=torch.float32)


def _max_diff(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max())


LENGTHS = [[5, 13, 1, 9, 20, 0, 3, 3, 3], [64], [8, 8, 8, 8], [31, 2, 17, 17, 1]]


def _inputs(lengths):
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(len(lengths))
    return cu, [torch.randn(t, h, 8, generator=g) for h in (4, 2, 2)], torch.randn(t, 32, generator=g)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_core_attention_matches_per_segment_path(causal, lengths):
    """The module on CPU: one SDPA call per distinct segment length, no padding."""
    from megatron.core.transformer.enums import AttnMaskType

    cu, inputs, grad = _inputs(lengths)
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    results = []
    for cls in (PackedCoreAttention, PerSegmentCoreAttention):
        xs = [x.clone().requires_grad_() for x in inputs]
        params = packed_seq_params(cu)
        out = cls(_config(), 1, mask, "self")(*xs, None, packed_seq_params=params)
        out.backward(grad)
        results.append([out, *(x.grad for x in xs)])
        if cls is PackedCoreAttention:
            calls = len(params.derived["segment_batches", causal, torch.device("cpu")].batches)
    for label, new, old in zip(("out", "dq", "dk", "dv"), *results):
        assert _max_diff(new, old) <= PARITY, (label, _max_diff(new, old))
    assert calls == len(set(n for n in lengths if n))


@pytest.mark.parametrize("lengths", LENGTHS)
def test_padded_segment_batches_match_per_segment_path(lengths):
    """The padded batches CUDA uses (forced here on CPU): causal segments of
    similar length share one SDPA call, padding at the end of each row."""
    from megatron.core.transformer.enums import AttnMaskType

    cu, inputs, grad = _inputs(lengths)
    reference = PerSegmentCoreAttention(_config(), 1, AttnMaskType.causal, "self")
    results = []
    for padded in (True, False):
        xs = [x.clone().requires_grad_() for x in inputs]
        if padded:
            batches = SegmentBatches(cu.tolist(), True, torch.device("cpu"), pad=True)
            out = batches.attend(*xs, True, reference.softmax_scale, 0.0).reshape(len(xs[0]), -1)
        else:
            out = reference(*xs, None, packed_seq_params=packed_seq_params(cu))
        out.backward(grad)
        results.append([out, *(x.grad for x in xs)])
    for label, new, old in zip(("out", "dq", "dk", "dv"), *results):
        assert _max_diff(new, old) <= PARITY, (label, _max_diff(new, old))
    segments = sum(1 for n in lengths if n)
    assert len(batches.batches) < segments or segments == 1
    if len(set(lengths) - {0}) > 1:  # unequal lengths: some batch is gathered and padded
        assert any(b.count > 1 and b.start is None for b in batches.batches)


class _Group(SimpleNamespace):
    def size(self):
        return self.cp

    def rank(self):
        return self.r


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_rope_positions_equal_megatron_thd_rope(one_rank, cp):
    """megatron's THD RoPE rotates each local token by its in-segment position;
    rotating by the table at :func:`thd_rope_positions` is the same, exactly."""
    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_bshd,
        _apply_rotary_pos_emb_thd,
    )
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    lengths = [8 * cp, 0, 2 * cp, 4 * cp]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    freqs = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(max(lengths))  # [max, 1, 1, 8]
    local = sum(lengths) // cp
    for rank in range(cp):
        x = torch.randn(local, 2, 8, generator=torch.Generator().manual_seed(rank))
        want = _apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=_Group(cp=cp, r=rank))
        positions = thd_rope_positions(cu, local, cp, rank)
        got = _apply_rotary_pos_emb_bshd(x.unsqueeze(1), freqs.index_select(0, positions)).squeeze(1)
        assert torch.equal(got, want), (rank, _max_diff(got, want))


def _row_batch(lengths_per_row, seq, vocab, seed):
    from megascale_omni.data.packing import Pack, collate_pack

    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in lengths_per_row:
        members = [torch.randint(6, vocab, (n,), generator=g).tolist() for n in lengths]
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        rows.append(collate_pack(Pack(tuple(range(len(lengths))), tuple(offsets), tuple(lengths)), members, None,
                                 None, seq_length=seq, pad_id=0))
    batch = {key: torch.stack([r[key] for r in rows]) for key in ("tokens", "position_ids", "segment_ids")}
    batch["cu_seqlens"] = packed_cu_seqlens(batch["segment_ids"])
    return batch


def _logits_and_grads(model, batch, images=None):
    model.zero_grad(set_to_none=True)
    tokens, position_ids, _, params = thd_inputs(batch)
    if images is not None:
        out = model(tokens, position_ids, params, images=images)
    else:
        out = model(tokens, position_ids, None, packed_seq_params=params)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(model, run):
    from megascale_omni.models.packed_rope import PackedSelfAttention

    assert any(type(m) is PackedSelfAttention for m in model.modules())
    new_out, new_grads = run()
    assert use_reference_attention(model) > 0
    old_out, old_grads = run()
    assert new_grads.keys() == old_grads.keys() and new_grads
    assert _max_diff(new_out, old_out) <= PARITY, _max_diff(new_out, old_out)
    worst = max(new_grads, key=lambda n: _max_diff(new_grads[n], old_grads[n]))
    assert _max_diff(new_grads[worst], old_grads[worst]) <= PARITY, (worst, _max_diff(new_grads[worst], old_grads[worst]))


def _build(config, *overrides, image_token=-1):
    from megascale_omni.models.standalone import build_model

    cfg = load_job_config(["--config", str(REPO / config), *overrides])
    return build_model(cfg, cfg.model.padded_vocab_size(cfg.model.vocab_size), image_token).train(), cfg


def test_packed_gpt_matches_per_segment_path(one_rank):
    model, cfg = _build("examples/gpt/tiny.yaml", "model.position_embedding_type=rope", "model.num_query_groups=2")
    batch = _row_batch([[11, 13, 3], [20, 1, 1]], cfg.model.seq_length, cfg.model.vocab_size, seed=0)
    _compare(model, lambda: _logits_and_grads(model, batch))


def test_llava_with_images_matches_per_segment_path(one_rank):
    image_token, vocab = 5, 64
    model, cfg = _build("examples/llava/tiny_cpu.yaml", f"model.vocab_size={vocab}", "model.seq_length=96",
                        "model.position_embedding_type=rope", image_token=image_token)
    p, size = cfg.vision.tokens_per_image, cfg.vision.image_size
    batch = _row_batch([[30 + p, 20 + p, 4]], cfg.model.seq_length, vocab, seed=1)
    tokens = batch["tokens"].clone()
    tokens[0, 3 : 3 + p] = image_token  # one image in each of the first two samples
    tokens[0, 30 + p + 2 : 30 + 2 * p + 2] = image_token
    batch["tokens"] = tokens
    images = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2))
    _compare(model, lambda: _logits_and_grads(model, batch, images))
