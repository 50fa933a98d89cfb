"""Config loading and validation: every invalid setting exits 2 with one clear line."""

from __future__ import annotations

import sys

import pytest

from megascale_omni.config import (
    ConfigError,
    JobConfig,
    apply_overrides,
    from_dict,
    parse_job_config,
    validate_platform,
)
from megascale_omni.entry import parse_for_family, run_cli
from tests.launcher import run

CONFIG = "examples/gpt/tiny.yaml"


def _cli(overrides: list[str], world_size: int = 1, config: str | None = CONFIG):
    args = [sys.executable, "-m", "megascale_omni.smoke"]
    if config:
        args += ["--config", config]
    return run(args + overrides, timeout=180, env={"WORLD_SIZE": str(world_size), "RANK": "0"})


# (overrides, world size, expected fragments of the one-line message)
INVALID = {
    "world-not-divisible": (["parallel.tp=2", "parallel.pp=2"], 6, ["parallel", "world size 6", "tp*pp*cp=4"]),
    "heads-vs-tp": (["parallel.tp=3", "model.hidden_size=60", "model.num_attention_heads=4"], 3,
                    ["model.num_attention_heads=4", "divisible by parallel.tp=3"]),
    "ffn-vs-tp": (["parallel.tp=2", "model.ffn_hidden_size=99"], 2, ["model.ffn_hidden_size=99", "parallel.tp=2"]),
    "hidden-vs-heads": (["model.hidden_size=66"], 1, ["model.hidden_size=66", "num_attention_heads=4"]),
    "layers-vs-pp-vpp": (["parallel.pp=2", "parallel.vpp=3"], 2, ["model.num_layers=4", "pp*vpp=6"]),
    "layers-not-multiple": (["parallel.pp=3", "model.num_layers=4"], 3, ["model.num_layers=4", "pp*vpp=3"]),
    "global-batch": (["train.global_batch_size=6", "train.micro_batch_size=2"], 2,
                     ["train.global_batch_size=6", "micro_batch_size*dp = 2*2 = 4"]),
    "unknown-key": (["train.stpes=3"], 1, ["train.stpes", "unknown key", "did you mean train.steps"]),
    "unknown-section": (["trian.steps=3"], 1, ["trian", "unknown key"]),
    "wrong-type-int": (["train.steps=ten"], 1, ["train.steps='ten'", "must be an integer"]),
    "wrong-type-bool": (["parallel.use_distributed_optimizer=maybe"], 1,
                        ["parallel.use_distributed_optimizer='maybe'", "true or false"]),
    "wrong-choice": (["train.precision=fp8"], 1, ["train.precision='fp8'", "must be one of"]),
    "evaluator-of-another-family": (["train.evaluator=shapes"], 1,
                                    ["train.evaluator='shapes'", "model.family=gpt evaluates with one of",
                                     "'loss'"]),
    "eval-samples-type": (["train.eval_samples=many"], 1, ["train.eval_samples='many'", "must be an integer"]),
    "heal-transport": (["elastic.heal_transport=nccl"], 1,
                       ["elastic.heal_transport='nccl'", "must be one of 'http', 'pg'"]),
    "vpp-without-pp": (["parallel.vpp=2"], 1, ["parallel.vpp=2", "pp >= 2"]),
    "ddp-bucket-size": (["parallel.ddp_bucket_size=0"], 1, ["parallel.ddp_bucket_size=0", "must be > 0"]),
    "ddp-bucket-size-type": (["parallel.ddp_bucket_size=big"], 1, ["parallel.ddp_bucket_size='big'", "integer"]),
    "param-gather-without-distopt": (["parallel.overlap_param_gather=true"], 2,
                                     ["parallel.overlap_param_gather=True", "use_distributed_optimizer=true"]),
    "context-parallel": (["parallel.cp=2", "model.seq_length=30"], 2, ["model.seq_length=30", "multiple of 4"]),
    # Sequence parallelism splits each CP rank's seq_length / cp tokens over TP.
    "sequence-parallel-length": (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_length=33"], 2,
                                 ["model.seq_length=33", "divisible by parallel.tp=2", "use 32"]),
    "sequence-parallel-cp-length": (["parallel.tp=4", "parallel.cp=2", "parallel.sequence_parallel=true",
                                     "model.seq_length=36"], 8,
                                    ["model.seq_length=36", "parallel.tp*parallel.cp=8", "use 32"]),
    "vocab-multiple-vs-tp": (["parallel.tp=2", "model.make_vocab_size_divisible_by=3"], 2,
                             ["model.make_vocab_size_divisible_by=3", "parallel.tp=2"]),
    "bad-sample-fraction": (["data.max_bad_sample_fraction=1.5"], 1, ["data.max_bad_sample_fraction=1.5", "[0, 1]"]),
    "negative-data-workers": (["data.num_workers=-1"], 1, ["data.num_workers=-1", "must be >= 0"]),
    "no-prefetch": (["data.num_workers=1", "data.prefetch_steps=0"], 1, ["data.prefetch_steps=0", "must be > 0"]),
}

# Settings that are valid on GPU but not on this CPU-only host: rejected after
# the device is known, still before any process group starts.
CPU_ONLY_INVALID = {
    "memory-cap-on-cpu": (["logging.memory_fraction_cap=0.5"], ["logging.memory_fraction_cap=0.5", "CUDA"]),
}


