"""A Trainer whose start-up fails part-way tears down what it had built.

Without it, a bad ``checkpoint.resume`` left the process groups and workers
to interpreter exit, which could abort the worker (SIGABRT) instead of the
documented exit code 4.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megascale_omni.checkpoint.errors import CheckpointError
from megascale_omni.entry import parse_for_family
from megascale_omni.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


def test_a_failed_resume_destroys_the_process_groups_it_started(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    # A step directory passes validation; its missing commit marker fails the resume after start-up began.
    broken = tmp_path / "elsewhere" / "step_00000005"
    broken.mkdir(parents=True)
    cfg, family = parse_for_family("gpt", [
        "--config", "examples/gpt/tiny.yaml", f"logging.output_dir={tmp_path}",
        f"checkpoint.dir={tmp_path}/ckpt", f"checkpoint.resume={broken}", "logging.tensorboard=false",
    ], world_size=1)
    try:
        with pytest.raises(CheckpointError, match="is broken: no commit.json"):
            Trainer(cfg, family)
        assert not dist.is_initialized()
        assert not mpu.model_parallel_is_initialized()
    finally:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)
        if dist.is_initialized():  # the assertion failed: leave no group behind for other tests
            dist.destroy_process_group()
