"""Async saves reuse their host staging buffers and megatron's cached save
plan, and write the same checkpoint as a synchronous save of the same state."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

from megascale_omni.checkpoint import layout
from megascale_omni.checkpoint.manager import Checkpointer
from megascale_omni.checkpoint.staging import written_tensors
from megascale_omni.entry import parse_for_family
from megascale_omni.training.trainer import Trainer

pytestmark = pytest.mark.timeout(180)

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    cfg, family = parse_for_family("gpt", [
        "--config", "examples/gpt/tiny.yaml", f"logging.output_dir={tmp_path / 'async'}",
        "logging.tensorboard=false", "logging.progress_bar=false", "train.steps=6",
        f"checkpoint.dir={tmp_path / 'async' / 'ckpt'}", "checkpoint.interval=2", "checkpoint.keep_last=5",
        "checkpoint.save_at_end=false", "checkpoint.async_save=true",
    ], world_size=1)
    t = Trainer(cfg, family)
    yield t
    t.close()
    for var in ENV:
        os.environ.pop(var, None)


def _loaded(state, path):
    """Every tensor of the checkpoint at ``path``, by flattened key (copies:
    megatron loads into the template's tensors, here the live ones)."""
    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        elif isinstance(v, torch.Tensor):
            out[prefix] = v.clone()

    walk("", dist_checkpointing.load(state.sharded_state_dict(is_loading=True), str(path)))
    return out


def test_async_saves_reuse_buffers_and_plan_and_match_a_sync_save(trainer, tmp_path, monkeypatch):
    plans = {"local": 0, "global": 0}
    create_local, create_global = MCoreSavePlanner.create_local_plan, MCoreSavePlanner.create_global_plan

    def count(kind, fn):
        def wrapped(self, *args):
            plans[kind] += 1
            return fn(self, *args)
        return wrapped

    monkeypatch.setattr(MCoreSavePlanner, "create_local_plan", count("local", create_local))
    monkeypatch.setattr(MCoreSavePlanner, "create_global_plan", count("global", create_global))
    ckpt = trainer.checkpointer
    allocations, reserved = [], []
    save = ckpt.save
    monkeypatch.setattr(ckpt, "save", lambda *a, **k: (
        reserved.append(ckpt._reserved), save(*a, **k), allocations.append(ckpt.staging.allocations)))

    trainer.train()
    ckpt.wait()

    written = len(written_tensors(trainer.state.sharded_state_dict()))
    # The buffers were reserved after step 1, one per written tensor; no save allocates.
    assert reserved == [True] * 3 and allocations == [written] * 3
    # megatron plans the first save, reuses the local plan from the second
    # (whose global plan validates the cache) and reuses both for the third.
    assert plans == {"local": 1, "global": 2}
    assert ckpt.strategy.plan_cached and ckpt.strategy.builds == 1
    assert [s["step"] for s in ckpt.saves] == [2, 4, 6]
    assert set(ckpt.saves[-1]["phases"]) == {"wait", "target", "state_dict", "split", "host_copy", "plan"}

    # The same state saved by the synchronous path (no staging, a fresh strategy).
    sync_cfg = dataclasses.replace(trainer.cfg.checkpoint, dir=str(tmp_path / "sync"), async_save=False)
    sync = Checkpointer(sync_cfg, str(tmp_path / "sync_run"))
    try:
        sync.save(trainer.state, "api")
        assert sync.staging.allocations == 0
    finally:
        sync.close()
    async_dir = tmp_path / "async" / "ckpt" / layout.step_dir_name(6)
    sync_dir = tmp_path / "sync" / layout.step_dir_name(6)
    got, want = _loaded(trainer.state, async_dir), _loaded(trainer.state, sync_dir)
    assert sorted(got) == sorted(want) and len(got) > 10
    for key in want:
        assert torch.equal(got[key], want[key]), key
    for name in ("__0_0.distcp", "common.pt"):
        assert (async_dir / name).read_bytes() == (sync_dir / name).read_bytes(), name
    # Buffers were reused, yet each save holds its own step's weights.
    earlier = _loaded(trainer.state, tmp_path / "async" / "ckpt" / layout.step_dir_name(4))
    assert not torch.equal(earlier[".model.embedding.word_embeddings.weight"],
                           got[".model.embedding.word_embeddings.weight"])
