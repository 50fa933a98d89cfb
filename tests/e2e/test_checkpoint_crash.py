"""Crash safety: SIGKILL at random moments while checkpoints are being
written, replicated and pruned never leaves the newest visible checkpoint
broken, and every restart resumes from it."""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import pytest

from megascale_omni.checkpoint import layout
from tests.launcher import finish, spawn

pytestmark = pytest.mark.timeout(600)

#: Kill trials: a few in `make test`, all of them in `make test-all`.
TRIALS = [pytest.param(2, id="2-kills"), pytest.param(10, id="10-kills", marks=pytest.mark.slow)]


def _cmd(out, fast, slow, steps):
    return [
        sys.executable, "-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml",
        f"train.steps={steps}", f"logging.output_dir={out}", "logging.tensorboard=false",
        "logging.progress_bar=false", "logging.log_interval=1000",
        # Save every step into the fast tier, replicate, keep 2: a kill
        # almost always lands in a write, a commit, a copy or a prune.
        f"checkpoint.local_dir={fast}", f"checkpoint.dir={slow}", "checkpoint.interval=1", "checkpoint.keep_last=2",
    ]


def _newest(fast, slow):
    found = layout.newest_complete([("local", fast), ("persistent", slow)])
    return found[0] if found else None


@pytest.mark.parametrize("trials", TRIALS)
def test_random_sigkills_never_break_the_newest_checkpoint(tmp_path, trials):
    rng = random.Random(20261129)
    out, fast, slow = tmp_path / "run", tmp_path / "fast", tmp_path / "slow"
    expected_resume = None
    for trial in range(trials):
        proc = spawn(_cmd(out, fast, slow, steps=100000), timeout=300)
        # Kill only after this run committed a checkpoint of its own, at a
        # random moment of the saves that follow (one per step).
        previous = expected_resume.step if expected_resume else 0
        deadline = time.monotonic() + 240  # a hang guard: start-up and the first save, on a loaded host
        while time.monotonic() < deadline and proc.poll() is None:
            newest = _newest(fast, slow)
            if newest is not None and newest.step > previous:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"trial {trial}: exited early\n{finish(proc, 10).stderr[-3000:]}"
        time.sleep(rng.uniform(0.0, 1.0))
        os.killpg(proc.pid, signal.SIGKILL)
        res = finish(proc, timeout=30)
        if expected_resume is not None:
            assert f"at step {expected_resume.step}" in res.stderr, (trial, res.stderr[-3000:])
        newest = _newest(fast, slow)
        assert newest is not None, f"trial {trial}: no complete checkpoint"
        assert layout.verify(newest) == [], (trial, newest.path, layout.verify(newest))
        expected_resume = newest

    # A final, uninterrupted run resumes from the newest and finishes.
    final_steps = expected_resume.step + 2
    res = finish(spawn(_cmd(out, fast, slow, steps=final_steps), timeout=120), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"at step {expected_resume.step}" in res.stderr
    assert _newest(fast, slow).step == final_steps
