"""The HF MoE config mapping (megascale_omni/hf/moe.py) without weights:
each family's fields onto the ``moe`` section, the layer pattern as HF
builds it, the export's choice of class, and the models no HF MoE class
expresses (refused with one ConfigError naming the field)."""

from __future__ import annotations

import pytest

from megascale_omni.config import ConfigError, JobConfig, from_dict
from megascale_omni.hf import lm
from megascale_omni.hf import moe as hf_moe

transformers = pytest.importorskip("transformers")


def _hf(cls, **fields) -> dict:
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2)
    return getattr(transformers, cls)(**base, **fields).to_dict()


def _cfg(moe: dict, **model):
    return from_dict(JobConfig, {"model": {"family": "gpt", "num_layers": 4, "hidden_size": 64,
                                           "num_attention_heads": 4, "add_bias_linear": False,
                                           "activation": "swiglu", "normalization": "RMSNorm",
                                           "position_embedding_type": "rope", **model},
                                 "moe": {"num_experts": 4, "topk": 2, **moe}})


def test_each_family_maps_onto_the_moe_section():
    mixtral = hf_moe.moe_section(_hf("MixtralConfig", num_local_experts=8, num_experts_per_tok=2,
                                     router_aux_loss_coef=0.02), "f")
    assert mixtral == dict(num_experts=8, topk=2, ffn_hidden_size=96, pre_softmax=False, load_balancing="aux_loss",
                           aux_loss_coeff=0.02, layer_freq=1)
    qwen2 = hf_moe.moe_section(_hf("Qwen2MoeConfig", num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=80, norm_topk_prob=False, decoder_sparse_step=2,
                                   router_aux_loss_coef=0.0), "f")
    assert qwen2 == dict(num_experts=6, topk=3, ffn_hidden_size=32, pre_softmax=True, load_balancing="none",
                         aux_loss_coeff=0.0, layer_freq=[0, 1, 0, 1], shared_expert_ffn_hidden_size=80,
                         shared_expert_gate=True)
    tc = _hf("Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
             mlp_only_layers=[0, 3])
    assert hf_moe.moe_section(tc, "f")["layer_freq"] == [0, 1, 1, 0]
    assert hf_moe.moe_section(tc, "f")["pre_softmax"] is False
    sections = lm.text_sections(tc, 64, "f", "gpt")
    assert sections["model"]["qk_layernorm"] is True and sections["model"]["ffn_hidden_size"] == 96


@pytest.mark.parametrize("moe,model,base,expected", [
    ({}, {}, None, "mixtral"),
    ({}, {}, "qwen3_moe", "mixtral"),  # no q/k norms: Qwen3-MoE cannot carry it
    ({"pre_softmax": True}, {"qk_layernorm": True}, "mixtral", "qwen3_moe"),
    ({"shared_expert_ffn_hidden_size": 32, "shared_expert_gate": True, "layer_freq": [1, 0, 1, 1]}, {}, None,
     "qwen2_moe"),
])
def test_export_picks_the_class_that_expresses_the_model(moe, model, base, expected):
    cfg = _cfg(moe, **model)
    fields = hf_moe.hf_moe_config(cfg.moe, cfg.model, base)
    assert fields["model_type"] == expected
    if expected != "mixtral":
        pattern = cfg.moe.layer_pattern(4)
        assert fields["mlp_only_layers"] == [i for i, v in enumerate(pattern) if not v]
        assert fields["norm_topk_prob"] is (not cfg.moe.pre_softmax)


@pytest.mark.parametrize("moe,model,words", [
    ({"score_function": "sigmoid", "pre_softmax": False}, {}, "moe.score_function"),
    ({"score_function": "sigmoid", "expert_bias": True, "load_balancing": "none", "aux_loss_coeff": 0}, {},
     "moe.score_function"),
    ({"topk_scaling_factor": 2.5}, {}, "moe.topk_scaling_factor"),
    ({"shared_expert_ffn_hidden_size": 32}, {}, "qwen2_moe: an ungated shared expert"),
    ({"layer_freq": 2}, {}, "mixtral: dense layers"),
    ({"shared_expert_ffn_hidden_size": 32, "shared_expert_gate": True}, {"qk_layernorm": True},
     "qwen2_moe: q/k norms"),
])
def test_models_no_hf_moe_class_computes_are_refused(moe, model, words):
    cfg = _cfg(moe, **model)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        hf_moe.hf_moe_config(cfg.moe, cfg.model, None)


def test_a_dense_model_with_qk_norms_has_no_export():
    cfg = _cfg({}, qk_layernorm=True)
    with pytest.raises(ConfigError, match="model.qk_layernorm"):
        lm.hf_text_config(cfg.model)


def test_starting_from_moe_weights_may_change_how_the_router_trains_not_what_it_computes():
    from megascale_omni.checkpoint.state import PRETRAINED_FREE_FIELDS, incompatibilities
    from megascale_omni.config import to_dict

    saved = to_dict(_cfg({"aux_loss_coeff": 0.02}))
    tuned = _cfg({"aux_loss_coeff": 0.01, "z_loss_coeff": 1e-3, "capacity_factor": 1.25})
    assert incompatibilities(saved, tuned, PRETRAINED_FREE_FIELDS) == []
    other = _cfg({"aux_loss_coeff": 0.02, "pre_softmax": True})
    assert incompatibilities(saved, other, PRETRAINED_FREE_FIELDS) == ["moe.pre_softmax: checkpoint False, config True"]
