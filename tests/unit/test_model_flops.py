"""The one model-FLOP count (metrics/flops.py) against counts by hand here, and the device peak table.

Hand counts: 2 FLOPs per multiply-add; attention 4*h FLOPs per query-key
pair forward, causal per packed sample (s*(s+1)/2 pairs) in the language
model, the full square per image in the ViT and the DiT; backward = one
input-gradient pass where a gradient flows + one weight-gradient pass for
what trains.
"""

from __future__ import annotations

import logging

import pytest

from megascale_omni.config import JobConfig, apply_overrides, from_dict, load_yaml
from megascale_omni.metrics.flops import (
    DEVICE_PEAK_TFLOPS,
    StepFlops,
    device_peak,
    step_model_flops,
    throughput_fields,
)
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.parallel.pipeline_cost import llava_cost_model, lm_cost_model
from megascale_omni.parallel.pipeline_cost_dit import dit_cost_model


def _cfg(path: str, *overrides: str) -> JobConfig:
    return from_dict(JobConfig, apply_overrides(load_yaml(path), list(overrides)))


def _layer_forward(tokens, pairs, h, ffn, heads, groups, gated=False):
    """One transformer layer's forward: QKV, projection and MLP matmuls + scores and values over ``pairs``."""
    head_dim = h // heads
    matmul = h * (h + 2 * groups * head_dim) + h * h + (3 if gated else 2) * h * ffn
    return 2 * tokens * matmul + 4 * pairs * h


#: Packed samples of a global batch: 5 samples in rows of up to 32 tokens.
GPT_SEGMENTS = (20, 12, 32, 7, 25)


def test_wider_heads_than_hidden_over_heads_by_hand():
    """``model.kv_channels`` (Qwen3-MoE's ``head_dim``): Q is heads x kv_channels
    wide, so are the output projection's input and the attention core."""
    cfg = _cfg("examples/gpt/tiny.yaml", "model.kv_channels=32")  # 4 heads x 32 = 128 at hidden 64
    tokens = sum(GPT_SEGMENTS)
    pairs = sum(s * (s + 1) / 2 for s in GPT_SEGMENTS)
    matmul = 64 * (128 + 2 * 4 * 32) + 128 * 64 + 2 * 64 * 256
    layer = 3 * (2 * tokens * matmul + 4 * pairs * 128)
    expected = 4 * layer + 3 * tokens * 64 + 3 * 2 * tokens * 64 * 128 + 5 * tokens * 128
    assert step_model_flops(cfg, lm_cost_model, BatchShape(segments=GPT_SEGMENTS)) == expected


def test_packed_gpt_by_hand():
    # examples/gpt/tiny.yaml: 4 layers, h 64, 4 heads, ffn 256, vocab 128.
    cfg = _cfg("examples/gpt/tiny.yaml")
    tokens = 20 + 12 + 32 + 7 + 25
    pairs = 20 * 21 / 2 + 12 * 13 / 2 + 32 * 33 / 2 + 7 * 8 / 2 + 25 * 26 / 2  # causal within each sample only
    layer = 3 * _layer_forward(tokens, pairs, 64, 256, 4, 4)  # forward + 2 backward passes
    embedding = 3 * tokens * 64
    output = 3 * 2 * tokens * 64 * 128 + 5 * tokens * 128
    expected = 4 * layer + embedding + output
    assert expected == 121_635_840
    batch = BatchShape(segments=GPT_SEGMENTS)
    assert step_model_flops(cfg, lm_cost_model, batch) == expected
    # The count is the model's: the same under any layout, and recomputation is work, not model FLOPs.
    for overrides in (["parallel.tp=2"], ["parallel.pp=2"], ["parallel.cp=2"], ["model.recompute=true"]):
        assert step_model_flops(_cfg("examples/gpt/tiny.yaml", *overrides), lm_cost_model, batch) == expected
    # Not the full square of the rows: one 96-token sample attends to far more pairs than five short ones.
    assert step_model_flops(cfg, lm_cost_model, BatchShape(segments=(96,))) == expected + 4 * 3 * 4 * 64 * (
        96 * 97 / 2 - pairs)


def test_full_rows_of_the_gpt_smoke_task_by_hand():
    # The GPT smoke task: 8 rows of one 32-token sample each (the step record's count, tests/dist/test_step_breakdown.py).
    cfg = _cfg("examples/gpt/tiny.yaml")
    tokens = 8 * 32
    layer = 3 * _layer_forward(tokens, 8 * 32 * 33 / 2, 64, 256, 4, 4)
    expected = 4 * layer + 3 * tokens * 64 + 3 * 2 * tokens * 64 * 128 + 5 * tokens * 128
    assert expected == 327_761_920
    assert step_model_flops(cfg, lm_cost_model, BatchShape(segments=(32,) * 8)) == expected


