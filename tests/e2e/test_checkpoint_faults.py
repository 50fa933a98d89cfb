"""Checkpoint faults the chaos harness found (issue 35): a SIGKILLed rank's
writer process dies with it, and a save that runs out of space is abandoned
while training goes on."""

from __future__ import annotations

import builtins
import errno
import json
import os
import signal
import sys
import textwrap
import time

import psutil
import pytest

from megascale_omni.checkpoint import layout
from megascale_omni.checkpoint.write_workers import PROCESS_NAME
from tests.launcher import REPO, finish, launch_cmd, spawn
from tests.one_process import tiny_gpt_trainer

pytestmark = pytest.mark.timeout(300)

#: A rank-like parent: starts the writer process as the Checkpointer does,
#: then forks a helper (as a forking data loader does) that inherits the
#: rank's end of the writer's pipe, so the writer sees no EOF when the rank
#: dies; reports the pids and waits to be killed.
PARENT = textwrap.dedent("""
    import multiprocessing.resource_tracker as tracker, os, time
    from megascale_omni.checkpoint.write_workers import WriteWorkers
    files = WriteWorkers(1)
    files.start()
    helper = os.fork()
    if helper == 0:
        time.sleep(600)
        os._exit(0)
    print(files._workers[0][0].pid, tracker._resource_tracker._pid, helper, flush=True)
    time.sleep(600)
""")

