"""The ``moe:`` section: bad combinations exit before any process group with
one line naming the field, and every setting reaches megatron-core's
``TransformerConfig`` and its MoE layer as documented in docs/moe.md."""

from __future__ import annotations

import pytest

from megascale_omni.config import ConfigError, JobConfig, apply_overrides, from_dict, load_yaml
from megascale_omni.tasks.registry import get_family

MOE = "examples/gpt/tiny_moe.yaml"


def _cfg(overrides: list[str], base: str = MOE) -> JobConfig:
    return from_dict(JobConfig, apply_overrides(load_yaml(base), overrides))


ELASTIC = ["elastic.enabled=true", "elastic.lighthouse=http://127.0.0.1:29510", "elastic.replica_id=r1"]

# (overrides, world size, field named, fragment of the hint)
REFUSED = [
    (["moe.topk=5"], 1, "moe.topk", "<= moe.num_experts=4"),
    (["moe.num_experts=-1"], 1, "moe.num_experts", ">= 0"),
    (["moe.shared_expert_gate=true"], 1, "moe.shared_expert_gate", "shared_expert_ffn_hidden_size"),
    (["moe.topk=1"], 1, "moe.pre_softmax", "pre_softmax: true for topk 1"),
    (["moe.pre_softmax=true", "moe.score_function=sigmoid"], 1, "moe.pre_softmax", "softmax"),
    (["moe.expert_bias=true"], 1, "moe.expert_bias", "score_function: sigmoid"),
    (["moe.load_balancing=none"], 1, "moe.aux_loss_coeff", "0 with none"),
    (["moe.aux_loss_coeff=0"], 1, "moe.aux_loss_coeff", "> 0 with load_balancing: aux_loss"),
    (["moe.load_balancing=seq_aux_loss"], 1, "moe.load_balancing", "'aux_loss', 'none'"),
    (["moe.pad_to_capacity=true"], 1, "moe.pad_to_capacity", "needs moe.capacity_factor"),
    (["moe.capacity_factor=0"], 1, "moe.capacity_factor", "> 0"),
    (["moe.layer_freq=0"], 1, "moe.layer_freq", ">= 1"),
    (["moe.layer_freq=[1,2,0,1]"], 1, "moe.layer_freq", "0 (dense) or 1 (MoE)"),
    (["moe.layer_freq=[1,0,1]"], 1, "moe.layer_freq", "4 entries"),
    (["moe.token_dispatcher=flex"], 1, "moe.token_dispatcher", "'alltoall', 'allgather'"),
    (["parallel.ep=3"], 3, "moe.num_experts", "divisible by parallel.ep=3"),
    (["parallel.ep=4"], 2, "parallel.ep", "must divide the 2 ranks of a pipeline stage"),
    (["parallel.ep=2", "parallel.pp=2"], 2, "parallel.ep", "world size 2 / pp 2"),
    (["parallel.ep=2", "parallel.tp=2"], 4, "parallel.sequence_parallel", "tp > 1 only with sequence parallelism"),
    (["moe.ffn_hidden_size=127", "parallel.expert_tp=2", "parallel.ep=1"], 2, "moe.ffn_hidden_size",
     "divisible by parallel.expert_tp=2"),
    (["model.add_bias_linear=true"], 1, "model.add_bias_linear", "set it false"),
    ([*ELASTIC, "moe.score_function=sigmoid", "moe.expert_bias=true", "moe.load_balancing=none",
      "moe.aux_loss_coeff=0"], 1, "moe.expert_bias", "not commit-gated"),
    ([*ELASTIC, "parallel.ep=2", "train.global_batch_size=6"], 2, "train.global_batch_size",
     "3 micro-batches of 2, not divisible by parallel.ep=2"),
    (["moe.num_experts=0", "parallel.ep=2"], 2, "parallel.ep", "applies to MoE models only"),
    (["moe.num_experts=0", "parallel.expert_tp=1"], 1, "parallel.expert_tp", "applies to MoE models only"),
]