def test_the_record_s_counter_follows_each_batch():
    # The Trainer's StepFlops keeps the last batch's count (GPT's full rows repeat); a new batch is recounted.
    cfg = _cfg("examples/gpt/tiny.yaml")
    count = StepFlops(cfg, lm_cost_model)
    rows, packed = BatchShape(segments=(32,) * 8), BatchShape(segments=GPT_SEGMENTS)
    assert [count(rows), count(rows), count(packed), count(rows)] == [327_761_920, 327_761_920, 121_635_840,
                                                                      327_761_920]


def test_swiglu_layer_counts_three_matrices():
    cfg = _cfg("examples/gpt/tiny.yaml", "model.activation=swiglu", "model.ffn_hidden_size=96",
               "model.num_query_groups=2")
    tokens, pairs = 96, 20 * 21 / 2 + 12 * 13 / 2 + 32 * 33 / 2 + 7 * 8 / 2 + 25 * 26 / 2
    layer = 3 * _layer_forward(tokens, pairs, 64, 96, 4, 2, gated=True)
    expected = 4 * layer + 3 * tokens * 64 + 3 * 2 * tokens * 64 * 128 + 5 * tokens * 128
    assert step_model_flops(cfg, lm_cost_model, BatchShape(segments=GPT_SEGMENTS)) == expected


#: A LLaVA global batch: three packed samples (image placeholders included), three images.
LLAVA = BatchShape(segments=(100, 60, 90), tower_inputs=3)


def _llava_by_hand(vit_passes, patch_passes, projector_passes, lm_passes, projector=64 * 128 + 128 * 128, vocab=128):
    # examples/llava/tiny_cpu.yaml: LM 4 layers, h 128, 4 heads, ffn 512; ViT 2 layers, h 64, 4 heads,
    # ffn 256, 32 px images in 8 px patches = 16 tokens each; projector 64 -> 128 -> 128; vocab 0 counts
    # as one multiple of 128.
    vtokens = 3 * 16
    vit = 2 * vit_passes * _layer_forward(vtokens, 3 * 16 * 16, 64, 256, 4, 4)  # bidirectional: 16^2 pairs per image
    patch = patch_passes * 2 * vtokens * (3 * 8 * 8) * 64
    projector = projector_passes * 2 * vtokens * projector  # its matmul weights
    tokens = 100 + 60 + 90
    pairs = 100 * 101 / 2 + 60 * 61 / 2 + 90 * 91 / 2
    lm = 4 * lm_passes * _layer_forward(tokens, pairs, 128, 512, 4, 4)
    output = lm_passes * 2 * tokens * 128 * vocab + 5 * tokens * vocab
    return vit + patch + projector + lm + 3 * tokens * 128 + output


def test_packed_llava_by_hand():
    cfg = _cfg("examples/llava/tiny_cpu.yaml")
    # Everything trains: 3 passes; the images enter without gradient, so the patch embedding has 2.
    expected = _llava_by_hand(vit_passes=3, patch_passes=2, projector_passes=3, lm_passes=3)
    assert expected == 1_310_838_784
    assert step_model_flops(cfg, llava_cost_model, LLAVA) == expected
    # CP ranks each run the ViT on every image: repeated work, not model FLOPs.
    assert step_model_flops(_cfg("examples/llava/tiny_cpu.yaml", "parallel.cp=2"), llava_cost_model, LLAVA) == expected
    # With the tokenizer's 1000 words (model.vocab_size: 0) the output layer has 1024 rows (multiples of 128).
    assert step_model_flops(cfg, llava_cost_model, LLAVA, vocab_size=1000) == _llava_by_hand(3, 2, 3, 3, vocab=1024)
    # A linear projector is one 64 -> 128 matrix.
    linear = _cfg("examples/llava/tiny_cpu.yaml", "vision.projector_type=linear")
    assert step_model_flops(linear, llava_cost_model, LLAVA) == _llava_by_hand(3, 2, 3, 3, projector=64 * 128)


def test_llava_flops_use_the_floor_grid():
    # 35 px in 8 px patches: HF's conv reads a 4 x 4 grid (32 px) and ignores 3 pixel rows/columns, so
    # the count equals the 32 px one exactly (16 tokens per image, the same patch matmuls).
    cfg = _cfg("examples/llava/tiny_cpu.yaml", "vision.image_size=35")
    assert cfg.vision.tokens_per_image == 16
    assert step_model_flops(cfg, llava_cost_model, LLAVA) == _llava_by_hand(3, 2, 3, 3)


def test_llava_stage1_by_hand():
    # Stage 1: LM and ViT frozen, the projector trains: the ViT runs forward only, the projector adds
    # its weight gradient, the LM passes the input gradient back to it.
    cfg = _cfg("examples/llava/tiny_cpu.yaml", "model.freeze=true", "vision.freeze=true")
    expected = _llava_by_hand(vit_passes=1, patch_passes=1, projector_passes=2, lm_passes=2)
    assert step_model_flops(cfg, llava_cost_model, LLAVA) == pytest.approx(expected, rel=1e-12)


