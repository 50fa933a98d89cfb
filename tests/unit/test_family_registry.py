"""Each model family is declared once; its declaration decides what a config may ask for."""

from __future__ import annotations

import pytest

from megascale_omni.config import ConfigError, load_job_config
from megascale_omni.data.module import DataModule
from megascale_omni.entry import parse_for_family
from megascale_omni.evaluation.base import Evaluator
from megascale_omni.models.model_spec import ModelSpec
from megascale_omni.tasks.registry import FAMILIES, FEATURES, _resolve, family_of, get_family

EXAMPLES = {"gpt": "examples/gpt/tiny.yaml", "llava": "examples/llava/tiny_cpu.yaml", "dit": "examples/dit/tiny_cpu.yaml"}


def _cfg(family: str, *overrides: str):
    return load_job_config(["--config", EXAMPLES[family], *overrides])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_names_its_three_parts_and_its_example_validates(name):
    family = get_family(name)
    data, model = family.parts()
    assert issubclass(data, DataModule) and issubclass(model, ModelSpec)
    assert family.evaluators and all(issubclass(_resolve(target), Evaluator) for _, target in family.evaluators)
    assert set(family.features) <= set(FEATURES)
    cfg = _cfg(name)
    assert family_of(cfg) is family
    family.validate(cfg, world_size=2)


def test_unknown_family_is_a_config_error():
    with pytest.raises(ConfigError, match="must be one of"):
        get_family("bert")


def test_a_config_of_another_family_is_refused_by_the_entry_point():
    with pytest.raises(ConfigError) as err:
        parse_for_family("dit", ["--config", EXAMPLES["llava"]], world_size=1)
    msg = str(err.value)
    assert "model.family='llava'" in msg and "pretrain_llava.py" in msg


# (family, overrides, world size, fragments of the one-line error)
UNSUPPORTED = [
    ("dit", ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"], 2,
     ["parallel.vpp=2", "does not support vpp", "set parallel.vpp: null"]),
    ("dit", ["parallel.tp=2", "parallel.sequence_parallel=true"], 2,
     ["parallel.sequence_parallel=True", "does not support sequence parallel", "adaLN"]),
    ("gpt", ["data.num_workers=1"], 1, ["data.num_workers=1", "does not support data workers"]),
    ("dit", ["data.num_workers=2"], 1, ["data.num_workers=2", "does not support data workers", "set data.num_workers: 0"]),
    ("dit", ["model.recompute=selective"], 1, ["model.recompute='selective'", "set model.recompute: none"]),
    ("dit", ["model.qk_layernorm=true"], 1, ["model.qk_layernorm=True", "no q/k norms", "set model.qk_layernorm: false"]),
    ("dit", ["model.kv_channels=64"], 1, ["model.kv_channels=64", "set model.kv_channels: null"]),
]


@pytest.mark.parametrize("family,overrides,world,fragments", UNSUPPORTED, ids=lambda v: str(v)[:30])
def test_a_feature_the_family_lacks_is_refused_with_one_line(family, overrides, world, fragments):
    with pytest.raises(ConfigError) as err:
        get_family(family).validate(_cfg(family, *overrides), world_size=world)
    msg = str(err.value)
    assert "\n" not in msg
    for fragment in fragments:
        assert fragment in msg, msg


def test_family_checks_run_after_the_generic_ones():
    with pytest.raises(ConfigError, match="vision.num_attention_heads"):
        get_family("llava").validate(_cfg("llava", "parallel.tp=3", "model.hidden_size=48",
                                          "model.num_attention_heads=3", "model.ffn_hidden_size=96",
                                          "model.make_vocab_size_divisible_by=3"), world_size=3)
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        get_family("dit").validate(_cfg("dit", "train.micro_batch_size=2", "train.global_batch_size=8"), world_size=1)


def test_a_part_missing_a_required_method_cannot_be_built():
    class IncompleteModel(ModelSpec):
        def build_model(self):
            return []

    class IncompleteData(DataModule):
        def microbatches(self, step, dp_rank, dp_size):
            return []

    with pytest.raises(TypeError, match="abstract.*forward_step"):
        IncompleteModel(None, None, None, None)
    with pytest.raises(TypeError, match="abstract.*global_batch_size_of"):
        IncompleteData(None, None, None)