def _in_process(overrides: list[str], world_size: int, capsys, cpu_checks: bool = False) -> str:
    """The entry point's parse + validate (+ the platform check on this CPU host)
    under run_cli, in this process: asserts exit 2 and returns stderr. The
    subprocess cases below prove the same path from the command line."""

    def main():
        cfg, _ = parse_for_family("gpt", ["--config", CONFIG, *overrides], world_size=world_size)
        if cpu_checks:
            validate_platform(cfg, cuda=False)

    with pytest.raises(SystemExit) as e:
        run_cli(main)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only rejections")
def test_cuda_only_setting_exits_2_on_cpu_from_the_command_line():
    overrides, fragments = CPU_ONLY_INVALID["memory-cap-on-cpu"]
    res = _cli(overrides)
    assert res.returncode == 2, res.output
    assert "Traceback" not in res.output
    last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("config error: ")
    for fragment in fragments:
        assert fragment in last, (fragment, last)


@pytest.mark.parametrize("name", list(CPU_ONLY_INVALID))
def test_cuda_only_setting_is_a_config_error_on_cpu(name, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    overrides, fragments = CPU_ONLY_INVALID[name]
    err = _in_process(overrides, 2 if "parallel.tp=2" in overrides else 1, capsys, cpu_checks=True)
    assert err.startswith("config error: ") and err.count("\n") == 1
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_bf16_is_accepted_on_cpu():
    """bf16 runs on CPU (slowly, for real: tests/e2e/test_bf16.py); only CUDA-only settings are refused."""
    cfg, _ = parse_for_family("gpt", ["--config", CONFIG, "train.precision=bf16"], world_size=1)
    validate_platform(cfg, cuda=False)
    assert cfg.train.precision == "bf16"


def test_invalid_setting_exits_2_from_the_command_line():
    overrides, world, fragments = INVALID["world-not-divisible"]
    res = _cli(overrides, world)
    assert res.returncode == 2, res.output
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("config error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_setting_exits_2_with_message(name, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    overrides, world, fragments = INVALID[name]
    err = _in_process(overrides, world, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("config error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_missing_config_file_exits_2(tmp_path):
    res = _cli([], config=str(tmp_path / "nope.yaml"))
    assert res.returncode == 2
    assert "file not found" in res.stderr and "nope.yaml" in res.stderr


def test_malformed_yaml_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1, 2\n")
    res = _cli([], config=str(bad))
    assert res.returncode == 2
    assert "not valid YAML" in res.stderr and "Traceback" not in res.output


def test_overrides_are_typed_yaml_scalars():
    cfg = parse_job_config(
        ["--config", CONFIG, "train.lr=3e-4", "parallel.vpp=null", "train.steps=7", "logging.tensorboard=false"]
    )
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.parallel.vpp is None and cfg.train.steps == 7 and cfg.logging.tensorboard is False


def test_int_is_accepted_for_float_but_bool_is_not_int():
    cfg = from_dict(JobConfig, {"train": {"lr": 1}})
    assert cfg.train.lr == 1.0
    with pytest.raises(ConfigError, match="train.steps"):
        from_dict(JobConfig, {"train": {"steps": True}})


def test_valid_layout_passes_for_matching_world_size():
    cfg = parse_job_config(["--config", CONFIG, "parallel.tp=2", "parallel.pp=2"], world_size=8)
    assert cfg.parallel.tp == 2 and cfg.parallel.pp == 2


def test_apply_overrides_rejects_missing_equals():
    with pytest.raises(ConfigError, match="section.field=value"):
        apply_overrides({}, ["train.steps"])


def test_checkpoint_dirs_follow_the_output_dir_placeholder():
    raw = {"logging": {"output_dir": "runs/a"},
           "checkpoint": {"dir": "{output_dir}/checkpoints", "local_dir": "/fast/{output_dir}"}}
    cfg = from_dict(JobConfig, raw)
    assert (cfg.checkpoint.dir, cfg.checkpoint.local_dir) == ("runs/a/checkpoints", "/fast/runs/a")
    moved = from_dict(JobConfig, apply_overrides(raw, ["logging.output_dir=runs/b"]))
    assert moved.checkpoint.dir == "runs/b/checkpoints"
    assert from_dict(JobConfig, apply_overrides(raw, ["checkpoint.dir=/ckpt"])).checkpoint.dir == "/ckpt"


@pytest.mark.parametrize("section,overrides,fragment", [
    ("vision", {"num_layers": 3, "feature_layer": -4}, "vision.feature_layer=-4"),
    ("vision", {"model_type": "siglip", "class_token": True}, "vision.class_token=True"),
    ("model", {"rotary_base": 5e5}, "model.position_embedding_type='learned_absolute'"),
    ("model", {"norm_epsilon": 0.0}, "model.norm_epsilon=0.0"),
])
def test_architecture_options_are_checked(section, overrides, fragment):
    with pytest.raises(ConfigError) as e:
        from_dict(JobConfig, {section: overrides})
    assert fragment in str(e.value)


def test_several_config_files_merge_field_by_field(tmp_path):
    from megascale_omni.config import load_job_config

    (tmp_path / "job.yaml").write_text("model: {num_layers: 6, hidden_size: 128}\ntrain: {steps: 7}\n")
    (tmp_path / "arch.yaml").write_text("model: {hidden_size: 64, activation: swiglu}\n")
    cfg = load_job_config(["--config", str(tmp_path / "job.yaml"), "--config", str(tmp_path / "arch.yaml"),
                           "model.num_layers=2"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.activation, cfg.train.steps) == (2, 64, "swiglu", 7)