def _dit_package_by_hand(n: int, images: int) -> float:
    """examples/dit/tiny_cpu.yaml: 4 blocks, h 128, 4 heads, ffn 512, 4x4 patches of 3 channels, 4 caption
    tokens per image (learned embedding of width h); every weight trains."""
    h, ffn, text, patch_dim = 128, 512, 4, 3 * 4 * 4
    tokens, text_tokens = images * n, images * text

    def linear(rows, n_in, n_out, passes=3):  # forward + input grad + weight grad
        return passes * 2 * rows * n_in * n_out

    # Head: noisy patches and timestep features need no input gradient (2 passes).
    patch = linear(tokens, patch_dim, h, passes=2) + tokens * h  # + positions
    caption = 2 * text_tokens * h + linear(text_tokens, h, h)  # embedding gather + grad, projection
    timestep = linear(images, 128, ffn, passes=2) + linear(images, ffn, h)  # 128 sinusoidal features
    pooled = linear(images, h, ffn) + linear(images, ffn, h) + 2 * text_tokens * h  # + masked caption mean
    # Block: bidirectional self-attention over each image's n tokens (n^2 pairs), cross-attention to
    # its caption, MLP, adaLN modulation (9 vectors per image).
    self_attn = linear(tokens, h, 3 * h) + linear(tokens, h, h) + 3 * 4 * images * n * n * h
    cross_attn = (linear(tokens, h, h) + linear(text_tokens, h, 2 * h) + linear(tokens, h, h)
                  + 3 * 4 * tokens * text * h)
    mlp = linear(tokens, h, ffn) + linear(tokens, ffn, h)
    block = self_attn + cross_attn + mlp + linear(images, h, 9 * h)
    # Tail: final adaLN (shift, scale), the output linear, the squared error (3 ops per value each way).
    tail = linear(images, h, 2 * h) + linear(tokens, h, patch_dim) + 6 * tokens * patch_dim
    return patch + caption + timestep + pooled + 4 * block + tail


def test_dit_packages_by_hand():
    # Three packages: 4 images of 24x24 (36 tokens each), 8 of 16x16 (16 tokens; the task leaves the
    # package's ninth, padding slot out), 2 of 24x24.
    cfg = _cfg("examples/dit/tiny_cpu.yaml")
    batch = BatchShape(dit_packages=((36, 4), (16, 8), (36, 2)))
    expected = _dit_package_by_hand(36, 4) + _dit_package_by_hand(16, 8) + _dit_package_by_hand(36, 2)
    assert step_model_flops(cfg, dit_cost_model, batch) == pytest.approx(expected, rel=1e-12)
    assert step_model_flops(_cfg("examples/dit/tiny_cpu.yaml", "parallel.cp=2"), dit_cost_model,
                            batch) == pytest.approx(expected, rel=1e-12)
    assert step_model_flops(cfg, dit_cost_model, BatchShape()) == 0.0


def test_mfu_and_throughput_fields():
    fields = throughput_fields(4e12, step_s=2.0, devices=4, peak_tflops=100.0)
    assert fields == pytest.approx({"model_tflop": 4.0, "tflops_per_device": 0.5, "mfu": 0.005})
    assert "mfu" not in throughput_fields(4e12, 2.0, 4, None)
    assert throughput_fields(None, 2.0, 4, 100.0) == {}


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0),  # SXM5
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0),  # not the SXM part's 989: names match exactly
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA B200", 2250.0),
])
def test_peak_table_matches_device_names_exactly(name, tflops, caplog):
    with caplog.at_level(logging.WARNING, logger="megascale_omni.metrics.flops"):
        peak = device_peak(0.0, name)
    assert (peak.tflops, peak.source) == (tflops, "table") and DEVICE_PEAK_TFLOPS[name] == tflops
    assert not caplog.records


def test_peak_of_an_unlisted_name_is_a_logged_guess_or_unknown(caplog):
    with caplog.at_level(logging.WARNING, logger="megascale_omni.metrics.flops"):
        peak = device_peak(0.0, "NVIDIA H100 SXM5 94GB")
    assert (peak.tflops, peak.source) == (989.0, "guessed")
    assert "guessed from its family H100" in caplog.text
    # A family name inside another word does not match (no "H100" in "GH1000").
    assert device_peak(0.0, "NVIDIA GH1000") == device_peak(0.0, "Tesla T4") == device_peak(0.0, None)
    assert device_peak(0.0, None).tflops is None and device_peak(0.0, None).source == "unknown"
    assert device_peak(50.0, "NVIDIA H100 80GB HBM3").tflops == 50.0  # logging.peak_tflops wins
    assert device_peak(50.0, None).source == "logging.peak_tflops"