@pytest.mark.parametrize("overrides,world,field,hint", REFUSED, ids=[" ".join(c[0]) for c in REFUSED])
def test_bad_moe_settings_are_refused_with_one_line(overrides, world, field, hint):
    with pytest.raises(ConfigError) as e:
        get_family("gpt").validate(_cfg(overrides), world)
    assert e.value.field == field and hint in e.value.hint, str(e.value)
    assert "\n" not in str(e.value)


def test_dit_stays_dense():
    cfg = _cfg(["model.family=dit", "model.vocab_size=0", "moe.num_experts=4", "model.add_bias_linear=false"],
               base="examples/dit/tiny_cpu.yaml")
    with pytest.raises(ConfigError) as e:
        get_family("dit").validate(cfg, 1)
    assert e.value.field == "moe.num_experts" and "dense MLPs only" in e.value.hint


def test_valid_layouts_pass():
    for overrides, world in ((["parallel.ep=2"], 2), (["parallel.ep=2", "parallel.pp=2"], 4),
                             (["parallel.ep=4"], 4), (["moe.layer_freq=[1,0,1,1]"], 1),
                             ([*ELASTIC, "parallel.ep=2", "train.global_batch_size=12"], 2),
                             (["parallel.cp=2"], 2), (["parallel.pp=2", "parallel.vpp=2"], 2)):
        get_family("gpt").validate(_cfg(overrides), world)


