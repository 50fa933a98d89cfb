"""The checkpoint writer never forks the (multi-threaded) trainer: Python 3.12
deprecates that (DeprecationWarning), and a lock another thread holds at the
fork stays held in the child. Async saves hand their shared-memory buffers
to a spawned writer process; other writes run in this process."""

from __future__ import annotations

import os
import threading
import warnings

import pytest

from megascale_omni.checkpoint import layout
from megascale_omni.entry import parse_for_family
from megascale_omni.training.trainer import Trainer

pytestmark = pytest.mark.timeout(180)

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    cfg, family = parse_for_family("gpt", [
        "--config", "examples/gpt/tiny.yaml", f"logging.output_dir={tmp_path}", "logging.tensorboard=false",
        "logging.progress_bar=false", "train.steps=2", f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.save_at_end=false", "checkpoint.async_save=true",
    ], world_size=1)
    t = Trainer(cfg, family)
    yield t
    t.close()
    for var in ENV:
        os.environ.pop(var, None)


def test_saves_start_no_fork_and_warn_nothing(trainer, tmp_path, monkeypatch):
    files = trainer.checkpointer.writer.files
    assert files.start_method == "spawn" and len(files._workers) == 1
    assert all(proc.is_alive() for proc, _ in files._workers)  # started with the Checkpointer
    trainer.train()
    forks = []

    def no_fork():
        forks.append(threading.current_thread().name)
        raise AssertionError("os.fork called")

    monkeypatch.setattr(os, "fork", no_fork)
    state = trainer.state
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", RuntimeWarning)
        trainer.checkpointer.save(state, "async")  # staged buffers -> the writer process
        trainer.checkpointer.wait()
        state.step += 1
        trainer.checkpointer.save(state, "sync", wait=True)  # live tensors -> written in this process
    assert forks == []
    assert (files.handed_over, files.in_process) == (1, 1)
    committed = [c.step for c in layout.scan_tier(tmp_path / "ckpt", "persistent") if c.complete]
    assert committed == [2, 3]
    for c in layout.scan_tier(tmp_path / "ckpt", "persistent"):
        assert layout.verify(c) == []
