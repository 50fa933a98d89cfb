"""An async save waits for the previous save's files, not for its commit
(rank 0's checksums, marker, replication and pruning): commits run in save
order behind training, pruning spares the save being written, and saving
a step again (the final save) still finds it committed."""

from __future__ import annotations

import os
import threading

import pytest

from megascale_omni.checkpoint import layout
from megascale_omni.entry import parse_for_family
from megascale_omni.training.trainer import Trainer

pytestmark = pytest.mark.timeout(180)

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_next_save_does_not_wait_for_the_previous_commit(tmp_path, monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    run = tmp_path / "run"
    cfg, family = parse_for_family("gpt", [
        "--config", "examples/gpt/tiny.yaml", f"logging.output_dir={run}", "logging.tensorboard=false",
        "logging.progress_bar=false", "train.steps=6", f"checkpoint.dir={run / 'ckpt'}", "checkpoint.interval=2",
        "checkpoint.keep_last=1", "checkpoint.save_at_end=true", "checkpoint.async_save=true",
    ], world_size=1)
    trainer = Trainer(cfg, family)
    ckpt = trainer.checkpointer
    # The commit of step 2 hangs until the save of step 4 has returned.
    release, hashed = threading.Event(), []
    write_commit = layout.write_commit

    def slow_commit(path, step, extra):
        if step == 2:
            assert release.wait(60), "the save of step 4 waited for the commit of step 2"
        hashed.append(step)
        return write_commit(path, step, extra)

    monkeypatch.setattr(layout, "write_commit", slow_commit)
    pending_at_return = {}
    save = ckpt.save

    def save_and_release(state, reason, wait=False):
        save(state, reason, wait=wait)
        pending_at_return[(state.step, reason)] = [step for step, commit in ckpt._commits if not commit.done()]
        if state.step == 4:
            release.set()

    monkeypatch.setattr(ckpt, "save", save_and_release)
    try:
        trainer.train()
        ckpt.wait()
    finally:
        trainer.close()
        for var in ENV:
            os.environ.pop(var, None)
    # Step 4's save returned while step 2's commit was still hashing.
    assert pending_at_return[(4, "interval")] == [2]
    # Commits ran in save order; the final save found step 6 committed and
    # did not save it again (or delete it while its commit ran).
    assert hashed == [2, 4, 6]
    assert [s["step"] for s in ckpt.saves] == [2, 4, 6]
    assert pending_at_return[(6, "end")] == []
    # keep_last=1: the older saves were pruned once newer ones committed; the newest is complete.
    tier = layout.scan_tier(run / "ckpt", "persistent")
    assert [(c.step, c.complete) for c in tier] == [(6, True)]
