"""Save triggers and their per-step agreement (one-rank gloo group, in-process)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch.distributed as dist

from megascale_omni.checkpoint.triggers import Triggers
from tests.launcher import free_port


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_interval_steps(group):
    t = Triggers(interval_steps=5, interval_minutes=0, group=group)
    reasons = [t.agree(step, writer_busy=False).save_reason for step in range(1, 11)]
    assert reasons == ["", "", "", "", "interval", "", "", "", "", "interval"]


def test_wall_clock_timer_fires_and_rearms(group):
    t = Triggers(interval_steps=0, interval_minutes=1e-9, group=group)
    assert t.agree(1, writer_busy=False).save_reason == "timer"
    t.interval_s = 3600.0
    t.saved()
    assert t.agree(2, writer_busy=False).save_reason == ""


def test_request_from_another_thread_is_taken_once(group):
    t = Triggers(interval_steps=0, interval_minutes=0, group=group)
    th = threading.Thread(target=t.request, args=("control",))
    th.start()
    th.join()
    assert t.agree(1, writer_busy=False).save_reason == "control"
    assert t.agree(2, writer_busy=False).save_reason == ""


def test_signals_sigusr1_saves_sigterm_saves_and_stops(group):
    t = Triggers(interval_steps=0, interval_minutes=0, group=group)
    t.install_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        d = t.agree(1, writer_busy=True)
        assert (d.save_reason, d.stop, d.writer_busy) == ("sigusr1", False, True)
        assert t.agree(2, writer_busy=False).save_reason == ""
        os.kill(os.getpid(), signal.SIGTERM)
        d = t.agree(3, writer_busy=False)
        assert (d.save_reason, d.stop) == ("sigterm", True)
    finally:
        t.restore_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_outranks_other_reasons(group):
    t = Triggers(interval_steps=1, interval_minutes=0, group=group)
    t.request("api")
    t._on_sigterm(signal.SIGTERM, None)
    assert t.agree(1, writer_busy=False).save_reason == "sigterm"


def test_a_group_that_does_not_write_skips_saves_and_rearms_its_timer(group, tmp_path, caplog):
    """Elastic: a replica group that is not the writer saves nothing; a due
    timer is re-armed, so it is not reported again at every step."""
    import logging
    from types import SimpleNamespace

    from megascale_omni.checkpoint.manager import Checkpointer
    from megascale_omni.config import CheckpointConfig

    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt"), interval_minutes=1.0), str(tmp_path), shared=True)
    try:
        ckpt.writes = lambda: False
        ckpt.triggers._last_save -= 120.0  # the 1-minute timer is due
        trainer = SimpleNamespace(step=7)
        with caplog.at_level(logging.INFO, logger="megascale_omni.checkpoint.manager"):
            assert ckpt.at_step_boundary(trainer) is False
            trainer.step = 8
            assert ckpt.at_step_boundary(trainer) is False
        assert caplog.text.count("another replica group writes") == 1
        assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    finally:
        ckpt.close()
