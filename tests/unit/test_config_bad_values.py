"""Bad config values are rejected before anything starts, each naming the
field, the value and the fix (a matrix of the settings that used to train
until they failed, or silently did something else)."""

from __future__ import annotations

import pytest
import torch

from megascale_omni.config import ConfigError, JobConfig, apply_overrides, from_dict, load_yaml
from megascale_omni.tasks.registry import get_family

BASE = "examples/gpt/tiny.yaml"

# (override, field named in the message, fragment of the hint)
BAD_VALUES = [
    ("train.lr=.nan", "train.lr", "finite"),
    ("train.lr=.inf", "train.lr", "finite"),
    ("train.clip_grad=nan", "train.clip_grad", "finite"),
    ("train.adam_beta1=1.0", "train.adam_beta1", "[0, 1)"),
    ("train.adam_beta2=-0.1", "train.adam_beta2", "[0, 1)"),
    ("train.adam_eps=-1e-8", "train.adam_eps", "> 0"),
    ("train.weight_decay=-0.1", "train.weight_decay", ">= 0"),
    ("train.eval_samples=-1", "train.eval_samples", ">= 0"),
    ("train.seed=-1", "train.seed", "in [0, 2147483648)"),
    ("train.seed=2147483648", "train.seed", "in [0, 2147483648)"),
    ("model.init_method_std=-0.02", "model.init_method_std", ">= 0"),
    ("model.num_query_groups=0", "model.num_query_groups", "> 0"),
    ("model.num_query_groups=-2", "model.num_query_groups", "> 0"),
    ("model.ffn_hidden_size=-4", "model.ffn_hidden_size", "> 0"),
    ("model.seq_length=100000000", "model.seq_length", "in (0, 1048576]"),
    ("model.vocab_size=1000000000", "model.vocab_size", "in [0, 16777216]"),
    ("model.vocab_size=0", "model.vocab_size", "> 0 for the gpt family"),
    ("parallel.cp=0", "parallel.cp", "> 0"),
    ("parallel.ddp_bucket_size=-5", "parallel.ddp_bucket_size", "> 0"),
    ("parallel.overlap_param_gather=true", "parallel.overlap_param_gather", "use_distributed_optimizer=true"),
    ("data.max_bad_sample_fraction=1.5", "data.max_bad_sample_fraction", "in [0, 1]"),
    ("control.tcp_port=70000", "control.tcp_port", "in [0, 65535] (0 = any free port) or null"),
    ("logging.memory_fraction_cap=2", "logging.memory_fraction_cap", "in [0, 1] (0 = no cap)"),
    ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by", "> 0"),
    ("vision.projector_hidden_size=-1", "vision.projector_hidden_size", "> 0"),
    ("vision.patch_size=64", "vision.patch_size", "<= vision.image_size=32"),
    ("dit.ema_decay=1.5", "dit.ema_decay", "[0, 1)"),
    ("control.pause_poll_s=nan", "control.pause_poll_s", "finite"),
    ("checkpoint.interval_minutes=inf", "checkpoint.interval_minutes", "finite"),
    ("logging.straggler_factor=1.0", "logging.straggler_factor", "> 1"),
    ("logging.output_dir=''", "logging.output_dir", "directory"),
    ("checkpoint.interval=5", "checkpoint.interval", "needs checkpoint.dir"),
    ("checkpoint.resume=runs/old/checkpoints", "checkpoint.resume", "needs checkpoint.dir"),
]


