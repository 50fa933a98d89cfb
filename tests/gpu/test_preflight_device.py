"""The pre-flight checks on CUDA (docs/preflight.md): the bf16 matmul, free
device memory and NVML's counters on one device, a planted failure of the
matmul floor, and the all-reduce over NCCL between two devices.

Rate floors are set to 1e-6 (or to 1e9 for the planted failure), so no
case depends on how fast the GPU is.
"""

from __future__ import annotations

import sys

import pytest

from megascale_omni.preflight.result import read_report
from tests.launcher import free_port, run as run_cmd
from tests.unit.test_preflight import HOST, LINE, fast, run

pytestmark = pytest.mark.timeout(300)

CUDA_FLOORS = ["platform.device=cuda", "preflight.min_matmul_tflops=1e-6", "preflight.min_free_memory_fraction=0",
               "preflight.matmul_size=2048", "preflight.min_allreduce_gb_s=1e-6"]


def _require_cuda(target) -> None:
    if target.device != "cuda":
        pytest.skip("the CUDA device checks need a GPU (on CPU: tests/unit/test_preflight.py)")


def test_the_device_checks_pass_on_a_healthy_gpu_and_a_planted_floor_fails(target, tmp_path):
    _require_cuda(target)
    code, _, err = run([*fast(tmp_path), *CUDA_FLOORS])
    assert code == 0, err
    status = {r.check: r for r in read_report(tmp_path / "run" / "preflight.json").results}
    assert status["device_matmul"].status == "pass" and status["device_matmul"].unit == "TFLOP/s"
    assert status["device_memory"].status == "pass"
    assert status["device_ecc"].status in ("pass", "skip") and status["device_xid"].status in ("pass", "skip")
    code, _, err = run([*fast(tmp_path), *CUDA_FLOORS, "preflight.min_matmul_tflops=1e9"])
    assert code == 44
    [line] = err.strip().splitlines()
    m = LINE.match(line)
    assert m and (m["host"], m["check"], m["unit"], m["field"]) == (
        HOST, "device_matmul", "TFLOP/s", "preflight.min_matmul_tflops"), line


def test_two_devices_all_reduce_over_nccl(target, tmp_path):
    _require_cuda(target)
    target.require_processes(2)
    cmd = [sys.executable, "-m", "megascale_omni.launch", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "megascale_omni.preflight", *fast(tmp_path), *CUDA_FLOORS]
    res = run_cmd(cmd, timeout=240, env=target.env_for(0, 2))
    assert res.returncode == 0, res.output[-3000:]
    allreduce = [r for r in read_report(tmp_path / "run" / "preflight.json").results if r.check == "allreduce"]
    assert [r.status for r in allreduce] == ["pass", "pass"] and all("nccl" in r.detail for r in allreduce)
