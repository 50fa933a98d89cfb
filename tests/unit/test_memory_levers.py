"""The memory levers' arithmetic: Korthikanti et al.'s activation formula by
hand, ``model.recompute`` parsing, and the per-GPU memory estimate
(weights + gradients + optimizer state + activations) a recipe checks."""

from __future__ import annotations

import pytest

from megascale_omni.config import ConfigError, load_job_config
from megascale_omni.parallel.activations import LayerShape, layer_activation_bytes
from megascale_omni.parallel.memory import estimate_memory_per_gpu
from megascale_omni.parallel.pipeline_cost import LM_LAYER, llava_cost_model, lm_cost_model
from megascale_omni.parallel.pipeline_plan import plan_for
from megascale_omni.tasks.registry import estimate_memory_per_gpu as estimate_for_family

# The paper's GPT layer: MHA, ffn = 4h, dropout on, 16-bit activations.
S, B, H, A = 2048, 1, 1024, 16
PAPER = LayerShape(hidden=H, ffn=4 * H, heads=A, kv_hidden=H, hidden_dropout=True, attention_dropout=True)
SBH = S * B * H


def paper(t: int, sp: bool, recompute: str) -> float:
    return layer_activation_bytes(PAPER, S * B, B * S * S, 2, t, sp, recompute)


@pytest.mark.parametrize("t, sp, recompute, expected", [
    # Korthikanti et al. 2022, eqs. 1-4 and the full-recompute line of table 2.
    (1, False, "none", SBH * (34 + 5 * A * S / H)),
    (8, False, "none", SBH * (10 + 24 / 8 + 5 * A * S / (H * 8))),
    (8, True, "none", SBH * (34 / 8 + 5 * A * S / (H * 8))),
    (8, True, "selective", SBH * 34 / 8),
    (8, False, "selective", SBH * (10 + 24 / 8)),
    (8, False, "full", 2 * SBH),
    (8, True, "full", 2 * SBH / 8),
])
def test_activation_bytes_are_korthikantis_formula(t, sp, recompute, expected):
    assert paper(t, sp, recompute) == pytest.approx(expected, rel=1e-12)


