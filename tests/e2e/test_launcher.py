"""omni-run (megascale_omni/launch.py): a config error exits 2 with one line
before any worker starts; a worker's failure is passed on as its exit code
in one line, with no launcher traceback; SIGUSR1 to omni-run reaches the
workers. (Slurm: tests/unit/test_slurm_launch.py, tests/dist/test_multinode_launch.py.)"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys

import psutil
import pytest

from megascale_omni.checkpoint import layout
from tests.launcher import finish, free_port, read_metrics, run, spawn, wait_for_record

pytestmark = pytest.mark.timeout(200)


def _omni_run_cmd(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "megascale_omni.launch", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *args]


def _omni_run(*args: str):
    return run(_omni_run_cmd(*args), timeout=180)


def test_config_error_exits_2_before_any_worker(tmp_path):
    # tp=2 x pp=2 needs a multiple of 4 processes; 2 are launched.
    res = _omni_run("-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml", "parallel.tp=2",
                    "parallel.pp=2", f"logging.output_dir={tmp_path}")
    assert res.returncode == 2, res.output[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == ["config error: parallel='tp=2 pp=2 cp=1': world size 2 is not divisible by tp*pp*cp=4; "
                     "launch a multiple of 4 processes or change the degrees"]
    assert not tmp_path.joinpath("config.yaml").exists()  # no worker ran


def test_a_vocabulary_below_the_tokenizers_exits_2_before_any_worker(tmp_path):
    # Known only from the data: the embedded default dataset's tokenizer, read without building the dataset.
    res = _omni_run("pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml", "train.steps=1",
                    f"logging.output_dir={tmp_path}", "model.vocab_size=10")
    assert res.returncode == 2, res.output[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    # The demo config's set has clips: 76 words (65 without, tests/unit/test_prelaunch_checks.py).
    assert lines == ["config error: model.vocab_size=10: is smaller than the tokenizer's 76; "
                     "set 0 to use the tokenizer's"]
    assert not tmp_path.joinpath("config.yaml").exists()  # no worker ran


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a host without CUDA")
def test_cuda_required_on_a_cpu_host_exits_2_before_any_worker(tmp_path):
    res = _omni_run("-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml", "platform.device=cuda",
                    f"logging.output_dir={tmp_path}")
    assert res.returncode == 2, res.output[-3000:]
    [line] = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line.startswith("config error: platform.device='cuda': CUDA is not available on this host")
    assert not tmp_path.joinpath("config.yaml").exists()


def test_a_worker_failure_is_one_line_with_its_exit_code(tmp_path):
    # Valid config; the workers fail at start-up: the checkpoint to resume has no commit marker (exit 4).
    broken = tmp_path / "elsewhere" / "step_00000005"
    broken.mkdir(parents=True)
    res = _omni_run("-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml",
                    f"logging.output_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt",
                    f"checkpoint.resume={broken}")
    assert res.returncode == 4, res.output[-3000:]
    assert f"checkpoint.resume={broken} is broken: no commit.json" in res.stderr
    assert "Traceback" not in res.stderr and "ChildFailedError" not in res.stderr
    # Whichever rank failed first; torchrun then terminates the other (code -15), which must not be reported.
    assert re.match(r"omni-run: [12] worker\(s\) failed; first: rank [01] exited with code 4 ",
                    res.stderr.rstrip().splitlines()[-1])


def test_sigusr1_to_omni_run_saves_once_and_training_continues(tmp_path):
    """SIGUSR1 to omni-run itself, as Slurm's ``--signal=USR1@T`` delivers it:
    the worker saves one checkpoint and trains on to the last step (torchrun's
    agent alone dies of SIGUSR1, and its workers never see it). One worker:
    the forwarding is the agent's; that one rank's signal saves for all is
    tests/unit/test_checkpoint_triggers.py's."""
    ckpt, out, steps = tmp_path / "ckpt", tmp_path / "run", 50
    proc = spawn(_omni_run_cmd("-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml",
                               f"train.steps={steps}", f"checkpoint.dir={ckpt}", "checkpoint.save_at_end=false",
                               f"logging.output_dir={out}", "logging.tensorboard=false", nproc=1), timeout=180)
    wait_for_record(out, 3, proc)
    # Listed now: if omni-run died of the signal, its workers would outlive it in sessions of their own.
    workers = psutil.Process(proc.pid).children()
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        res = finish(proc, timeout=180)
    finally:
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
    assert res.returncode == 0, res.output[-3000:]
    saves = [c for c in layout.scan_tier(ckpt, "persistent") if c.complete]
    assert [c.commit["reason"] for c in saves] == ["sigusr1"], [(c.step, c.commit) for c in saves]
    assert 3 < saves[0].step < steps
    assert [r["step"] for r in read_metrics(out)] == list(range(1, steps + 1))


def test_the_first_failure_is_the_worker_that_exited_on_its_own():
    from types import SimpleNamespace

    from megascale_omni.launch import first_failure

    failures = {0: SimpleNamespace(exitcode=-15, timestamp=12), 1: SimpleNamespace(exitcode=4, timestamp=10),
                2: SimpleNamespace(exitcode=3, timestamp=11)}
    assert first_failure(failures) == (1, 4)
    # Only signals: the earliest.
    assert first_failure({0: SimpleNamespace(exitcode=-9, timestamp=5), 1: SimpleNamespace(exitcode=-15,
                                                                                           timestamp=3)}) == (1, -15)
