"""Async saves reuse their host staging buffers and megatron's cached save
plan, and write the same checkpoint as a synchronous save of the same state."""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

from megascale_omni.checkpoint import layout
from megascale_omni.checkpoint.manager import Checkpointer
from megascale_omni.checkpoint.staging import HostStaging, written_tensors
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


def _sharded(tensors, replica_id=0):
    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, replica_id=replica_id) for i, t in enumerate(tensors)}


@pytest.mark.parametrize("shm_free", [None, 16], ids=["shared-memory", "no-room-in-dev-shm"])
def test_host_staging_copies_into_the_same_buffers_and_skips_other_replicas(monkeypatch, shm_free):
    if shm_free is not None:  # /dev/shm too small: private buffers, same results
        real = os.statvfs
        monkeypatch.setattr(os, "statvfs", lambda p: real(p) if p != "/dev/shm" else
                            type("St", (), {"f_bavail": shm_free, "f_frsize": 1})())
    live = [torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)]
    staging = HostStaging(pin=False)
    staging.reserve(_sharded(live))
    first = _sharded(live)
    assert staging.stage(first) == 6 * 4 + 4 * 2 and staging.allocations == 2
    buffers = [first["t0"].data, first["t1"].data]
    assert all(b.is_shared() == (shm_free is None) for b in buffers)
    for b, t in zip(buffers, live):
        assert b.data_ptr() != t.data_ptr() and torch.equal(b, t)
    for t in live:
        t.add_(1)  # training moves on: the staged copy keeps the old values
    assert torch.equal(first["t0"].data, torch.arange(6.0).reshape(2, 3))
    second = _sharded(live)
    staging.stage(second)
    assert staging.allocations == 2 and second["t0"].data.data_ptr() == buffers[0].data_ptr()
    assert torch.equal(second["t0"].data, live[0]) and torch.equal(second["t1"].data, live[1])
    # Replicas another rank writes keep their live tensors and need no buffer.
    other = _sharded(live, replica_id=1)
    assert staging.stage(other) == 0 and other["t0"].data is live[0]


def test_saves_never_fork_the_trainer_and_warn_nothing(trainer, tmp_path, monkeypatch):
    """Python 3.12 deprecates forking a multi-threaded process (DeprecationWarning;
    a lock another thread holds at the fork stays held in the child). Async
    saves hand their shared-memory buffers to a spawned writer process; other
    writes run in this process. Neither forks."""
    files = trainer.checkpointer.writer.files
    assert files.start_method == "spawn" and files._workers == []  # started before the first async save
    forks = []

    def no_fork():
        forks.append(threading.current_thread().name)
        raise AssertionError("os.fork called")

    monkeypatch.setattr(os, "fork", no_fork)
    with warnings.catch_warnings():
        # Training itself raises megatron's unrelated deprecation warnings: fail on any about fork.
        for category in (DeprecationWarning, RuntimeWarning):
            warnings.filterwarnings("error", message=".*fork", category=category)
        trainer.train()  # async saves at steps 2, 4, 6: staged buffers -> the writer process
    assert len(files._workers) == 1 and files._workers[0][0].is_alive()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", RuntimeWarning)
        trainer.state.step += 1
        trainer.checkpointer.save(trainer.state, "async")
        trainer.checkpointer.wait()
        trainer.state.step += 1
        trainer.checkpointer.save(trainer.state, "sync", wait=True)  # live tensors: written in this process
    assert forks == []
    assert (files.handed_over, files.in_process) == (4, 1)
    saved = layout.scan_tier(tmp_path / "async" / "ckpt", "persistent")
    assert [c.step for c in saved if c.complete] == [2, 4, 6, 7, 8]
    assert all(layout.verify(c) == [] for c in saved)
