"""Model FLOPs, MFU, the analytic bubble and memory fields of the step record,
against numbers computed by hand here (2 FLOPs per multiply-add; backward =
input-gradient pass + weight-gradient pass for what trains)."""

from __future__ import annotations

import math

import pytest
import torch

from megascale_omni.config import JobConfig, apply_overrides, from_dict, load_yaml
from megascale_omni.metrics.breakdown import PHASES, analytic_bubble, memory_stats, timed
from megascale_omni.metrics.flops import device_peak_tflops, model_flops_per_step, throughput_fields
from megascale_omni.metrics.replica_group import ReplicaGroupMetrics, rank_row
from megascale_omni.metrics.schema import RANK_FIELDS
from megascale_omni.parallel.pipeline_cost import llava_cost_model, lm_cost_model
from megascale_omni.parallel.pipeline_cost_dit import dit_cost_model


def _cfg(path: str, *overrides: str) -> JobConfig:
    return from_dict(JobConfig, apply_overrides(load_yaml(path), list(overrides)))


def _layer_forward(tokens, seq, sequences, h, ffn, groups, heads, gated=False):
    head_dim = h // heads
    matmul = h * (h + 2 * groups * head_dim) + h * h + (3 if gated else 2) * h * ffn
    return 2 * tokens * matmul + 4 * sequences * seq * seq * h


def test_gpt_model_flops_by_hand():
    # examples/gpt/tiny.yaml: 4 layers, h 64, 4 heads, ffn 256, vocab 128, seq 32, mbs 2, gbs 8.
    cfg = _cfg("examples/gpt/tiny.yaml")
    tokens = 2 * 32
    layer = 3 * _layer_forward(tokens, 32, 2, 64, 256, 4, 4)  # forward + 2 backward passes
    embedding = 3 * tokens * 64
    output = 3 * 2 * tokens * 64 * 128 + 5 * tokens * 128
    per_microbatch = 4 * layer + embedding + output
    assert per_microbatch == 84_987_904
    assert model_flops_per_step(cfg, lm_cost_model, world_size=1) == 4 * per_microbatch  # 8 / 2 micro-batches
    # DP2 splits the same global batch; TP2 splits every micro-batch: the job's FLOPs do not change.
    assert model_flops_per_step(cfg, lm_cost_model, world_size=2) == 4 * per_microbatch
    tp2 = _cfg("examples/gpt/tiny.yaml", "parallel.tp=2")
    assert model_flops_per_step(tp2, lm_cost_model, world_size=2) == pytest.approx(4 * per_microbatch)
    # Recomputation is work, not model FLOPs.
    recompute = _cfg("examples/gpt/tiny.yaml", "model.recompute=true")
    assert model_flops_per_step(recompute, lm_cost_model, world_size=1) == 4 * per_microbatch
    # Context parallelism splits the same work over more ranks.
    cp2 = _cfg("examples/gpt/tiny.yaml", "parallel.cp=2")
    assert model_flops_per_step(cp2, lm_cost_model, world_size=2) == 4 * per_microbatch
    assert model_flops_per_step(cp2, lm_cost_model, world_size=4) == 4 * per_microbatch  # and DP2


def test_swiglu_layer_counts_three_matrices():
    cfg = _cfg("examples/gpt/tiny.yaml", "model.activation=swiglu", "model.ffn_hidden_size=96",
               "model.num_query_groups=2")
    tokens = 64
    layer = 3 * _layer_forward(tokens, 32, 2, 64, 96, 2, 4, gated=True)
    per_microbatch = 4 * layer + 3 * tokens * 64 + 3 * 2 * tokens * 64 * 128 + 5 * tokens * 128
    assert model_flops_per_step(cfg, lm_cost_model, world_size=1) == 4 * per_microbatch


