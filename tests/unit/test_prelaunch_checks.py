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
def test_dit_without_eval_resolutions_says_evaluation_is_off(resolutions, said, caplog):
    from megascale_omni.demo import dit_eval

    cfg = from_dict(JobConfig, apply_overrides(load_yaml("examples/dit/tiny_cpu.yaml"),
                                               [f"dit.eval_resolutions={resolutions}"]))
    with caplog.at_level(logging.INFO, logger=dit_eval.__name__):
        dit_eval.DitColorEvaluator(cfg, None, None, None, None)
    lines = [r.getMessage() for r in caplog.records if r.name == dit_eval.__name__]
    assert lines == (["evaluation: off (dit.eval_resolutions is empty; list [height, width] sizes to sample)"]
                     if said else [])


# ------------------------------------------------------------ parallel.pipeline_profile

LLAVA_PP = "examples/llava/pp4_vit_heavy.yaml"


def _profile(tmp_path, **seconds) -> str:
    import json

    from megascale_omni.config import load_job_config
    from megascale_omni.parallel.pipeline_cost import PROFILE_VERSION, llava_cost_model

    cfg = load_job_config(["--config", LLAVA_PP])
    times = {"embedding": 0.001, "lm_layer": 0.02, "output": 0.002, "vision_per_image": 0.003,
             "projector_per_image": 0.0001, **seconds}
    path = tmp_path / "profile.json"
    # json.dumps writes NaN and Infinity as json.load reads them.
    path.write_text(json.dumps({"version": PROFILE_VERSION, "shape": llava_cost_model(cfg).shape, "seconds": times}))
    return str(path)


@pytest.mark.parametrize("value,shown", [("fast", "'fast'"), (float("nan"), "nan"), (float("inf"), "inf"),
                                         (-0.5, "-0.5"), (True, "True"), ([0.1], "[0.1]")])
def test_profile_time_that_is_no_time_names_the_entry(tmp_path, value, shown):
    path = _profile(tmp_path, lm_layer=value)
    e = _refused(LLAVA_PP, [f"parallel.pipeline_profile={path}"], world_size=4)
    assert e.field == "parallel.pipeline_profile" and e.value == path
    assert e.hint == (f"seconds.lm_layer={shown} is not a measured time (finite seconds >= 0); "
                      "re-run tools/profile_layers.py or fix that entry")


@pytest.mark.parametrize("content,hint", [
    (None, "file not found"),
    ("{not json", "is not a profile written by tools/profile_layers.py"),
    ('{"version": 1, "shape": [], "seconds": {}}', "is not a profile written by tools/profile_layers.py"),
])
def test_missing_or_garbage_profile_is_refused_by_validate(tmp_path, content, hint):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    e = _refused(LLAVA_PP, [f"parallel.pipeline_profile={path}"], world_size=4)
    assert e.field == "parallel.pipeline_profile" and hint in e.hint


def test_a_good_profile_passes_validate(tmp_path):
    _validate(LLAVA_PP, [f"parallel.pipeline_profile={_profile(tmp_path)}"], world_size=4)


def test_plan_pipeline_tool_names_a_nan_profile_entry(tmp_path, monkeypatch, capsys):
    import importlib.util
    import sys

    from megascale_omni.entry import run_cli

    spec = importlib.util.spec_from_file_location("tool_plan_pipeline", "tools/plan_pipeline.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    path = _profile(tmp_path, vision_per_image=float("nan"))
    monkeypatch.setattr(sys, "argv", ["plan_pipeline.py", "--config", LLAVA_PP, f"parallel.pipeline_profile={path}"])
    with pytest.raises(SystemExit) as exited:
        run_cli(tool.main)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"config error: parallel.pipeline_profile='{path}': seconds.vision_per_image=nan is not a measured time "
        "(finite seconds >= 0); re-run tools/profile_layers.py or fix that entry")


