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


class _Clock:
    """A hand-driven monotonic clock, seconds."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ranks(n: int, clock: _Clock, coalesce_s: float = 60.0) -> list[Triggers]:
    return [Triggers(0, 0, None, signal_coalesce_s=coalesce_s, vote=lambda flags: flags, clock=clock)
            for _ in range(n)]


def _boundary(ranks: list[Triggers], step: int) -> list[str]:
    """One step boundary of an in-process job: every rank's flags, their
    element-wise maximum (the all-reduce), every rank's decision."""
    local = [t.local_flags(step, writer_busy=False) for t in ranks]
    voted = [max(column) for column in zip(*local)]
    reasons = [t.decide(step, flags, voted).save_reason for t, flags in zip(ranks, local)]
    assert len(set(reasons)) == 1, f"ranks disagree at step {step}: {reasons}"
    return reasons


def _run(ranks: list[Triggers], clock: _Clock, signals: dict[int, list[tuple[int, float]]], steps: int) -> list[int]:
    """Steps 1..steps, one second apart; ``signals[step]`` = (rank, seconds
    after that step's start) deliveries before the step's boundary. Returns
    the steps that saved."""
    saved = []
    for step in range(1, steps + 1):
        start = clock.now
        for rank, after in sorted(signals.get(step, []), key=lambda d: d[1]):
            clock.now = start + after
            ranks[rank]._on_sigusr1(signal.SIGUSR1, None)
        clock.now = start + 1.0
        if _boundary(ranks, step)[0]:
            saved.append(step)
    return saved


# The bad-input matrix of signal bursts: (deliveries per step, expected saving steps).
SIGNAL_BURSTS = {
    "one rank only": ({3: [(0, 0.1)]}, [3]),
    "all ranks, same step": ({3: [(0, 0.1), (1, 0.2)]}, [3]),
    "rank 1 one step late": ({3: [(0, 0.9)], 4: [(1, 0.0)]}, [3]),
    "rank 0 one step late": ({3: [(1, 0.9)], 4: [(0, 0.0)]}, [3]),
    "rank 1 three steps late": ({3: [(0, 0.5)], 6: [(1, 0.5)]}, [3]),
    "four ranks over four steps": ({3: [(2, 0.5)], 4: [(0, 0.5)], 5: [(3, 0.5)], 6: [(1, 0.5)]}, [3]),
    "two bursts far apart": ({3: [(0, 0.5)], 4: [(1, 0.5)], 200: [(1, 0.5)], 201: [(0, 0.5)]}, [3, 200]),
    "same rank signalled twice": ({3: [(0, 0.5)], 5: [(0, 0.5)]}, [3, 5]),
    "late rank past the window": ({3: [(0, 0.5)], 100: [(1, 0.5)]}, [3, 100]),
    "twice on one rank before one boundary": ({3: [(0, 0.2), (0, 0.4)], 4: [(1, 0.5)]}, [3]),
}


@pytest.mark.parametrize("case", list(SIGNAL_BURSTS))
def test_signal_burst_saves_once(case):
    """SIGUSR1 reaching the ranks at different boundaries: one burst, one
    save; a new burst (or a second signal to a rank that already counted
    one) saves again. Steps are 1 s apart on a fake clock, window 60 s."""
    signals, expected = SIGNAL_BURSTS[case]
    clock = _Clock()
    nranks = 1 + max(rank for deliveries in signals.values() for rank, _ in deliveries)
    ranks = _ranks(max(nranks, 2), clock)
    assert _run(ranks, clock, signals, steps=max(signals) + 3) == expected


def test_signal_received_during_the_vote_is_coalesced():
    """Rank 1's handler runs after it sampled its flags but before the vote
    that saves for rank 0 returned: that signal is the same burst."""
    clock = _Clock()
    a, b = _ranks(2, clock)
    a._on_sigusr1(signal.SIGUSR1, None)
    local = [a.local_flags(1, False), b.local_flags(1, False)]
    b._on_sigusr1(signal.SIGUSR1, None)  # inside the all-reduce
    voted = [max(c) for c in zip(*local)]
    assert [t.decide(1, f, voted).save_reason for t, f in zip((a, b), local)] == ["sigusr1", "sigusr1"]
    clock.now += 1.0
    assert _boundary([a, b], 2) == ["", ""]


def test_signal_coalescing_off_saves_per_boundary():
    """checkpoint.signal_coalesce_s=0: the old behaviour, one save per boundary that saw a signal."""
    clock = _Clock()
    ranks = _ranks(2, clock, coalesce_s=0.0)
    assert _run(ranks, clock, {3: [(0, 0.9)], 4: [(1, 0.0)]}, steps=6) == [3, 4]


def test_signal_coalesce_s_is_validated():
    from megascale_omni.config import CheckpointConfig, ConfigError

    with pytest.raises(ConfigError) as e:
        CheckpointConfig(signal_coalesce_s=-1.0)
    assert e.value.field == "checkpoint.signal_coalesce_s"