@pytest.mark.parametrize("override,field,hint", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_value_names_field_value_and_fix(override, field, hint):
    with pytest.raises(ConfigError) as e:
        from_dict(JobConfig, apply_overrides(load_yaml(BASE), [override]))
    assert e.value.field == field and hint in e.value.hint, str(e.value)
    assert str(e.value).startswith(f"config error: {field}=")


def test_odd_rope_head_dim_is_rejected():
    # hidden 60 / 4 heads = 15 channels per head: rope rotates pairs.
    raw = apply_overrides(load_yaml(BASE), ["model.position_embedding_type=rope", "model.hidden_size=60"])
    with pytest.raises(ConfigError, match="must be even") as e:
        from_dict(JobConfig, raw)
    assert e.value.field == "model.hidden_size"


@pytest.mark.parametrize("what", ["output_dir", "checkpoint_dir"])
def test_paths_of_the_wrong_kind_are_rejected(tmp_path, what):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    overrides = {
        "output_dir": [f"logging.output_dir={a_file}"],
        "checkpoint_dir": [f"checkpoint.dir={a_file}"],
    }[what]
    cfg = from_dict(JobConfig, apply_overrides(load_yaml(BASE), overrides))
    with pytest.raises(ConfigError) as e:
        get_family("gpt").validate(cfg, 1)
    assert {"output_dir": "logging.output_dir", "checkpoint_dir": "checkpoint.dir"}[what] == e.value.field


@pytest.mark.parametrize("content,hint", [
    (b"", "is empty"),
    (b"# only a comment\n", "is empty"),
    (b"train:\n  steps: 3\n  steps: 4\n", "'steps' appears twice in one section (lines 2 and 3)"),
    (b"train:\n  steps: 3\ntrain:\n  lr: 1.0\n", "'train' appears twice"),
    (b"train:\n  lr: 1e-3 \xff\xfe\n", "is not UTF-8"),
    (b"- a\n- b\n", "mapping of sections"),
    (b"train: [1, 2\n", "not valid YAML at line"),
])
def test_bad_yaml_files(tmp_path, content, hint):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert e.value.field == "--config" and hint in e.value.hint, str(e.value)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a host without CUDA")
def test_cuda_device_on_a_host_without_cuda_is_a_config_error():
    from megascale_omni.platform.device import init_platform

    with pytest.raises(ConfigError) as e:
        init_platform("cuda")
    assert e.value.field == "platform.device" and "CUDA is not available" in e.value.hint
    assert init_platform("cpu").device.type == "cpu" and init_platform("auto").backend == "gloo"


def test_overlap_grad_reduce_resolves_and_wires_megatrons_sync_hooks():
    """Auto is Megatron-LM's GPU default (on with CUDA and DP > 1); when on,
    DDP reduces buckets during backward and the schedules get the no-sync /
    start-sync hooks (tests/dist/test_layout_equivalence.py shows DP2 with it
    equals one process)."""
    from megascale_omni.config import ParallelConfig
    from megascale_omni.models.standalone import build_model, one_process
    from megascale_omni.training.optimizer import overlaps_grad_reduce, wrap_ddp

    auto = ParallelConfig()
    assert overlaps_grad_reduce(auto, cuda=True, dp=8) and not overlaps_grad_reduce(auto, cuda=True, dp=1)
    assert not overlaps_grad_reduce(auto, cuda=False, dp=8)
    assert overlaps_grad_reduce(ParallelConfig(overlap_grad_reduce=True), cuda=False, dp=2)
    assert not overlaps_grad_reduce(ParallelConfig(overlap_grad_reduce=False), cuda=True, dp=8)
    cfg = from_dict(JobConfig, load_yaml(BASE))
    with one_process(seed=0):
        model = build_model(cfg, cfg.model.padded_vocab_size(cfg.model.vocab_size))
        [ddp] = wrap_ddp([model], model.config, cfg.parallel, overlap=True)
        assert ddp.ddp_config.overlap_grad_reduce
        assert model.config.no_sync_func == ddp.no_sync and model.config.grad_sync_func == ddp.start_grad_sync


def test_overlap_param_gather_resolves_and_leaves_the_gather_to_the_forward():
    """Auto is Megatron-LM's GPU default (on with CUDA, the distributed
    optimizer and DP > 1); setting it turns an unset overlap_grad_reduce on.
    When on, DDP carries it and ``ddp_bucket_size`` (so the distributed
    optimizer's ``step()`` does not gather) and megatron's forward pre-hooks
    are registered; :class:`ParamGather` turns them off when it completes the
    gather and on again after the next update. tests/dist/test_param_gather.py
    shows DP2 with it equals one process."""
    from megascale_omni.config import ParallelConfig
    from megascale_omni.models.standalone import build_model, one_process
    from megascale_omni.training.optimizer import build_optimizer, overlaps_grad_reduce, overlaps_param_gather, wrap_ddp
    from megascale_omni.training.param_gather import ParamGather

    distopt = ParallelConfig(use_distributed_optimizer=True)
    assert overlaps_param_gather(distopt, cuda=True, dp=8)
    assert not overlaps_param_gather(distopt, cuda=True, dp=1) and not overlaps_param_gather(distopt, cuda=False, dp=8)
    assert not overlaps_param_gather(ParallelConfig(), cuda=True, dp=8)
    assert not overlaps_param_gather(ParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False),
                                     cuda=True, dp=8)
    explicit = ParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True, ddp_bucket_size=20000)
    assert overlaps_param_gather(explicit, cuda=False, dp=2) and overlaps_grad_reduce(explicit, cuda=False, dp=2)
    cfg = from_dict(JobConfig, apply_overrides(load_yaml(BASE), ["parallel.use_distributed_optimizer=true",
                                                                 "parallel.overlap_param_gather=true",
                                                                 "parallel.ddp_bucket_size=20000"]))
    with one_process(seed=0):
        model = build_model(cfg, cfg.model.padded_vocab_size(cfg.model.vocab_size))
        [ddp] = wrap_ddp([model], model.config, cfg.parallel, overlap=True, overlap_gather=True)
        assert ddp.ddp_config.overlap_param_gather and ddp.ddp_config.bucket_size == 20000
        assert len(ddp.bucket_groups) == 9 and ddp.remove_forward_pre_hook_handles
        optimizer, _ = build_optimizer([ddp], cfg.train, cfg.parallel, torch.float32)
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            assert opt.ddp_config.overlap_param_gather and opt.config.overlap_param_gather
        gather = ParamGather([ddp], overlap=True, serves_peers=False)
        gather.step_done(updated=True)
        assert gather.pending and ddp.remove_forward_pre_hook_handles
        gather.sync()
        assert not gather.pending and not ddp.remove_forward_pre_hook_handles
        gather.step_done(updated=True)
        assert gather.pending and ddp.remove_forward_pre_hook_handles
        # Elastic jobs: no pre-hooks; the gather starts after the step and completes at sync().
        elastic = ParamGather([ddp], overlap=True, serves_peers=True)
        assert not ddp.remove_forward_pre_hook_handles
        elastic.step_done(updated=True)
        assert elastic.pending and all(g.param_gather_handle is not None for g in ddp.bucket_groups)
        elastic.sync()
        assert not elastic.pending and all(g.param_gather_handle is None for g in ddp.bucket_groups)


