"""Pipeline planning from a config: the family cost models (LLaVA's ViT-heavy
example, GPT, DiT), megatron layout strings and layer numbering, and
bad-input errors (tests/e2e/test_pipeline_tools.py runs the tools and the
entry point)."""

from __future__ import annotations

import json

import pytest

from megascale_omni.config import ConfigError, load_job_config, validate_job
from megascale_omni.parallel.pipeline_cost import (
    EMBEDDING,
    LM_LAYER,
    OUTPUT,
    PROFILE_VERSION,
    VISION,
    llava_cost_model,
    lm_cost_model,
)
from megascale_omni.parallel.pipeline_plan import (
    GIB,
    format_plan_table,
    megatron_layout,
    plan_for,
    resolve_partition,
    smallest_fitting_pp,
)
from megascale_omni.parallel.pipeline_plan import plan_pipeline as plan_with

EXAMPLE = "examples/llava/pp4_vit_heavy.yaml"
DIT = "examples/dit/tiny_cpu.yaml"


def config(*overrides: str, path: str = EXAMPLE, world_size: int | None = None):
    cfg = load_job_config(["--config", path, *overrides])
    validate_job(cfg, world_size or cfg.parallel.model_parallel_size)
    return cfg


def plan_pipeline(cfg, cost_model=llava_cost_model):
    """The LLaVA example's plan unless told otherwise."""
    return plan_with(cfg, cost_model)


def test_example_vit_costs_about_three_lm_layers_and_auto_balances_it():
    cfg = config()
    model = llava_cost_model(cfg)
    head_in_layers = model.head_time / model.layer_time
    assert 2.5 <= head_in_layers <= 3.5
    uniform, auto = plan_for(cfg, "uniform", llava_cost_model), plan_for(cfg, "auto", llava_cost_model)
    assert uniform.counts == (4, 4, 4, 4) and uniform.imbalance >= 1.4
    assert auto.imbalance <= 1.10
    assert auto.counts[0] < 4 and sum(auto.counts) == 16
    assert max(auto.rank_time) < max(uniform.rank_time)


def test_cost_model_follows_freezing_and_recompute():
    base = llava_cost_model(config())
    frozen = llava_cost_model(config("vision.freeze=true"))
    # A frozen ViT runs forward only: about a third of forward+backward, no activations kept.
    assert frozen.time(VISION) == pytest.approx(base.time(VISION) / 3, rel=0.02)
    assert frozen.activation_bytes(VISION) == 0
    assert frozen.static_bytes(VISION) == pytest.approx(base.static_bytes(VISION) / 4)  # weights only, fp32
    recompute = llava_cost_model(config("model.recompute=true"))
    assert recompute.time(LM_LAYER) == pytest.approx(base.time(LM_LAYER) * 4 / 3, rel=1e-9)
    assert recompute.activation_bytes(LM_LAYER) < base.activation_bytes(LM_LAYER) / 10
    gpt = lm_cost_model(config(path="examples/gpt/tiny.yaml"))
    assert set(gpt.components) == {EMBEDDING, LM_LAYER, OUTPUT} and gpt.head == (EMBEDDING,)


def test_layer_parameter_count_matches_megatron():
    """The cost model's parameter count of one LM layer is megatron's."""
    cfg = config()
    model = llava_cost_model(cfg)
    h, f = cfg.model.hidden_size, cfg.model.ffn_size
    # QKV, proj, fc1, fc2 weights + biases, two LayerNorms (weight + bias).
    expected = 3 * h * h + 3 * h + h * h + h + h * f + f + f * h + h + 4 * h
    assert model.components[LM_LAYER].params == expected


