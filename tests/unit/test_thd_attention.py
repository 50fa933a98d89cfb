"""Packed sequences as THD (megascale_omni.models.attention).

Claims checked here (fp32, one process):
- PackedCoreAttention equals a dense block-diagonal causal reference
  (1e-6), with grouped-query attention, and never mixes segments;
- RoPE restarts at every sample: megatron's THD rotary embedding with our
  ``cu_seqlens`` rotates each token by its per-sample ``position_ids``;
- packing isolation: the logits of sample B inside a packed row [A | B]
  equal B's logits alone within 1e-5, for GPT (learned and rotary
  positions) and LLaVA with images, through the THD path of training.
"""

from __future__ import annotations

import math

import pytest
import torch

from megascale_omni.config import load_job_config
from megascale_omni.data.packing import PAD_SEGMENT_ID, Pack, collate_pack, packed_cu_seqlens
from megascale_omni.models.attention import PackedCoreAttention, packed_seq_params, thd_inputs
from tests.launcher import REPO

ISOLATION_ATOL = 1e-5


@pytest.fixture(scope="module")
def one_rank():
    """megatron's TP1/PP1 state in this process (RNG tracker, CP group)."""
    from megascale_omni.models.standalone import one_process

    with one_process(seed=0):
        yield


def _config(num_heads: int = 4, groups: int = 4, dropout: float = 0.0):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=num_heads, num_query_groups=groups,
        attention_dropout=dropout, hidden_dropout=0.0, pipeline_dtype=torch.float32,
    )


def _random_segments(seed: int, rows: int = 3, s: int = 20) -> torch.Tensor:
    """``[rows, s]`` segment ids: random sample lengths, random padding tails."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((rows, s), PAD_SEGMENT_ID)
    for r in range(rows):
        p, k = 0, 0
        end = s - int(torch.randint(0, 5, (1,), generator=g))
        while p < end:
            n = min(int(torch.randint(1, 8, (1,), generator=g)), end - p)
            out[r, p : p + n] = k
            p, k = p + n, k + 1
    return out


def _dense_reference(q, k, v, row_segments: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention with an explicit ``[t, t]`` mask: key j is visible to query i
    iff j <= i, both in the same row and the same segment id."""
    t = q.shape[0]
    rows = torch.arange(row_segments.numel()) // row_segments.shape[1]
    seg = row_segments.reshape(-1)
    same = (seg[:, None] == seg[None, :]) & (rows[:, None] == rows[None, :])
    visible = same & torch.ones(t, t, dtype=torch.bool).tril()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("ind,jnd->nij", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("nij,jnd->ind", probs, v).reshape(t, -1)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_core_attention_matches_dense_block_diagonal_reference(heads, groups, seed):
    segments = _random_segments(seed)
    t, hn = segments.numel(), 8
    g = torch.Generator().manual_seed(100 + seed)
    q = torch.randn(t, heads, hn, generator=g)
    k, v = (torch.randn(t, groups, hn, generator=g) for _ in range(2))
    from megatron.core.transformer.enums import AttnMaskType

    attn = PackedCoreAttention(_config(heads, groups), 1, AttnMaskType.causal, "self").eval()
    out = attn(q, k, v, None, packed_seq_params=packed_seq_params(packed_cu_seqlens(segments)))
    assert out.shape == (t, heads * hn)
    ref = _dense_reference(q, k, v, segments, 1 / math.sqrt(hn))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_core_attention_rows_without_packed_params_are_causal_rows():
    """[s, b, n, d] inputs without PackedSeqParams: each row one causal segment."""
    from megatron.core.transformer.enums import AttnMaskType

    s, b, heads, hn = 6, 2, 4, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, b, heads, hn, generator=g) for _ in range(3))
    attn = PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self").eval()
    out = attn(q, k, v, None)
    assert out.shape == (s, b, heads * hn)
    for r in range(b):
        ref = _dense_reference(q[:, r], k[:, r], v[:, r], torch.zeros(1, s, dtype=torch.int64), 1 / math.sqrt(hn))
        torch.testing.assert_close(out[:, r], ref, rtol=0, atol=1e-6)


