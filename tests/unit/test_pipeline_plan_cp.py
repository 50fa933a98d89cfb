"""The pipeline cost model and planner under context parallelism: each CP
rank holds ``seq_length / cp`` tokens, so the language model's FLOPs and
activations per rank are 1/cp of CP1's; its weights, and LLaVA's ViT and
projector (all images on every CP rank), are unchanged."""

from __future__ import annotations

import json
import runpy
import sys

import pytest

from megascale_omni.config import load_job_config, validate_job
from megascale_omni.parallel.pipeline_cost import (
    EMBEDDING,
    LM_LAYER,
    OUTPUT,
    PROFILE_VERSION,
    PROJECTOR,
    VISION,
    llava_cost_model,
    lm_cost_model,
)
from megascale_omni.parallel.pipeline_plan import microbatches_in_flight, plan_for
from megascale_omni.parallel.pipeline_plan import plan_pipeline as plan_with

LLAVA = "examples/llava/pp4_vit_heavy.yaml"
GPT = "examples/gpt/tiny.yaml"
LM_PARTS = (EMBEDDING, LM_LAYER, OUTPUT)


def config(*overrides: str, path: str = LLAVA, world_size: int | None = None):
    cfg = load_job_config(["--config", path, *overrides])
    validate_job(cfg, world_size or cfg.parallel.model_parallel_size)
    return cfg


@pytest.mark.parametrize("path, cost_model", [(GPT, lm_cost_model), (LLAVA, llava_cost_model)])
@pytest.mark.parametrize("extra", [(), ("model.recompute=true",)])
def test_lm_flops_and_activations_per_cp_rank_are_one_over_cp(path, cost_model, extra):
    one = cost_model(config(*extra, path=path))
    for cp in (2, 4):
        split = cost_model(config(f"parallel.cp={cp}", *extra, path=path))
        for name in LM_PARTS:
            a, b = one.components[name], split.components[name]
            assert b.flops == pytest.approx(a.flops / cp, rel=1e-12), name
            assert b.activation_bytes == pytest.approx(a.activation_bytes / cp, rel=1e-12), name
            assert (b.params, b.trainable_params) == (a.params, a.trainable_params), name  # whole weights
        for name in (VISION, PROJECTOR):  # LLaVA: every CP rank runs the ViT on all images
            if name in one.components:
                assert split.components[name] == one.components[name], name


def test_stage_memory_at_cp2_halves_the_lm_activations_and_keeps_the_vit():
    cp1, cp2 = config("parallel.pipeline_partition=uniform"), config("parallel.pipeline_partition=uniform",
                                                                     "parallel.cp=2")
    model = llava_cost_model(cp1)
    plan1, plan2 = plan_for(cp1, "uniform", llava_cost_model), plan_for(cp2, "uniform", llava_cost_model)
    pp, per_rank = cp1.parallel.pp, cp1.model.num_layers // cp1.parallel.pp
    for r in range(pp):
        parts = [*(model.head if r == 0 else ()), *(model.tail if r == pp - 1 else ())]
        static = sum(model.static_bytes(n) for n in parts) + per_rank * model.static_bytes(LM_LAYER)
        inflight = microbatches_in_flight(r, pp, 1, model.num_microbatches)
        vit = inflight * sum(model.activation_bytes(n) for n in parts if n in (VISION, PROJECTOR))
        act1, act2 = plan1.rank_memory[r] - static, plan2.rank_memory[r] - static
        # The LM's activations halve, the ViT's and projector's (rank 0 only) stay.
        assert act2 == pytest.approx((act1 - vit) / 2 + vit, rel=1e-9), r
        assert (vit > 0) == (r == 0) and act1 > 2 * vit


def test_auto_gives_the_vit_stage_fewer_layers_under_cp():
    """The LM's time per rank halves at cp=2 and the ViT's does not, so
    stage 0's head weighs more layers and auto moves layers off it."""
    cp1, cp2 = llava_cost_model(config()), llava_cost_model(config("parallel.cp=2"))
    vit = cp1.time(VISION) + cp1.time(PROJECTOR)
    assert cp2.time(VISION) + cp2.time(PROJECTOR) == vit
    assert cp2.head_time == pytest.approx(vit + cp1.time(EMBEDDING) / 2)
    assert cp2.head_time / cp2.layer_time > 1.9 * cp1.head_time / cp1.layer_time
    auto1, auto2 = plan_with(config(), llava_cost_model), plan_with(config("parallel.cp=2"), llava_cost_model)
    assert auto1.counts == (2, 5, 5, 4) and auto2.counts == (1, 5, 5, 5)


def test_distributed_optimizer_shards_over_dp_times_cp():
    """megatron shards optimizer state over the DP x CP group."""
    opt = "parallel.use_distributed_optimizer=true"
    # fp32 on CPU: 4 (weight) + 4 (grad) + 8 (Adam m, v) / (dp * cp) bytes per trainable parameter.
    dp2 = lm_cost_model(config(opt, path=GPT, world_size=2), world_size=2)
    dp2cp2 = lm_cost_model(config(opt, "parallel.cp=2", path=GPT, world_size=4), world_size=4)
    assert dp2.bytes_per_trainable_param == 4 + 4 + 8 / 2
    assert dp2cp2.bytes_per_trainable_param == 4 + 4 + 8 / 4
    # CP ranks share micro-batches: the same number per step as at cp=1.
    assert dp2cp2.num_microbatches == dp2.num_microbatches


def test_profile_times_are_scaled_to_a_cp_rank(tmp_path):
    """A profile times whole sequences (its shape has no cp); under cp the
    LM's times are divided by cp, the ViT's and projector's are not."""
    seconds = {"embedding": 0.001, "lm_layer": 0.02, "output": 0.002,
               "vision_per_image": 0.003, "projector_per_image": 0.0001}
    cfg = config()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"version": PROFILE_VERSION, "shape": llava_cost_model(cfg).shape,
                                "seconds": seconds}))
    plan = plan_with(config(f"parallel.pipeline_profile={path}", "parallel.cp=2"), llava_cost_model)
    images = cfg.train.micro_batch_size * cfg.vision.images_per_sequence
    head = 0.001 / 2 + images * (0.003 + 0.0001)
    assert plan.unit == "s"
    assert plan.rank_time[0] == pytest.approx(head + plan.counts[0] * 0.02 / 2)
    assert plan.rank_time[-1] == pytest.approx(0.002 / 2 + plan.counts[-1] * 0.02 / 2)


def test_plan_tool_shows_cp(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["plan_pipeline.py", "--config", LLAVA, "parallel.cp=2", "--device", "cpu"])
    runpy.run_path("tools/plan_pipeline.py", run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("pp=4 tp=1 cp=2 dp=1 world=8;"), out
    assert "each rank holds 128 of 256 tokens per sequence" in out
    assert "auto: layers per chunk [1, 5, 5, 5]" in out
