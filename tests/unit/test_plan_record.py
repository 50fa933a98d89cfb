"""The sample plan's settings and data digests, as a checkpoint records them
and a resume checks them (megascale_omni/data/plan_record.py): the layout,
the micro-batch size and how fast data is read may change; anything that
decides which samples a step holds may not, and is refused in one line naming
the field; a checkpoint written before the record is read from its config with
the padding rule of then (2*cp under CP)."""

from __future__ import annotations

import logging

import pytest

from megascale_omni.config import ConfigError, JobConfig, apply_overrides, from_dict, load_yaml, to_dict
from megascale_omni.data.identity import train_split_source
from megascale_omni.data.plan_record import CHECKPOINT_KEY, check_resumed_plan, plan_record, plan_settings

LLAVA = "examples/llava/tiny_cpu.yaml"
IDENTITY = {"data.path": train_split_source("data.path", "/data/a", "a" * 64)}


def _cfg(*overrides: str) -> JobConfig:
    return from_dict(JobConfig, apply_overrides(load_yaml(LLAVA), list(overrides)))


def _common(cfg: JobConfig, layout: dict | None = None, identity=IDENTITY, record: bool = True) -> dict:
    """A checkpoint's common state as TrainState.sharded_state_dict writes it."""
    common = {"config": to_dict(cfg), "layout": layout or {"tp": 1, "pp": 1, "cp": 1, "dp": 1}}
    if record:
        common[CHECKPOINT_KEY] = plan_record(cfg, identity)
    return common


@pytest.mark.parametrize("change", [
    ["parallel.tp=2"], ["parallel.pp=2"], ["parallel.cp=2"], ["parallel.cp=4"], ["train.micro_batch_size=1"],
    ["data.num_workers=2", "data.prefetch_steps=4"], ["data.max_bad_sample_fraction=0.5"], ["train.lr=0.5"],
    ["data.path=/mnt/elsewhere"], ["train.steps=99"],
])
def test_the_layout_and_how_data_is_read_do_not_change_the_plan(change):
    assert plan_settings(_cfg(*change)) == plan_settings(_cfg())
    check_resumed_plan(_common(_cfg()), _cfg(*change), IDENTITY)


def test_default_padding_resolves_to_8_at_every_layout():
    assert {plan_settings(_cfg(f"parallel.cp={cp}"))["data.pad_to_multiple_of"] for cp in (1, 2, 4)} == {8}
    assert plan_settings(_cfg("data.pad_to_multiple_of=8")) == plan_settings(_cfg())


@pytest.mark.parametrize("change, field, fragment", [
    (["train.seed=7"], "train.seed", "train.seed=7: the checkpoint's run planned with 1234, and it decides"),
    (["train.global_batch_size=4"], "train.global_batch_size", "set train.global_batch_size=8 to resume"),
    (["data.pad_to_multiple_of=4"], "data.pad_to_multiple_of", "=4: the checkpoint's run planned with 8"),
    (["model.seq_length=128"], "model.seq_length", "planned with 256"),
    (["data.image_mode=pad_square"], "data.image_mode", "planned with 'exact'"),
    (["data.blend=[{path: /a, weight: 2.0}]"], "data.blend", "planned with []"),
])
def test_a_setting_that_decides_the_samples_is_refused_on_resume_in_one_line(change, field, fragment):
    with pytest.raises(ConfigError) as err:
        check_resumed_plan(_common(_cfg()), _cfg(*change), IDENTITY)
    text = str(err.value)
    assert err.value.field == field and fragment in text, text
    assert "repeat some samples and skip others" in text and "checkpoint.resume=none" in text and "\n" not in text


def test_the_default_padding_is_named_with_what_it_resolves_to():
    saved = _cfg("data.pad_to_multiple_of=4", "parallel.cp=2")
    with pytest.raises(ConfigError) as err:
        check_resumed_plan(_common(saved), _cfg(), IDENTITY)
    assert str(err.value).startswith("config error: data.pad_to_multiple_of=0: resolves to 8; the checkpoint's run "
                                     "planned with 4"), str(err.value)
    assert "set data.pad_to_multiple_of=4 to resume this run (at any layout)" in str(err.value)


def test_other_data_is_refused_naming_the_field_and_the_checkpoint():
    other = {"data.path": train_split_source("data.path", "/data/b", "b" * 64)}
    with pytest.raises(ConfigError) as err:
        check_resumed_plan(_common(_cfg()), _cfg(), other)
    assert err.value.field == "data.path" and "\n" not in str(err.value)
    assert ("its train split (train/index.json) differs from the checkpoint's (digest bbbbbbbbbbbb here, "
            "aaaaaaaaaaaa in the checkpoint): the remaining steps would train on other samples; point data.path at "
            "the checkpoint's copy of the dataset, or start a new run with checkpoint.resume=none") in str(err.value)


def test_a_checkpoint_without_the_record_is_read_with_the_padding_rule_of_then(caplog):
    """Before the record, ``0`` padded to 2*cp under CP and 1 without: a CP2
    checkpoint planned with 4, a CP1 one with 1; either differs from today's
    default and is refused rather than resumed on another plan. Its data
    digests are unknown, which is logged."""
    old_cp2 = _common(_cfg("parallel.cp=2"), layout={"tp": 1, "pp": 1, "cp": 2, "dp": 1}, record=False)
    for common, then in ((old_cp2, 4), (_common(_cfg(), record=False), 1)):
        with pytest.raises(ConfigError) as err:
            check_resumed_plan(common, _cfg(), IDENTITY)
        assert err.value.field == "data.pad_to_multiple_of" and f"planned with {then}" in str(err.value)
    with caplog.at_level(logging.WARNING):
        check_resumed_plan(old_cp2, _cfg("data.pad_to_multiple_of=4"), IDENTITY)
    assert "records no data digests" in caplog.text
    # GPT and DiT do not pad samples: a CP2 checkpoint of then resumes under today's default.
    gpt = from_dict(JobConfig, apply_overrides(load_yaml("examples/gpt/tiny.yaml"), ["parallel.cp=2"]))
    check_resumed_plan(_common(gpt, layout={"tp": 1, "pp": 1, "cp": 2, "dp": 1}, record=False), gpt, IDENTITY)
    assert "data.pad_to_multiple_of" not in plan_settings(gpt)
    # A config that predates a field: the field is not compared.
    common = _common(_cfg(), record=False)
    del common["config"]["data"]["image_processor"]
    check_resumed_plan(common, _cfg("data.pad_to_multiple_of=1", "data.image_processor=/x.json"), IDENTITY)