@pytest.mark.parametrize(
    "counts, pp, layout",
    [([1, 3, 3, 1], 4, "Et|ttt|ttt|tL"), ([2, 5, 5, 4], 4, "Ett|ttttt|ttttt|ttttL"), ([1, 2, 3, 2], 2, "Et|tt|ttt|ttL")],
)
def test_megatron_layout_string_and_global_layer_numbering(counts, pp, layout):
    """megatron parses our string into the intended stages and numbers layers
    globally, which is what keeps layout-invariant init keys unchanged."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    assert megatron_layout(counts, pp) == layout
    parsed = PipelineParallelLayerLayout(layout, pp)
    vpp = len(counts) // pp
    assert parsed.virtual_pipeline_model_parallel_size == vpp
    seen = []
    # megatron reads the virtual stage only when its VPP size is set.
    mpu.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    try:
        for chunk, n in enumerate(counts):
            v, r = divmod(chunk, pp)
            ids = parsed.get_layer_id_list(vp_stage=v, pp_rank=r)
            assert len(ids) == n
            seen += ids
    finally:
        mpu.set_virtual_pipeline_model_parallel_world_size(None)
    assert seen == list(range(sum(counts)))  # chunk order == layer order


def test_auto_resolves_to_explicit_counts_for_megatron():
    cfg = config()
    plan = plan_pipeline(cfg)
    resolved = resolve_partition(cfg, plan)
    assert resolved.parallel.pipeline_partition == list(plan.counts)
    assert resolve_partition(config("parallel.pipeline_partition=uniform"), plan_pipeline(
        config("parallel.pipeline_partition=uniform"))).parallel.pipeline_partition == "uniform"
    # The builders take counts or uniform, never "auto": one stage gets every layer.
    one = config("parallel.pp=1")
    assert resolve_partition(one, plan_pipeline(one)).parallel.pipeline_partition == [16]


def test_interleaved_auto_plan():
    cfg = config("parallel.pp=2", "parallel.vpp=2")
    plan = plan_pipeline(cfg)
    assert len(plan.counts) == 4 and sum(plan.counts) == 16 and min(plan.counts) >= 1
    assert plan.counts[0] == min(plan.counts)  # the ViT chunk gets the fewest layers
    assert plan.imbalance <= plan_for(cfg, "uniform", llava_cost_model).imbalance


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["parallel.pipeline_partition=[4,4,4]"], "parallel.pipeline_partition", ["pp*vpp=4"]),
        (["parallel.pipeline_partition=[4,4,4,5]"], "parallel.pipeline_partition", ["sums to 17", "num_layers=16"]),
        (["parallel.pipeline_partition=[0,6,5,5]"], "parallel.pipeline_partition", ["at least 1 layer"]),
        (["model.num_layers=3"], "model.num_layers", ["pp*vpp=4", "parallel.pp <= 3"]),
        (["model.num_layers=18", "parallel.pipeline_partition=uniform"], "model.num_layers", ["auto"]),
    ],
)
def test_bad_partitions_name_field_and_fix(overrides, field, words):
    with pytest.raises(ConfigError) as err:
        config(*overrides)
    assert err.value.field == field
    for w in words:
        assert w in str(err.value)


def test_uneven_layer_count_is_fine_for_auto():
    plan = plan_pipeline(config("model.num_layers=18"))
    assert sum(plan.counts) == 18


def test_memory_capacity_names_needed_memory_and_smallest_pp():
    # At pp=2 every split needs ~0.107 GiB on some rank; at pp=3 ~0.088
    # (rank 0's ViT and its in-flight activations then dominate).
    with pytest.raises(ConfigError) as err:
        plan_pipeline(config("parallel.pp=2", "parallel.pipeline_memory_gib=0.1", world_size=2))
    msg = str(err.value)
    assert err.value.field == "parallel.pipeline_memory_gib"
    assert "parallel.pp=3 (smallest pp that fits)" in msg
    assert smallest_fitting_pp(
        config("parallel.pp=2", "parallel.pipeline_memory_gib=0.1", world_size=2), llava_cost_model) == 3
    need = float(msg.split("the best split at pp=2 needs ")[1].split(" GiB")[0])
    # The quoted need is enough (rounded up) and tight.
    plan = plan_pipeline(config("parallel.pp=2", f"parallel.pipeline_memory_gib={need}", world_size=2))
    assert plan.peak_memory <= need * GIB
    with pytest.raises(ConfigError):
        plan_pipeline(config("parallel.pp=2", f"parallel.pipeline_memory_gib={need * 0.99}", world_size=2))
    # Nothing fits: the message says so instead of naming a pp.
    with pytest.raises(ConfigError, match="no pp up to 16 fits"):
        plan_pipeline(config("parallel.pipeline_memory_gib=0.08"))


def test_uniform_over_memory_points_at_auto():
    cfg = config("parallel.pipeline_partition=uniform")
    uniform = plan_pipeline(cfg)
    auto = plan_pipeline(config())
    cap = (auto.peak_memory + uniform.peak_memory) / 2 / GIB  # auto fits, uniform does not
    with pytest.raises(ConfigError) as err:
        plan_pipeline(config("parallel.pipeline_partition=uniform", f"parallel.pipeline_memory_gib={cap}"))
    assert "uniform split [4, 4, 4, 4] needs 0.179 GiB" in str(err.value)
    assert "set parallel.pipeline_partition: auto" in str(err.value)


def test_profile_replaces_flops_and_must_match_the_shape(tmp_path):
    cfg = config()
    seconds = {"embedding": 0.001, "lm_layer": 0.02, "output": 0.002,
               "vision_per_image": 0.003, "projector_per_image": 0.0001}
    path = tmp_path / "profile.json"
    shape = llava_cost_model(cfg).shape
    assert shape["vision_layers"] == cfg.vision.num_layers and shape["family"] == "llava"
    path.write_text(json.dumps({"version": PROFILE_VERSION, "shape": shape, "seconds": seconds}))
    plan = plan_pipeline(config(f"parallel.pipeline_profile={path}"))
    assert plan.unit == "s"
    images = cfg.train.micro_batch_size * cfg.vision.images_per_sequence
    head = 0.001 + images * (0.003 + 0.0001)
    assert plan.rank_time[0] == pytest.approx(head + plan.counts[0] * 0.02)
    with pytest.raises(ConfigError) as err:
        plan_pipeline(config(f"parallel.pipeline_profile={path}", "model.hidden_size=256"))
    assert "hidden_size=128" in str(err.value) and "profile_layers.py" in str(err.value)
    with pytest.raises(ConfigError, match="file not found"):
        plan_pipeline(config(f"parallel.pipeline_profile={tmp_path / 'missing.json'}"))


def dit_config(*overrides: str, world_size: int = 2):
    return config("parallel.pp=2", *overrides, path=DIT, world_size=world_size)


def test_dit_cost_model_counts_a_block_and_finds_head_and_tail_cheap():
    from megascale_omni.parallel.pipeline_cost_dit import (
        CONDITION,
        DIT_BLOCK,
        DIT_OUTPUT,
        PATCH_EMBEDDING,
        TEXT_EMBEDDING,
        dit_cost_model,
        dit_package,
    )

    cfg = dit_config()
    model = dit_cost_model(cfg)
    assert model.head == (PATCH_EMBEDDING, TEXT_EMBEDDING, CONDITION) and model.tail == (DIT_OUTPUT,)
    assert model.layer == DIT_BLOCK and model.shape is None  # no profiler: FLOPs only
    h, f = cfg.model.hidden_size, cfg.model.ffn_size
    # adaLN (h -> 9h), self-attention (QKV + proj), cross-attention (Q, KV, proj), MLP; all biased, no norm weights.
    expected = (9 * h * h + 9 * h) + (4 * h * h + 4 * h) + (4 * h * h + 4 * h) + (2 * h * f + f + h)
    assert model.components[DIT_BLOCK].params == expected
    tokens, per_image, images = dit_package(cfg)
    assert (tokens, per_image, images) == (144, 36, 4)  # token_budget; the 24x24 bucket at patch 4
    # Forward + two backward matmuls over the image tokens dominate a block:
    # QKV and projection, cross-attention query and projection, MLP.
    image_matmuls = 3 * 2 * tokens * (6 * h * h + 2 * h * f)
    assert image_matmuls < model.time(DIT_BLOCK) < 1.2 * image_matmuls
    # The head and tail are a few percent of one block.
    assert model.head_time < 0.1 * model.layer_time and model.tail_time < 0.1 * model.layer_time
    # Precomputed captions have no embedding table; EMA keeps one more copy of the weights.
    pre = dit_cost_model(dit_config("dit.text_encoder=precomputed", "dit.text_dim=32"))
    assert pre.components[TEXT_EMBEDDING].params == 32 * h + h
    no_ema = dit_cost_model(dit_config("dit.ema_decay=0"))
    assert model.bytes_per_trainable_param - no_ema.bytes_per_trainable_param == 4  # fp32 on CPU


def test_dit_auto_balances_the_blocks_and_the_table_renders():
    from megascale_omni.tasks.registry import family_of

    cfg = dit_config("model.num_layers=5", "parallel.pipeline_partition=auto")
    family = family_of(cfg)
    family.validate(cfg, 2)
    plan = family.plan_pipeline(cfg, cuda=False, world_size=2)
    # The head outweighs the tail, so the odd block goes to the last stage.
    assert plan.counts == (2, 3) and plan.unit == "FLOP"
    assert resolve_partition(cfg, plan).parallel.pipeline_partition == [2, 3]
    even = dit_config("parallel.pipeline_partition=auto")
    assert family.plan_pipeline(even, cuda=False, world_size=2).counts == (2, 2)
    explicit = family.plan_pipeline(dit_config("parallel.pipeline_partition=[1,3]"), cuda=False, world_size=2)
    uniform = family.plan_pipeline(dit_config(), cuda=False, world_size=2)
    assert explicit.counts == (1, 3) and explicit.mode == "explicit"
    assert uniform.imbalance < 1.05 < 1.4 < explicit.imbalance
    table = format_plan_table([uniform, explicit])
    lines = table.splitlines()
    assert "uniform layers" in lines[0] and "explicit layers" in lines[0] and len(lines) == 6
    assert lines[2].split()[:2] == ["0", "2"] and lines[3].split()[:2] == ["1", "2"]
    assert lines[2].split()[4] == "1" and lines[3].split()[4] == "3"


@pytest.mark.parametrize(
    "family, overrides, words",
    [
        ("dit", ["parallel.vpp=2"], ["parallel.vpp=2", "does not support vpp", "set parallel.vpp: null"]),
        ("dit", ["parallel.pipeline_profile=profile.json"],
         ["parallel.pipeline_profile='profile.json'", "model.family=dit has no measured profile", "null"]),
        ("llava", [], ["model.family='dit'", "pretrain_dit.py"]),
    ],
)
def test_unsupported_combination_exits_2_with_one_line(capsys, family, overrides, words):
    """What the entry points do before any process group: validate, then plan."""
    from megascale_omni.entry import parse_for_family, run_cli

    def main():
        argv = ["--config", DIT, "parallel.pp=2", *overrides]
        cfg, spec = parse_for_family(family, argv, world_size=2)
        spec.plan_pipeline(cfg, cuda=False, world_size=2)

    with pytest.raises(SystemExit) as exited:
        run_cli(main)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), lines
    for w in words:
        assert w in lines[0]