def test_validating_a_profile_loads_no_megatron(tmp_path):
    """omni-run validates before any worker: reading the profile goes through
    the planner's pure modules, not megatron's parallel state."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from megascale_omni.config import load_job_config\n"
        "from megascale_omni.tasks.registry import get_family\n"
        f"cfg = load_job_config(['--config', {LLAVA_PP!r}, 'parallel.pipeline_profile={_profile(tmp_path)}'])\n"
        "get_family('llava').validate(cfg, 4)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch')))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


# ------------------------------------------------------------ LLaVA / DiT inputs (data, tokenizer, fit)

LLAVA = "examples/llava/tiny_cpu.yaml"
DIT = "examples/dit/tiny_cpu.yaml"


def _dataset(tmp_path, words=("red", "circle")):
    """A dataset directory as far as validation looks: train/ and a word tokenizer."""
    from megascale_omni.data.tokenizer import build_word_tokenizer

    root = tmp_path / "ds"
    (root / "train").mkdir(parents=True)
    build_word_tokenizer(list(words), root / "tokenizer.json")
    return root


@pytest.mark.parametrize("base", [LLAVA, DIT])
def test_data_path_that_does_not_exist_is_refused_up_front(tmp_path, base):
    e = _refused(base, [f"data.path={tmp_path / 'nowhere'}"])
    assert e.field == "data.path" and e.hint.startswith("does not exist; build a dataset there with ")


@pytest.mark.parametrize("base", [LLAVA, DIT])
def test_data_path_without_a_train_split_is_refused_up_front(tmp_path, base):
    e = _refused(base, [f"data.path={tmp_path}"])
    assert e.field == "data.path" and e.hint.startswith("has no train/ split")


@pytest.mark.parametrize("base", [LLAVA, DIT])
def test_data_tokenizer_that_does_not_exist_is_refused_up_front(tmp_path, base):
    e = _refused(base, [f"data.tokenizer={tmp_path / 'tok.json'}"])
    assert str(e) == (f"config error: data.tokenizer='{tmp_path / 'tok.json'}': does not exist; "
                      "point it at a tokenizer.json or directory")


def test_image_processor_that_does_not_exist_is_refused_up_front(tmp_path):
    e = _refused(LLAVA, ["data.image_mode=resize_crop", f"data.image_processor={tmp_path / 'pre.json'}"])
    assert e.field == "data.image_processor" and e.hint.startswith("does not exist;")


def test_vocab_below_the_default_datasets_tokenizer_is_refused_without_building_it(tmp_path):
    e = _refused(LLAVA, ["model.vocab_size=10", "data.default_num_train=7919"])  # a size never built
    assert str(e) == ("config error: model.vocab_size=10: is smaller than the tokenizer's 76; "
                      "set 0 to use the tokenizer's")
    _validate(LLAVA, ["model.vocab_size=76"])


def test_default_vocab_is_the_built_shapes_tokenizers(tmp_path):
    from megascale_omni.data.tokenizer import build_word_tokenizer
    from megascale_omni.demo.vocabulary import vocabulary, word_tokenizer_size

    from megascale_omni.config import load_job_config

    with_clips = load_job_config(["--config", LLAVA])  # the demo config: a fifth of the set is clips
    image_only = load_job_config(["--config", LLAVA, "data.default_video_fraction=0"])
    assert word_tokenizer_size(with_clips) == build_word_tokenizer(vocabulary(), tmp_path / "t.json").vocab_size == 76
    assert word_tokenizer_size(image_only) == build_word_tokenizer(vocabulary(clips=False),
                                                                   tmp_path / "i.json").vocab_size == 65


@pytest.mark.parametrize("fmt", ["words", "chat"])
def test_vocab_below_a_dataset_tokenizer_is_refused(tmp_path, fmt):
    root = _dataset(tmp_path)  # 5 special tokens + 2 words
    e = _refused(LLAVA, [f"data.path={root}", f"data.format={fmt}", "model.vocab_size=6"])
    assert e.field == "model.vocab_size" and e.hint.startswith("is smaller than the tokenizer's 7;")
    _validate(LLAVA, [f"data.path={root}", f"data.format={fmt}", "model.vocab_size=7"])


def test_chat_format_needs_a_tokenizer_directory(tmp_path):
    root = _dataset(tmp_path)
    tok = tmp_path / "tok" / "tokenizer.json"  # its directory does not exist
    e = _refused(LLAVA, [f"data.path={root}", "data.format=chat", f"data.tokenizer={tok}"])
    assert e.field == "data.tokenizer"


def test_seq_length_without_room_for_one_image_is_refused(tmp_path):
    # 32-pixel images in 8-pixel patches: 16 tokens each.
    e = _refused(LLAVA, ["model.seq_length=16"])
    assert str(e) == ("config error: model.seq_length=16: has no room for one image (16 tokens: "
                      "vision.tokens_per_image=16) and its text, so every sample with an image would be excluded; "
                      "use e.g. 64, or a smaller vision.image_size")
    _validate(LLAVA, ["model.seq_length=17"])


def test_seq_length_counts_the_fewest_anyres_views(tmp_path):
    import json

    root = _dataset(tmp_path)
    # Smallest grid 32x64: two 32-pixel tiles plus the overview, 3 views of 16 tokens.
    (root / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "image_grid_pinpoints": [[64, 64], [32, 64], [96, 32]]}))
    args = [f"data.path={root}", "data.image_mode=anyres"]
    e = _refused(LLAVA, [*args, "model.seq_length=48"])
    assert e.field == "model.seq_length" and "(48 tokens: 3 anyres views x 16)" in e.hint
    _validate(LLAVA, [*args, "model.seq_length=64"])