def test_core_attention_refuses_dense_masks_and_cp():
    from megatron.core.transformer.enums import AttnMaskType

    attn = PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self")
    x = torch.zeros(4, 1, 4, 8)
    with pytest.raises(ValueError, match="no dense mask"):
        attn(x, x, x, torch.zeros(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seqlens span"):
        attn(x[:, 0], x[:, 0], x[:, 0], None, packed_seq_params=packed_seq_params(torch.tensor([0, 3])))
    with pytest.raises(ValueError, match="arbitrary"):
        PackedCoreAttention(_config(), 1, AttnMaskType.arbitrary, "self")


def test_core_attention_dropout_only_in_training(one_rank):
    from megatron.core.transformer.enums import AttnMaskType

    segments = _random_segments(5)
    t = segments.numel()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(t, 4, 8, generator=g) for _ in range(3))
    params = packed_seq_params(packed_cu_seqlens(segments))
    attn = PackedCoreAttention(_config(dropout=0.5), 1, AttnMaskType.causal, "self")
    ref = _dense_reference(q, k, v, segments, 1 / math.sqrt(8))
    torch.testing.assert_close(attn.eval()(q, k, v, None, packed_seq_params=params), ref, rtol=0, atol=1e-6)
    dropped = attn.train()(q, k, v, None, packed_seq_params=params)
    assert (dropped - ref).abs().max() > 1e-2


def _manual_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x`` ``[t, n, d]`` by ``positions`` ``[t]`` (non-interleaved halves)."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = positions[:, None].float() * inv_freq[None]  # [t, d/2]
    cos = torch.cat([angle, angle], -1).cos()[:, None]
    sin = torch.cat([angle, angle], -1).sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def test_rope_positions_restart_per_sample(one_rank):
    """megatron's THD RoPE over our cu_seqlens == rotation by collate_pack's position ids."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rows = [
        collate_pack(Pack((0, 1), (0, 5), (5, 7)), [[1] * 5, [2] * 7], None, None, seq_length=16, pad_id=0),
        collate_pack(Pack((2,), (0,), (9,)), [[3] * 9], None, None, seq_length=16, pad_id=0),
    ]
    batch = {key: torch.stack([r[key] for r in rows]) for key in ("tokens", "position_ids", "segment_ids")}
    batch["cu_seqlens"] = packed_cu_seqlens(batch["segment_ids"])
    _, position_ids, _, params = thd_inputs(batch)
    assert position_ids[0, :12].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    d, base = 8, 10000.0
    freqs = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_base=base)(params.max_seqlen_q)
    x = torch.randn(32, 2, d, generator=torch.Generator().manual_seed(0))
    got = apply_rotary_pos_emb(x, freqs, _config(), cu_seqlens=params.cu_seqlens_q)
    torch.testing.assert_close(got, _manual_rope(x, position_ids[0], base), rtol=0, atol=1e-6)
    # Control: one segment over the whole row does not restart, and differs.
    whole = apply_rotary_pos_emb(x, RotaryEmbedding(d, 1.0, rotary_base=base)(32), _config(),
                                 cu_seqlens=torch.tensor([0, 32], dtype=torch.int32))
    assert (whole - got).abs().max() > 1e-2


# ------------------------------------------------------------ packing isolation


def _row_batch(samples: list[list[list[int]]], seq: int) -> dict[str, torch.Tensor]:
    """Collate rows of samples (token lists) into a micro-batch with cu_seqlens."""
    rows = []
    for members in samples:
        lengths = [len(m) for m in members]
        offsets = [sum(lengths[:i]) for i in range(len(members))]
        pack = Pack(tuple(range(len(members))), tuple(offsets), tuple(lengths))
        rows.append(collate_pack(pack, members, None, None, seq_length=seq, pad_id=0))
    batch = {key: torch.stack([r[key] for r in rows]) for key in ("tokens", "position_ids", "segment_ids")}
    batch["cu_seqlens"] = packed_cu_seqlens(batch["segment_ids"])
    return batch


def _thd_logits(model, batch, images=None) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` through the training forward's THD inputs."""
    tokens, position_ids, _, params = thd_inputs(batch)
    with torch.no_grad():
        if hasattr(model, "vision_model"):
            out = model(tokens, position_ids, params, images=images)
        else:
            out = model(tokens, position_ids, None, packed_seq_params=params)
    return out.float().reshape(*batch["tokens"].shape, -1)


def _build(config: str, *overrides: str, image_token: int = -1):
    from megascale_omni.models.standalone import build_model

    cfg = load_job_config(["--config", str(REPO / config), *overrides])
    model = build_model(cfg, cfg.model.padded_vocab_size(cfg.model.vocab_size), image_token)
    return model.eval(), cfg


@pytest.mark.parametrize("positions", ["learned_absolute", "rope"])
def test_gpt_packing_isolation(one_rank, positions):
    model, cfg = _build("examples/gpt/tiny.yaml", f"model.position_embedding_type={positions}")
    seq, vocab = cfg.model.seq_length, cfg.model.vocab_size
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(1, vocab, (n,), generator=g).tolist() for n in (11, 13, 20))
    packed = _thd_logits(model, _row_batch([[a, b], [c]], seq))  # rows [A | B | pad], [C | pad]
    alone_b = _thd_logits(model, _row_batch([[b]], seq))[0, : len(b)]
    alone_c = _thd_logits(model, _row_batch([[c]], seq))[0, : len(c)]
    err_b = (packed[0, len(a) : len(a) + len(b)] - alone_b).abs().max().item()
    err_c = (packed[1, : len(c)] - alone_c).abs().max().item()
    assert err_b < ISOLATION_ATOL and err_c < ISOLATION_ATOL, (err_b, err_c)
    # Control: one segment per row (B sees A) changes B's logits.
    leaky = dict(_row_batch([[a, b], [c]], seq), cu_seqlens=torch.tensor([0, seq, 2 * seq], dtype=torch.int32))
    assert (_thd_logits(model, leaky)[0, len(a) : len(a) + len(b)] - alone_b).abs().max() > 1e-3