def test_llava_stage1_model_flops_by_hand():
    # Stage 1: LM and ViT frozen, projector trains. examples/llava/tiny_cpu.yaml:
    # LM 4 layers, h 128, 4 heads, ffn 512, seq 256, mbs 2, gbs 8; ViT 2 layers, h 64,
    # 4 heads, ffn 256, 16 patches of 8x8 per image, 9.8 images per row; projector 64 -> 128 -> 128.
    cfg = _cfg("examples/llava/tiny_cpu.yaml", "model.freeze=true", "vision.freeze=true")
    vocab = 128  # vocab_size 0 (tokenizer's) counts as one multiple of 128 before start-up
    tokens = 2 * 256
    images = 2 * 9.8
    vtokens = images * 16
    vit = 2 * _layer_forward(vtokens, 16, images, 64, 256, 4, 4) + 2 * vtokens * 3 * 64 * 64  # forward only
    projector = (1 + 0 + 1) * 2 * vtokens * (64 * 128 + 128 * 128)  # forward + weight grad; ViT frozen: no input grad
    lm_layer = 2 * _layer_forward(tokens, 256, 2, 128, 512, 4, 4)  # forward + input grad (projector trains)
    output = 2 * 2 * tokens * 128 * vocab + 5 * tokens * vocab
    per_microbatch = vit + projector + 3 * tokens * 128 + 4 * lm_layer + output
    assert model_flops_per_step(cfg, llava_cost_model, world_size=1) == pytest.approx(4 * per_microbatch, rel=1e-12)
    # Under CP every CP rank runs the ViT on all images: redundant work, not model FLOPs.
    cp2 = _cfg("examples/llava/tiny_cpu.yaml", "model.freeze=true", "vision.freeze=true", "parallel.cp=2")
    assert model_flops_per_step(cp2, llava_cost_model, world_size=2) == pytest.approx(4 * per_microbatch, rel=1e-12)


def test_mfu_and_throughput_fields():
    fields = throughput_fields(4e12, step_s=2.0, devices=4, peak_tflops=100.0)
    assert fields == pytest.approx({"model_tflop": 4.0, "tflops_per_device": 0.5, "mfu": 0.005})
    assert "mfu" not in throughput_fields(4e12, 2.0, 4, None)
    assert throughput_fields(None, 2.0, 4, 100.0) == {}
    assert device_peak_tflops(0.0, "NVIDIA H200") == 989.0
    assert device_peak_tflops(0.0, "NVIDIA A100-SXM4-80GB") == 312.0
    assert device_peak_tflops(50.0, "NVIDIA H100") == 50.0
    assert device_peak_tflops(0.0, None) is None


@pytest.mark.parametrize("pp,vpp,m,expected", [(1, 1, 8, 0.0), (2, 1, 4, 1 / 5), (4, 1, 8, 3 / 11), (4, 2, 8, 3 / 19)])
def test_analytic_bubble(pp, vpp, m, expected):
    assert analytic_bubble(pp, vpp, m) == pytest.approx(expected)


def test_phase_clock_counts_nested_phases_once():
    PHASES.reset()
    inner = timed("grad_sync", lambda: sum(range(1000)))
    with PHASES.phase("cross_replica"):
        inner()
    totals = PHASES.read()
    assert totals["cross_replica"] > 0 and totals["grad_sync"] == 0.0


def test_memory_fields_on_cpu():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"rss_gib"} and 0.01 < stats["rss_gib"] < 64