#: Loaded first by every process of the run (ranks and their spawned writer
#: processes, which tests/fault_injection.py does not reach): on rank
#: $OMNI_TEST_ENOSPC_RANK, opening a shard file of step
#: $OMNI_TEST_ENOSPC_STEP for writing fails as a full file system does.
ENOSPC = textwrap.dedent("""
    import builtins, errno, os
    _open, _step = builtins.open, os.environ["OMNI_TEST_ENOSPC_STEP"]
    _ours = os.environ.get("RANK", "0") == os.environ["OMNI_TEST_ENOSPC_RANK"]
    def _full(file, mode="r", *args, **kwargs):
        name = str(file)
        if _ours and "w" in str(mode) and f"step_{int(_step):08d}" in name and name.endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return _open(file, mode, *args, **kwargs)
    builtins.open = _full
""")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init's reap counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def test_writer_process_dies_with_its_sigkilled_rank():
    parent = spawn([sys.executable, "-c", PARENT], timeout=120)
    try:
        line, deadline = "", time.monotonic() + 180  # a hang guard: two interpreter starts on a loaded host
        while not line and time.monotonic() < deadline and parent.poll() is None:
            parent._megascale_logs[0].seek(0)  # type: ignore[attr-defined]
            line = parent._megascale_logs[0].readline()
            time.sleep(0.1)
        assert line, f"the parent reported no writer\n{finish(parent, 10).stderr[-3000:]}"
        worker, tracker, helper = (int(x) for x in line.split())
        assert _alive(worker) and _alive(tracker) and _alive(helper)
        # Past its interpreter's start-up (which takes over 30 s on a loaded host): it names itself right
        # before it asks for the parent-death signal.
        while _name(worker) != PROCESS_NAME.decode() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _name(worker) == PROCESS_NAME.decode(), "the writer never finished starting"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30  # generous: the kernel signals at once
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the writer process outlived its SIGKILLed rank"
        # The tracker ends once no process of ours holds its pipe: the helper is the last.
        os.kill(helper, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _alive(tracker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(tracker), "multiprocessing's resource tracker outlived the rank and its writer"
    finally:
        finish(parent, timeout=10)


def _smoke(nproc, out, ckpt, steps, *extra):
    return launch_cmd(nproc, "megascale_omni.smoke", [
        "--config", "examples/gpt/tiny.yaml", f"train.steps={steps}", f"logging.output_dir={out}",
        "logging.tensorboard=false", "logging.progress_bar=false", f"checkpoint.dir={ckpt}", "checkpoint.interval=2",
        "checkpoint.keep_last=10", *extra,
    ])


def _steps(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


#: (processes, the rank whose disk is full): one process in `make test`; two,
#: the other rank writing fine, in `make test-all`.
LAYOUTS = [pytest.param(1, 0, id="1-process"), pytest.param(2, 1, id="2-processes", marks=pytest.mark.slow)]


@pytest.mark.parametrize("nproc,full_rank", LAYOUTS)
def test_out_of_space_abandons_the_save_and_training_goes_on(tmp_path, nproc, full_rank):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(ENOSPC)
    env = {"OMNI_TEST_ENOSPC_STEP": "4", "OMNI_TEST_ENOSPC_RANK": str(full_rank),
           "PYTHONPATH": os.pathsep.join([str(inject), str(REPO)])}
    ckpt = tmp_path / "ckpt"
    res = finish(spawn(_smoke(nproc, tmp_path / "a", ckpt, 8), timeout=240, env=env), timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    # Async saves at 2, 4 (no space), 6, 8: every rank abandons step 4 with one
    # line naming the failing rank, the errno, the directory and the fix.
    abandoned = [ln for ln in res.stderr.splitlines() if "checkpoint step 4 abandoned" in ln]
    assert len(abandoned) == nproc, res.stderr[-4000:]
    for line in abandoned:
        assert f"rank {full_rank}: ENOSPC" in line and str(ckpt) in line and "free space" in line, line
        assert "1 failed save(s)" in line
    found = {info.step: info for info in layout.scan_tier(ckpt, "persistent")}
    assert sorted(found) == [2, 6, 8], found
    for info in found.values():
        assert info.complete and layout.verify(info) == [], (info.path, layout.verify(info))
    assert not (ckpt / layout.step_dir_name(4)).exists()
    # The step records count it (megascale_checkpoint_failed_saves_total on Prometheus).
    failed = [r["checkpoint_failed_saves"] for _, r in sorted(_steps(tmp_path / "a").items())]
    assert failed[:4] == [0, 0, 0, 0] and failed[-1] == 1 and failed == sorted(failed), failed

    # The save after the failed one resumes bit-identically.
    resumed = finish(spawn(_smoke(nproc, tmp_path / "b", tmp_path / "ckpt_b", 8,
                                  f"checkpoint.resume={ckpt / layout.step_dir_name(6)}"), timeout=240), timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "at step 6" in resumed.stderr
    first, second = _steps(tmp_path / "a"), _steps(tmp_path / "b")
    assert sorted(second) == [7, 8]
    for step in (7, 8):
        assert (second[step]["loss"], second[step]["grad_norm"]) == (first[step]["loss"], first[step]["grad_norm"])


@pytest.mark.slow  # `make test` keeps the async case above
def test_synchronous_and_commit_failures_are_abandoned_too(tmp_path, monkeypatch):
    """In one process, synchronous saves: step 2's shard write and step 4's
    commit marker find no space; step 6 commits and the run finishes."""
    run = tmp_path / "run"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_open, real_commit = builtins.open, layout.write_commit

    def open_(file, mode="r", *args, **kwargs):
        if "w" in str(mode) and str(file).endswith(".distcp") and layout.step_dir_name(2) in str(file):
            raise full
        return real_open(file, mode, *args, **kwargs)

    def write_commit(path, step, extra):
        if step == 4:
            raise full
        return real_commit(path, step, extra)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(layout, "write_commit", write_commit)
    with tiny_gpt_trainer(monkeypatch, run, "train.steps=6", f"checkpoint.dir={run / 'ckpt'}",
                          "checkpoint.interval=2", "checkpoint.keep_last=10", "checkpoint.async_save=false") as trainer:
        trainer.train()
        trainer.checkpointer.wait()
        assert trainer.checkpointer.failed_saves == 2
    found = layout.scan_tier(run / "ckpt", "persistent")
    assert [(info.step, info.complete) for info in found] == [(6, True)]
    assert layout.verify(found[0]) == []