def test_activation_formula_generalises_dropout_gqa_swiglu_and_fp32():
    # No dropout: no 1-byte masks (2 per token), no dropped scores (1 + 2 per score).
    plain = LayerShape(hidden=H, ffn=4 * H, heads=A, kv_hidden=H)
    assert layer_activation_bytes(plain, S, S * S, 2, 1, False, "none") == SBH * (32 + 2 * A * S / H)
    # GQA with 4 groups: K and V are h/4 wide; SwiGLU: fc1 outputs gate and up.
    llama = LayerShape(hidden=H, ffn=2816, heads=A, kv_hidden=H // 4, gated=True)
    per_token = 2 * (4 * H + 2 * H + 2 * (H // 4) + 3 * 2816)
    assert layer_activation_bytes(llama, S, 0, 2, 1, False, "selective") == S * per_token
    # fp32 doubles every element and the masks stay 1 byte.
    assert paper(1, False, "full") * 2 == layer_activation_bytes(PAPER, S, S * S, 4, 1, False, "full")
    with pytest.raises(ValueError, match="unknown recompute 'some'"):
        paper(1, False, "some")
    # TE's fused attention keeps fp32 softmax statistics per query and head, not the scores.
    fused = LayerShape(hidden=H, ffn=4 * H, heads=A, kv_hidden=H, fused_attention=True)
    assert layer_activation_bytes(fused, S, S * S, 2, 8, True, "none") == SBH * 32 / 8 + S * A * 4 / 8


def test_cost_model_assumes_fused_attention_only_for_te_on_cuda():
    """``cuda=True`` means bf16 and (layer_impl auto) TE's fused attention: the LM layer keeps
    no score matrix; the local spec on a GPU still does."""
    cfg = config("train.precision=bf16")
    m, b, s = cfg.model, cfg.train.micro_batch_size, cfg.model.seq_length
    gpu, local = lm_cost_model(cfg, True), lm_cost_model(config("train.precision=bf16", "model.layer_impl=local"), True)
    scores, stats = b * s * s * m.num_attention_heads * 2, b * s * m.num_attention_heads * 4
    assert local.activation_bytes(LM_LAYER) - gpu.activation_bytes(LM_LAYER) == pytest.approx(scores - stats)


def config(*overrides: str, path: str = "examples/gpt/tiny.yaml"):
    return load_job_config(["--config", path, *overrides])


@pytest.mark.parametrize("value, parsed", [("true", "full"), ("false", "none"), ("selective", "selective"),
                                           ("full", "full"), ("none", "none")])
def test_recompute_accepts_the_old_booleans(value, parsed):
    assert config(f"model.recompute={value}").model.recompute == parsed


def test_recompute_rejects_other_values_in_one_line():
    with pytest.raises(ConfigError) as err:
        config("model.recompute=attention")
    assert err.value.field == "model.recompute" and "'selective'" in str(err.value)
    assert "\n" not in str(err.value)


def test_cost_model_recompute_levels_and_sequence_parallel():
    """The LM layer of the cost model: selective drops exactly the attention
    core's bytes and adds its forward FLOPs; SP divides what TP replicated."""
    base = llava_cost_model(config(path="examples/llava/pp4_vit_heavy.yaml"))
    sel = llava_cost_model(config("model.recompute=selective", path="examples/llava/pp4_vit_heavy.yaml"))
    cfg = config(path="examples/llava/pp4_vit_heavy.yaml")
    m, b, s = cfg.model, cfg.train.micro_batch_size, cfg.model.seq_length
    core_bytes = b * s * s * m.num_attention_heads * 4 / cfg.parallel.tp  # fp32 softmax output
    assert base.activation_bytes(LM_LAYER) - sel.activation_bytes(LM_LAYER) == pytest.approx(core_bytes)
    core_flops = 4.0 * b * s * s * m.hidden_size / cfg.parallel.tp
    assert sel.time(LM_LAYER) - base.time(LM_LAYER) == pytest.approx(core_flops)
    tp2 = lm_cost_model(config("parallel.tp=2"))
    sp = lm_cost_model(config("parallel.tp=2", "parallel.sequence_parallel=true"))
    g = config()
    replicated = g.train.micro_batch_size * g.model.seq_length * 4 * g.model.hidden_size * 4  # 4 fp32 tensors of h
    assert tp2.activation_bytes(LM_LAYER) - sp.activation_bytes(LM_LAYER) == pytest.approx(replicated / 2)


def test_estimate_by_hand_bf16_distributed_optimizer():
    """GPT tiny, bf16, TP2 x DP4 with the distributed optimizer: weights 2,
    fp32 grads 4 and 12/4 bytes of optimizer state per parameter."""
    cfg = config("parallel.tp=2", "parallel.use_distributed_optimizer=true", "train.precision=bf16",
                 "train.global_batch_size=16")
    (stage,) = estimate_memory_per_gpu(cfg, lm_cost_model, world_size=8)
    model = lm_cost_model(cfg, True, 8)
    params = sum(c.params for c in model.components.values()) + (cfg.model.num_layers - 1) * model.components[
        LM_LAYER].params
    assert stage.layers == cfg.model.num_layers
    assert (stage.weights, stage.gradients, stage.optimizer) == (2 * params, 4 * params, 3 * params)
    acts = sum(c.activation_bytes for c in model.components.values()) + (cfg.model.num_layers - 1) * \
        model.activation_bytes(LM_LAYER)
    assert stage.activations == pytest.approx(acts)
    # Without the distributed optimizer every DP rank holds all 12 bytes.
    (whole,) = estimate_memory_per_gpu(config("parallel.tp=2", "train.precision=bf16",
                                              "train.global_batch_size=16"), lm_cost_model, world_size=8)
    assert whole.optimizer == 12 * params


@pytest.mark.parametrize("overrides", [(), ("parallel.pipeline_partition=uniform", "parallel.vpp=2"),
                                       ("model.recompute=selective", "parallel.pipeline_memory_gib=0.01")])
def test_estimate_is_the_planners_per_rank_memory(overrides):
    """Per pp rank the parts add up to the planner's ``rank_memory`` (the
    same model); a too-small capacity does not stop the estimate."""
    cfg = config(*overrides, path="examples/llava/pp4_vit_heavy.yaml")
    stages = estimate_for_family(cfg, cuda=False, world_size=8)
    free = load_job_config(["--config", "examples/llava/pp4_vit_heavy.yaml",
                            *(o for o in overrides if "memory" not in o)])
    plan = plan_for(free, "uniform" if "uniform" in str(overrides) else "auto", llava_cost_model, world_size=8)
    assert [s.layers for s in stages] == [sum(plan.rank_layers(r)) for r in range(plan.pp)]
    assert [s.total for s in stages] == pytest.approx(list(plan.rank_memory), rel=1e-12)