def test_dit_model_flops_by_hand():
    # examples/dit/tiny_cpu.yaml: 4 blocks, h 128, 4 heads, ffn 512, patch 4, 3 channels; the
    # largest bucket is 24x24 = 36 tokens per image, token budget 144 -> 4 images per package,
    # 4 caption tokens each (learned embedding, width h); 8 packages per step. Every weight trains.
    cfg = _cfg("examples/dit/tiny_cpu.yaml")
    h, ffn, n, images, text, patch_dim = 128, 512, 36, 4, 4, 3 * 4 * 4
    tokens, text_tokens = images * n, images * text

    def linear(rows, n_in, n_out, passes=3):  # forward + input grad + weight grad
        return passes * 2 * rows * n_in * n_out

    # Head: noisy patches and timestep features need no input gradient (2 passes).
    patch = linear(tokens, patch_dim, h, passes=2) + tokens * h  # + positions
    caption = 2 * text_tokens * h + linear(text_tokens, h, h)  # embedding gather + grad, projection
    timestep = linear(images, 128, ffn, passes=2) + linear(images, ffn, h)  # 128 sinusoidal features
    pooled = linear(images, h, ffn) + linear(images, ffn, h) + 2 * text_tokens * h  # + masked caption mean
    # Block: self-attention over each image's 36 tokens, cross-attention to its 4 caption tokens,
    # MLP, adaLN modulation (9 vectors per image).
    self_attn = linear(tokens, h, 3 * h) + linear(tokens, h, h) + 3 * 4 * images * n * n * h
    cross_attn = (linear(tokens, h, h) + linear(text_tokens, h, 2 * h) + linear(tokens, h, h)
                  + 3 * 4 * tokens * text * h)
    mlp = linear(tokens, h, ffn) + linear(tokens, ffn, h)
    block = self_attn + cross_attn + mlp + linear(images, h, 9 * h)
    # Tail: final adaLN (shift, scale), the output linear, the squared error (3 ops per value each way).
    tail = linear(images, h, 2 * h) + linear(tokens, h, patch_dim) + 6 * tokens * patch_dim
    per_package = patch + caption + timestep + pooled + 4 * block + tail
    assert model_flops_per_step(cfg, dit_cost_model, world_size=1) == pytest.approx(8 * per_package, rel=1e-12)
    assert model_flops_per_step(cfg, dit_cost_model, world_size=2) == pytest.approx(8 * per_package, rel=1e-12)


def _rows(busy: list[float], data: float = 0.01) -> list[list[float]]:
    """Rank rows (RANK_FIELDS order) with ``busy`` split as data + compute."""
    return [[b, data, b - data, 0.0, 0.0, math.nan, 1.0 + r] for r, b in enumerate(busy)]


def test_replica_group_aggregates_and_flags_after_patience():
    assert RANK_FIELDS == ("busy_s", "data_s", "compute_s", "pipeline_wait_s", "grad_sync_s", "mem_peak_gib",
                           "rss_gib")
    group = ReplicaGroupMetrics(factor=2.0, patience=3, min_excess_s=0.01, announce=False)
    assert group.observe(0, None) == {} and group.describe() is None
    normal = group.observe(1, _rows([0.10, 0.11, 0.12, 0.10]))
    assert normal == {"group_step": 1, "busy_s_median": pytest.approx(0.105), "busy_s_max": 0.12, "slowest_rank": 2,
                      "data_s_max": 0.01, "compute_s_max": pytest.approx(0.11), "pipeline_wait_s_max": 0.0,
                      "grad_sync_s_max": 0.0, "rss_gib_max": 4.0, "stragglers": [], "straggler_count": 0}
    # Rank 3 is 3x the others' median: flagged on its third slow step, not before.
    for step in (2, 3):
        assert group.observe(step, _rows([0.10, 0.10, 0.10, 0.30]))["stragglers"] == []
    flagged = group.observe(4, _rows([0.10, 0.10, 0.10, 0.30]))
    assert flagged["stragglers"] == [3] and flagged["straggler_count"] == 1 and flagged["slowest_rank"] == 3
    assert group.observe(5, None) == flagged  # nothing new: the last evaluation again
    assert group.describe() == flagged
    # One normal step unflags it.
    assert group.observe(6, _rows([0.10, 0.10, 0.10, 0.11]))["stragglers"] == []


def test_replica_group_ignores_tiny_absolute_differences():
    # 10x slower, but by 0.9 ms: below min_excess_s, never a straggler.
    group = ReplicaGroupMetrics(factor=2.0, patience=1, min_excess_s=0.001, announce=False)
    assert group.observe(1, _rows([0.0001, 0.0001, 0.001], data=0.0))["stragglers"] == []
    assert group.observe(2, _rows([0.0001, 0.0001, 0.0012], data=0.0))["stragglers"] == [2]


def test_rank_row_of_a_record():
    record = {"data_s": 0.25, "compute_s": 0.5, "pipeline_wait_s": 0.125, "grad_sync_s": 0.0, "rss_gib": 2.0}
    row = rank_row(record)
    assert row[:5] == [0.75, 0.25, 0.5, 0.125, 0.0] and math.isnan(row[5]) and row[6] == 2.0
