"""omni-run (megascale_omni/launch.py): a config error exits 2 with one line
before any worker starts; a worker's failure is passed on as its exit code
in one line, with no launcher traceback."""

from __future__ import annotations

import re
import sys

import pytest

from tests.launcher import free_port, run

pytestmark = pytest.mark.timeout(200)


def _omni_run(*args: str):
    return run([sys.executable, "-m", "megascale_omni.launch", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}", *args], timeout=180)


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
    assert lines == ["config error: model.vocab_size=10: is smaller than the tokenizer's 65; "
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


def test_the_first_failure_is_the_worker_that_exited_on_its_own():
    from types import SimpleNamespace

    from megascale_omni.launch import first_failure

    failures = {0: SimpleNamespace(exitcode=-15, timestamp=12), 1: SimpleNamespace(exitcode=4, timestamp=10),
                2: SimpleNamespace(exitcode=3, timestamp=11)}
    assert first_failure(failures) == (1, 4)
    # Only signals: the earliest.
    assert first_failure({0: SimpleNamespace(exitcode=-9, timestamp=5), 1: SimpleNamespace(exitcode=-15,
                                                                                           timestamp=3)}) == (1, -15)