# Context parallelism cuts every sequence into 2*cp equal chunks (world size 2: cp=2).
CP_BAD = [
    (["parallel.cp=2", "model.seq_length=30"], "model.seq_length", "multiple of 4"),
    (["parallel.cp=2", "data.pad_to_multiple_of=6"], "data.pad_to_multiple_of", "multiple of 2*parallel.cp=4"),
    # Samples padded to 8 in rows of 36: the padding tail (36 - 8k) still splits into 4 chunks; 34 does not.
    (["parallel.cp=2", "data.pad_to_multiple_of=8", "model.seq_length=34"], "model.seq_length", "multiple of 4"),
    (["parallel.cp=2", "model.attention_dropout=0.1"], "model.attention_dropout", "no attention dropout"),
    (["data.pad_to_multiple_of=-1"], "data.pad_to_multiple_of", ">= 0"),
]


@pytest.mark.parametrize("overrides,field,hint", CP_BAD, ids=[" ".join(c[0]) for c in CP_BAD])
def test_context_parallel_settings_are_checked_before_start(overrides, field, hint):
    with pytest.raises(ConfigError) as e:
        cfg = from_dict(JobConfig, apply_overrides(load_yaml(BASE), overrides))
        get_family(cfg.model.family).validate(cfg, world_size=2)
    assert e.value.field == field and hint in e.value.hint, str(e.value)


def test_default_sample_padding_serves_cp_up_to_4_and_larger_cp_must_choose_one():
    """``data.pad_to_multiple_of: 0`` is 8 at every layout (the plan must not
    follow the layout); LLaVA at cp=8 needs 16 and is told to set it."""
    from megascale_omni.config.validate import DEFAULT_PAD_MULTIPLE, sequence_multiple

    llava = "examples/llava/tiny_cpu.yaml"
    for cp in (1, 2, 4):
        cfg = from_dict(JobConfig, apply_overrides(load_yaml(llava), [f"parallel.cp={cp}"]))
        assert sequence_multiple(cfg) == DEFAULT_PAD_MULTIPLE == 8
        get_family("llava").validate(cfg, world_size=cp)
    cfg = from_dict(JobConfig, apply_overrides(load_yaml(llava), ["parallel.cp=8"]))
    with pytest.raises(ConfigError) as e:
        get_family("llava").validate(cfg, world_size=8)
    assert e.value.field == "data.pad_to_multiple_of" and "set data.pad_to_multiple_of=16" in e.value.hint
    assert "\n" not in str(e.value)
    cfg = from_dict(JobConfig, apply_overrides(load_yaml(llava), ["parallel.cp=8", "data.pad_to_multiple_of=16"]))
    get_family("llava").validate(cfg, world_size=8)
    assert sequence_multiple(cfg) == 16
    # GPT rows are not padded: its cp=8 needs no padding setting.
    get_family("gpt").validate(from_dict(JobConfig, apply_overrides(load_yaml(BASE), ["parallel.cp=8"])), world_size=8)


def test_every_numeric_field_of_every_section_declares_its_range():
    """Ranges live in the field declarations (config/constraints.py): a new
    numeric field without one fails here, so it cannot silently accept
    negative sizes or probabilities above 1."""
    import dataclasses
    import typing

    from megascale_omni.config import schema
    from megascale_omni.config.constraints import declared_bounds

    # Fields whose every value is meaningful (signed layer indices, a mean) or
    # checked against another field in __post_init__.
    free = {"VisionConfig.feature_layer", "ParallelConfig.vpp", "DitConfig.logit_mean"}
    missing = []
    for section in dataclasses.fields(schema.JobConfig):
        cls = section.type if isinstance(section.type, type) else getattr(schema, str(section.type))
        hints = typing.get_type_hints(cls)
        bounds = declared_bounds(cls)
        for f in dataclasses.fields(cls):
            base = {a for a in typing.get_args(hints[f.name]) if a is not type(None)} or {hints[f.name]}
            if base <= {int, float} and f.name not in bounds and f"{cls.__name__}.{f.name}" not in free:
                missing.append(f"{section.name}.{f.name}")
    assert not missing, f"numeric config fields without a declared range: {missing}"