@pytest.mark.parametrize("family,value,names", [
    ("gpt", "chat", "['auto', 'loss', 'none']"),
    ("llava", "colors", "['auto', 'shapes', 'chat', 'none']"),
    ("dit", "loss", "['auto', 'colors', 'none']"),
])
def test_an_evaluator_the_family_lacks_is_refused_with_one_line(family, value, names):
    with pytest.raises(ConfigError) as err:
        get_family(family).validate(_cfg(family, f"train.evaluator={value}"), world_size=1)
    assert (err.value.field, err.value.value) == ("train.evaluator", value)
    assert str(err.value) == (f"config error: train.evaluator={value!r}: model.family={family} evaluates with "
                              f"one of {names}")


class _Tokens:
    def __init__(self, words):
        self.words = {w: i for i, w in enumerate(words)}

    def token_to_id(self, word):
        return self.words.get(word)


def test_auto_evaluator_is_shapes_only_for_the_word_level_shapes_vocabulary():
    from megascale_omni.demo.llava_eval import ShapesEvaluator
    from megascale_omni.demo.shapes import dataset_vocabulary
    from megascale_omni.evaluation.chat import ChatEvaluator

    family = get_family("llava")
    shapes = type("Data", (), {"tokenizer": _Tokens(dataset_vocabulary())})()
    other = type("Data", (), {"tokenizer": _Tokens(["<pad>", "yes", "no", "red", "cat"])})()
    words, chat = _cfg("llava"), _cfg("llava", "data.format=chat")
    assert family.evaluator_class(words, shapes) is ShapesEvaluator
    assert family.evaluator_class(words, other) is ChatEvaluator
    assert family.evaluator_class(chat, shapes) is ChatEvaluator
    assert family.evaluator_class(_cfg("llava", "train.evaluator=chat"), shapes) is ChatEvaluator
    assert family.evaluator_class(_cfg("llava", "train.evaluator=none"), shapes) is Evaluator


# Context parallelism cuts every DiT image into 2*cp chunks: buckets (and the
# resolutions sampled at the end under the training layout) need 2*cp | tokens.
CP_BUCKETS = "dit.buckets=[[16,16],[24,24],[12,16],[16,12],[16,32],[32,16]]"
DIT_CP_BAD = [
    # The example's 12x20 bucket is 3x5 = 15 patches of 4 px; one side changed: 3x4.
    (["parallel.cp=2"], "dit.buckets[1]", "12x20", ["has 15 tokens", "2*parallel.cp=4", "such as 12x16 (12 tokens)"]),
    (["parallel.cp=2", CP_BUCKETS, "dit.eval_resolutions=[[16,16],[12,24]]"], "dit.eval_resolutions[1]", "12x24",
     ["has 18 tokens", "resolution such as 16x24 (24 tokens)"]),
    (["parallel.cp=4", CP_BUCKETS], "dit.buckets[1]", "24x24",
     ["has 36 tokens", "2*parallel.cp=8", "such as 32x24 (48 tokens)"]),
]


@pytest.mark.parametrize("overrides,field,value,fragments", DIT_CP_BAD, ids=lambda v: str(v)[:40])
def test_dit_token_counts_must_split_into_2cp_chunks(overrides, field, value, fragments):
    with pytest.raises(ConfigError) as err:
        get_family("dit").validate(_cfg("dit", *overrides), world_size=4)
    assert (err.value.field, err.value.value) == (field, value)
    for fragment in fragments:
        assert fragment in err.value.hint, str(err.value)


def test_dit_supports_context_parallel_with_divisible_buckets():
    get_family("dit").validate(_cfg("dit", "parallel.cp=2", CP_BUCKETS), world_size=2)
    get_family("dit").validate(_cfg("dit", "parallel.cp=2", "parallel.tp=2", CP_BUCKETS), world_size=4)
