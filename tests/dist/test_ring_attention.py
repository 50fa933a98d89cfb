"""Ring attention (context parallelism) equals full attention.

Four gloo processes on loopback run every case at CP = 4 (all four) and
CP = 2 (two groups of two): forward outputs and the gradients of queries,
keys and values, fp32, against full attention on the whole sequence
computed in fp64 by plain softmax, asserted within 1e-5 (times the largest
reference value when that exceeds 1). Cases: causal and bidirectional;
one long segment; packed segments of lengths not divisible by 2·CP (padded
with :func:`pad_segments`, padding positions checked to be zero with zero
gradient); grouped-query attention; ``[s, b]`` rows through
:class:`PackedCoreAttention` (the DiT layout) and THD through it (the LM layout).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import traceback
from types import SimpleNamespace

import pytest
import torch

from tests.launcher import run_spawned_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TOL = 1e-5
WORLD = 4
#: (name, segment lengths, causal, query heads, key/value groups)
CASES = [
    ("causal-one-segment", [64], True, 4, 4),
    ("causal-packed-unaligned-gqa", [5, 13, 1, 9, 20], True, 4, 2),
    ("bidirectional-packed-unaligned", [7, 16, 3, 11], False, 2, 2),
    ("bidirectional-one-segment-gqa", [40], False, 4, 1),
]


def _reference(q, k, v, lengths, causal, scale):
    """Full attention per segment, fp64: ``[t, n, d]`` each -> ``[t, n, d]``."""
    outs, start = [], 0
    groups = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        scores = qs @ ks.transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def _thd_case(name, lengths, causal, heads, groups, cp, group, cp_rank):
    from megascale_omni.models.ring_attention import ring_attention
    from megascale_omni.parallel.context import cp_token_index, local_segments, pad_segments

    g = torch.Generator().manual_seed(len(name))
    t, d = sum(lengths), 8
    scale = 1 / math.sqrt(d)
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (heads, groups, groups))
    grad = torch.randn(t, heads, d, generator=g, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*ref_in, lengths, causal, scale)
    ref.backward(grad)

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    padded = pad_segments(cu, 2 * cp)
    index = cp_token_index(padded.cu_seqlens_padded, cp, cp_rank)

    def local(x):  # full [t, ...] -> this rank's padded-split [T, ...]
        full = x.new_zeros(padded.padded_length, *x.shape[1:])
        full[padded.position] = x
        return full[index]

    mine = [local(x).float().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v)]
    segments = local_segments(padded.cu_seqlens, padded.cu_seqlens_padded, cp)
    out = ring_attention(*mine, segments, causal=causal, scale=scale, group=group)
    out.backward(local(grad).float().transpose(0, 1).unsqueeze(0))
    is_real = local(torch.ones(t, dtype=torch.bool))
    errors = {}
    for label, got, want in [("out", out, ref.detach()), *[(f"d{n}", x.grad, r.grad) for n, x, r in zip("qkv", mine, ref_in)]]:
        got = got[0].transpose(0, 1)  # [T, n, d]
        errors[label] = _max_rel(got[is_real], local(want)[is_real])
        errors[f"{label}@padding"] = float(got[~is_real].abs().max()) if (~is_real).any() else 0.0
    return errors


def _module_cases(cp, group, cp_rank):
    """PackedCoreAttention with CP: THD (causal, LM) and [s, b] rows (bidirectional, DiT)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megascale_omni.models.attention import PackedCoreAttention, packed_seq_params
    from megascale_omni.parallel.context import cp_token_index

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, hidden_dropout=0.0, context_parallel_size=cp)
    pgs = SimpleNamespace(cp=group)
    d, scale = 8, 1 / math.sqrt(8)
    g = torch.Generator().manual_seed(5)
    errors = {}
    # THD: two segments, each a multiple of 2*cp (the LM's data pads samples).
    lengths = [8 * cp, 4 * cp]
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    ref = _reference(q, k, v, lengths, True, scale)
    cu = torch.tensor([0, lengths[0], t])
    index = cp_token_index(cu, cp, cp_rank)
    attn = PackedCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pgs)
    out = attn(*(x[index].float() for x in (q, k, v)), None, packed_seq_params=packed_seq_params(cu))
    errors["module-thd-causal"] = _max_rel(out.view(-1, 4, d), ref[index])
    # [s, b] rows: every row one segment, bidirectional.
    s, b = 6 * cp, 2
    q, k, v = (torch.randn(s, b, h, d, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    ref = torch.stack([_reference(q[:, i], k[:, i], v[:, i], [s], False, scale) for i in range(b)], 1)
    index = cp_token_index(torch.tensor([0, s]), cp, cp_rank)
    attn = PackedCoreAttention(config, 1, AttnMaskType.no_mask, "self", pg_collection=pgs)
    out = attn(*(x[index].float() for x in (q, k, v)), None)
    errors["module-sbhd-bidirectional"] = _max_rel(out.view(-1, b, 4, d), ref[index])
    return errors


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])]}
        results = {}
        for cp in (2, 4):
            group = groups[4] if cp == 4 else groups[2][rank // 2]
            cp_rank = rank % cp
            for name, lengths, causal, heads, kv_groups in CASES:
                results[f"cp{cp}/{name}"] = _thd_case(name, lengths, causal, heads, kv_groups, cp, group, cp_rank)
            results[f"cp{cp}/module"] = _module_cases(cp, group, cp_rank)
        dist.destroy_process_group()
    except Exception:  # reported to the test, which fails with it
        results = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    return run_spawned_ranks(_worker, WORLD, tmp_path_factory.mktemp("ring"), timeout=240)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_attention(ring_results, cp):
    for rank, results in enumerate(ring_results):
        for case, errors in results.items():
            if not case.startswith(f"cp{cp}/"):
                continue
            for label, err in errors.items():
                assert err <= TOL, f"rank {rank} {case} {label}: {err:.3g} > {TOL}"
