"""Bad paths and inputs a hostile user gives are refused by the family's
``validate`` (what omni-run and every worker run before any process group),
naming the field, the value and the fix; none needs a model or a process."""

from __future__ import annotations

import logging

import pytest

from megascale_omni.checkpoint import layout
from megascale_omni.config import ConfigError, JobConfig, apply_overrides, from_dict, load_yaml
from megascale_omni.tasks.registry import get_family

GPT = "examples/gpt/tiny.yaml"


def _validate(base: str, overrides: list[str], world_size: int = 1) -> None:
    cfg = from_dict(JobConfig, apply_overrides(load_yaml(base), overrides))
    get_family(cfg.model.family).validate(cfg, world_size)


def _refused(base: str, overrides: list[str], world_size: int = 1) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        _validate(base, overrides, world_size)
    return e.value


# ------------------------------------------------------------ control socket


def test_control_socket_under_a_file_names_the_field(tmp_path):
    (tmp_path / "afile").write_text("x")
    sock = tmp_path / "afile" / "x.sock"
    e = _refused(GPT, [f"logging.output_dir={tmp_path / 'run'}", f"control.socket_path={sock}"])
    assert e.field == "control.socket_path" and e.value == str(sock)
    assert e.hint == f"cannot hold the control socket: {tmp_path / 'afile'} is a file, not a directory; " \
                     "choose another path"


def test_control_socket_deeper_under_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    e = _refused(GPT, [f"logging.output_dir={tmp_path / 'run'}",
                       f"control.socket_path={tmp_path / 'afile' / 'sub' / 'x.sock'}"])
    assert e.field == "control.socket_path" and f"{tmp_path / 'afile'} is a file" in e.hint


def test_control_socket_path_that_is_a_regular_file_is_refused(tmp_path):
    (tmp_path / "x.sock").write_text("not a socket")
    e = _refused(GPT, [f"logging.output_dir={tmp_path / 'run'}", f"control.socket_path={tmp_path / 'x.sock'}"])
    assert e.field == "control.socket_path" and "exists and is not a socket" in e.hint


def test_control_socket_in_a_directory_yet_to_be_made_is_fine(tmp_path):
    _validate(GPT, [f"logging.output_dir={tmp_path / 'run'}", f"control.socket_path={tmp_path / 'new' / 'x.sock'}"])


def test_output_dir_under_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    e = _refused(GPT, [f"logging.output_dir={tmp_path / 'afile' / 'run'}"])
    assert e.field == "logging.output_dir" and f"{tmp_path / 'afile'} is a file, not a directory" in e.hint


# ------------------------------------------------------------ checkpoint.resume


def _resume(tmp_path, target) -> list[str]:
    return [f"logging.output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"checkpoint.resume={target}"]


def test_resume_of_a_missing_path_is_refused_naming_the_field(tmp_path):
    e = _refused(GPT, _resume(tmp_path, "/nowhere"))
    assert str(e) == ("config error: checkpoint.resume='/nowhere': does not exist; name a step_NNNNNNNN "
                      "directory, or use auto (the newest under checkpoint.dir) or none (start fresh)")


def test_resume_of_a_directory_that_is_no_checkpoint_is_refused(tmp_path):
    (tmp_path / "other").mkdir()
    e = _refused(GPT, _resume(tmp_path, tmp_path / "other"))
    assert e.field == "checkpoint.resume" and e.hint.startswith("is not a checkpoint directory; name a step_")


def test_resume_of_a_checkpoint_root_points_at_its_newest_step(tmp_path):
    for step in (5, 10):
        (tmp_path / "ckpt" / layout.step_dir_name(step)).mkdir(parents=True)
    e = _refused(GPT, _resume(tmp_path, tmp_path / "ckpt"))
    assert e.field == "checkpoint.resume" and f"(e.g. {tmp_path / 'ckpt' / 'step_00000010'})" in e.hint


def test_resume_of_a_step_directory_passes_validation(tmp_path):
    (tmp_path / "ckpt" / layout.step_dir_name(5)).mkdir(parents=True)
    _validate(GPT, _resume(tmp_path, tmp_path / "ckpt" / "step_00000005"))  # its contents are verified on load


# ------------------------------------------------------------ dit.eval_resolutions


@pytest.mark.parametrize("resolutions,said", [("[]", True), ("[[16,16]]", False)])
def test_dit_without_eval_resolutions_says_evaluation_is_off(resolutions, said, caplog, monkeypatch):
    from megascale_omni.demo import dit_eval

    monkeypatch.setattr(dit_eval, "is_loss_rank", lambda: True)
    cfg = from_dict(JobConfig, apply_overrides(load_yaml("examples/dit/tiny_cpu.yaml"),
                                               [f"dit.eval_resolutions={resolutions}"]))
    with caplog.at_level(logging.INFO, logger=dit_eval.__name__):
        dit_eval.DitColorEvaluator(cfg, None, None, None, None)
    lines = [r.getMessage() for r in caplog.records if r.name == dit_eval.__name__]
    assert lines == (["evaluation: off (dit.eval_resolutions is empty; list [height, width] sizes to sample)"]
                     if said else [])