def test_every_setting_reaches_megatrons_transformer_config():
    import torch

    from megascale_omni.models.gpt import transformer_config

    cfg = _cfg(["moe.num_experts=8", "moe.topk=3", "moe.ffn_hidden_size=32", "moe.shared_expert_ffn_hidden_size=64",
                "moe.shared_expert_gate=true", "moe.score_function=sigmoid", "moe.topk_scaling_factor=2.5",
                "moe.load_balancing=none", "moe.aux_loss_coeff=0", "moe.expert_bias=true",
                "moe.bias_update_rate=0.01", "moe.z_loss_coeff=0.001", "moe.capacity_factor=1.25",
                "moe.token_drop_policy=position", "moe.pad_to_capacity=true", "moe.layer_freq=[0,1,0,1]",
                "moe.token_dispatcher=allgather", "parallel.ep=2"])
    c = transformer_config(cfg.model, cfg.parallel, torch.float32, cfg.moe)
    got = {k: getattr(c, k) for k in (
        "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate", "moe_router_score_function", "moe_router_topk_scaling_factor",
        "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_enable_expert_bias",
        "moe_router_bias_update_rate", "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_token_drop_policy",
        "moe_pad_expert_input_to_capacity", "moe_layer_freq", "moe_token_dispatcher_type", "moe_grouped_gemm",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_router_pre_softmax")}
    assert got == {
        "num_moe_experts": 8, "moe_router_topk": 3, "moe_ffn_hidden_size": 32,
        "moe_shared_expert_intermediate_size": 64, "moe_shared_expert_gate": True,
        "moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5,
        "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.01, "moe_z_loss_coeff": 0.001, "moe_expert_capacity_factor": 1.25,
        "moe_token_drop_policy": "position", "moe_pad_expert_input_to_capacity": True,
        "moe_layer_freq": [0, 1, 0, 1], "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
        "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1, "moe_router_pre_softmax": False,
    }
    dense = transformer_config(cfg.model, cfg.parallel, torch.float32)
    assert dense.num_moe_experts is None
    # Under TP with sequence parallelism megatron scales each router loss by the TP rank's token share:
    # the coefficients are multiplied by tp to keep one process's objective (tests/dist/test_moe_layouts.py).
    sp = _cfg(["moe.z_loss_coeff=0.001", "parallel.tp=2", "parallel.sequence_parallel=true"])
    c = transformer_config(sp.model, sp.parallel, torch.float32, sp.moe)
    assert (c.moe_aux_loss_coeff, c.moe_z_loss_coeff) == (2 * sp.moe.aux_loss_coeff, 0.002)


def test_layer_pattern_is_cut_per_pipeline_chunk():
    """``moe.layer_freq`` names global layers; each chunk builds its slice,
    also under an explicit (non-uniform) pipeline split."""
    from types import SimpleNamespace
    from unittest import mock

    from megascale_omni.models import moe

    config = SimpleNamespace(moe_layer_freq=[1, 0, 0, 1], num_layers=4, pipeline_model_parallel_layout=None)
    with mock.patch("megatron.core.transformer.transformer_layer.get_transformer_layer_offset", return_value=2), \
            mock.patch("megatron.core.transformer.transformer_block.get_num_layers_to_build", return_value=2):
        assert moe.chunk_layer_pattern(config, None) == [False, True]
    config.moe_layer_freq = 2
    with mock.patch("megatron.core.transformer.transformer_layer.get_transformer_layer_offset", return_value=0), \
            mock.patch("megatron.core.transformer.transformer_block.get_num_layers_to_build", return_value=3):
        assert moe.chunk_layer_pattern(config, None) == [True, False, True]


def test_model_flops_count_the_active_experts():
    """The step record's model FLOPs: a token passes through its top-k experts
    (and the shared ones), and its router scores every expert; the experts it
    skips cost nothing. By hand against the dense model of the active width."""
    from megascale_omni.metrics.flops import step_model_flops
    from megascale_omni.parallel.batch_shape import BatchShape
    from megascale_omni.parallel.moe_cost import mlp_widths
    from megascale_omni.parallel.pipeline_cost import lm_cost_model

    batch = BatchShape(segments=(20, 12, 32))
    tokens = 64
    moe = _cfg(["moe.ffn_hidden_size=96", "moe.shared_expert_ffn_hidden_size=32", "moe.layer_freq=[1,0,1,1]"])
    dense = _cfg(["moe.num_experts=0"])
    assert mlp_widths(moe) == (0.25 * 256 + 0.75 * (2 * 96 + 32), 0.25 * 256 + 0.75 * (4 * 96 + 32), 0.75 * 4)
    # Per MoE layer and token: the MLP of the active width instead of the dense 256, plus the router's
    # 64 x 4 matmul; forward + 2 backward passes, 2 FLOPs per multiply-add, 3 of 4 layers MoE.
    per_moe_layer = 3 * 2 * tokens * (2 * 64 * (2 * 96 + 32 - 256) + 64 * 4)
    assert step_model_flops(moe, lm_cost_model, batch) == step_model_flops(dense, lm_cost_model, batch) + 3 * per_moe_layer
    # The count is the model's, whatever the expert layout.
    for overrides in (["parallel.ep=2"], ["parallel.ep=4"]):
        assert step_model_flops(_cfg(["moe.ffn_hidden_size=96", "moe.shared_expert_ffn_hidden_size=32",
                                      "moe.layer_freq=[1,0,1,1]", *overrides]), lm_cost_model, batch) == \
            step_model_flops(moe, lm_cost_model, batch)


def test_the_cost_model_counts_the_token_dispatch():
    """The decoder layer's dispatch bytes, by hand: tiny_moe (hidden 64, top-2, every
    layer MoE), one micro-batch of 2 x 32 tokens, fp32; 4 = dispatch + combine, forward + backward."""
    from megascale_omni.parallel.pipeline_cost import LM_LAYER, lm_cost_model

    def moved(overrides, world):
        cfg = _cfg(overrides)
        return lm_cost_model(cfg, cuda=False, world_size=world).components[LM_LAYER].dispatch_bytes

    tokens, h = 2 * 32, 64
    assert moved(["parallel.ep=2"], 2) == 4 * tokens * 2 * (1 / 2) * h * 4  # half the copies leave the rank
    assert moved(["parallel.ep=4"], 4) == 4 * tokens * 2 * (3 / 4) * h * 4
    assert moved([], 1) == 0.0 and moved(["moe.num_experts=0"], 1) == 0.0  # EP1: every expert is local
    assert moved(["parallel.ep=2", "moe.token_dispatcher=allgather"], 2) == 4 * tokens * 1 * h * 4
    assert moved(["parallel.ep=2", "moe.layer_freq=[1,0,0,1]"], 2) == 0.5 * moved(["parallel.ep=2"], 2)
    # Sequence parallelism: each TP rank dispatches its 1/tp of the tokens.
    assert moved(["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.expert_tp=1"],
                 4) == 0.5 * moved(["parallel.ep=2"], 2)


def test_expert_tp_is_refused_on_cpu():
    """gloo's all-gather takes equal sizes only; the dispatcher's expert-TP gather is uneven."""
    from megascale_omni.config import validate_platform

    cfg = _cfg(["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"])
    with pytest.raises(ConfigError) as e:
        validate_platform(cfg, cuda=False)
    assert e.value.field == "parallel.expert_tp" and "set parallel.expert_tp: 1 on CPU" in e.value.hint
    validate_platform(cfg, cuda=True)
    validate_platform(_cfg(["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.expert_tp=1"]), cuda=False)


def test_dispatch_time_moves_the_planned_pipeline_split():
    """The planner counts the token dispatch in seconds at
    ``parallel.alltoall_bandwidth_gbs`` (with the FLOP model at
    ``logging.peak_tflops``): an 8-layer MoE GPT at PP2 x EP2 whose last stage
    also holds a 32k-vocabulary output layer. With a fast exchange the layers
    cost their FLOPs and the last stage gets fewer of them; when the dispatch
    dominates every layer the output layer matters less and the split moves
    to even."""
    from megascale_omni.parallel.pipeline_cost import LM_LAYER, lm_cost_model
    from megascale_omni.parallel.pipeline_plan import build_cost_model, plan_for

    base = ["model.num_layers=8", "model.vocab_size=32768", "parallel.pp=2", "parallel.ep=2",
            "parallel.pipeline_partition=auto", "logging.peak_tflops=100"]

    def plan(gbs: float, extra: tuple[str, ...] = ()):
        cfg = _cfg([*base, f"parallel.alltoall_bandwidth_gbs={gbs}", *extra])
        return cfg, plan_for(cfg, "auto", lm_cost_model, world_size=4)

    cfg, fast = plan(1e6)
    _, slow = plan(1e-3)
    assert fast.unit == slow.unit == "s"
    assert fast.counts == (7, 1) and slow.counts == (4, 4), (fast.counts, slow.counts)
    # The layer's time by hand: its FLOPs at the peak plus its dispatch bytes at the bandwidth.
    flops_model = lm_cost_model(cfg, cuda=False, world_size=4)
    layer = flops_model.components[LM_LAYER]
    moved = 4 * (2 * 32) * 2 * (1 / 2) * 64 * 4  # tokens x top-2 x half leave, hidden 64, fp32, fwd+bwd x 2
    assert layer.dispatch_bytes == moved
    timed = build_cost_model(cfg, lm_cost_model, world_size=4)
    assert timed.layer_time == pytest.approx(layer.flops / 100e12 + moved / 1e15, rel=1e-12)
    # Without a device peak the times stay FLOPs and the dispatch cannot count: the bandwidth changes nothing.
    no_peak = ("logging.peak_tflops=0",)
    assert plan(1e6, no_peak)[1].counts == plan(1e-3, no_peak)[1].counts == fast.counts
    assert plan(1e6, no_peak)[1].unit == "FLOP"


#: The issue's bad inputs through the entry points' own path (``run_cli`` around
#: ``parse_for_family``, what ``train_family`` runs first): (overrides, world size, the line's words).
SHOW_BAD_INPUTS = [
    (["parallel.ep=3"], 3, "config error: moe.num_experts=4: must be divisible by parallel.ep=3"),
    (["moe.topk=5"], 1, "config error: moe.topk=5:"),
    (["parallel.ep=4"], 2, "config error: parallel.ep=4:"),
]


@pytest.mark.parametrize("overrides,world,words", SHOW_BAD_INPUTS, ids=[c[0][0] for c in SHOW_BAD_INPUTS])
def test_bad_moe_inputs_exit_2_with_one_line(overrides, world, words, capsys):
    from megascale_omni.entry import parse_for_family, run_cli

    with pytest.raises(SystemExit) as e:
        run_cli(lambda: parse_for_family("gpt", ["--config", MOE, *overrides], world_size=world))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(words) and "Traceback" not in err, err