def test_llava_packing_isolation_with_images(one_rank):
    image_token, vocab = 5, 64
    model, cfg = _build("examples/llava/tiny_cpu.yaml", f"model.vocab_size={vocab}", "model.seq_length=96",
                        image_token=image_token)
    p = cfg.vision.tokens_per_image
    g = torch.Generator().manual_seed(2)

    def sample(n_before: int, n_after: int) -> list[int]:
        words = torch.randint(6, vocab, (n_before + n_after,), generator=g).tolist()
        return words[:n_before] + [image_token] * p + words[n_before:]

    a, b = sample(3, 9), sample(5, 7)
    img_a, img_b = (torch.randn(1, 3, cfg.vision.image_size, cfg.vision.image_size, generator=g) for _ in range(2))
    seq = cfg.model.seq_length
    packed = _thd_logits(model, _row_batch([[a, b]], seq), torch.cat([img_a, img_b]))
    alone = _thd_logits(model, _row_batch([[b]], seq), img_b)[0, : len(b)]
    err = (packed[0, len(a) : len(a) + len(b)] - alone).abs().max().item()
    assert err < ISOLATION_ATOL, err
    # Control: B's logits depend on its own image, so the check above sees it.
    other = _thd_logits(model, _row_batch([[b]], seq), img_a)[0, : len(b)]
    assert (other - alone).abs().max() > 1e-3


def test_vision_tower_attends_both_ways_without_a_mask(one_rank):
    """The ViT (never packed) runs PackedCoreAttention with no_mask: the first
    token's features depend on the last patch."""
    model, cfg = _build("examples/llava/tiny_cpu.yaml", "model.vocab_size=64", "model.seq_length=96", image_token=5)
    size, patch = cfg.vision.image_size, cfg.vision.patch_size
    image = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(4))
    changed = image.clone()
    changed[..., size - patch :, size - patch :] += 1.0  # the last patch only
    with torch.no_grad():
        before, after = model.vision_model(image), model.vision_model(changed)  # [1, c + p, vh]
    # Causal attention would leave the first token exactly unchanged (0.0); the size of the change
    # depends on the random init, so any change well above fp32 rounding proves bidirectional attention.
    assert (after[:, 0] - before[:, 0]).abs().max() > 1e-5
