"""The GPU suite: what runs where, and the one fixture that says so.

Every test in this directory is marked ``gpu`` and skipped, with the reason,
on a host without CUDA. ``OMNI_GPU_TESTS_ON_CPU=1`` runs the same scenarios
on CPU with gloo in fp32 instead (to check the tests themselves on a host
without a GPU; the tolerances are then the fp32 ones of tests/dist).

The scenarios are those of tests/dist and tests/e2e, launched through the
same helpers (tests/launcher.py) with the :class:`Target`'s overrides:
``platform.device``, ``train.precision``. A test that needs N processes on
CUDA needs N devices (NCCL puts one rank of a communicator on one device)
and is skipped with that reason on a host with fewer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.dist.conftest import llava_dataset, llava_video_dataset  # noqa: F401  (the shapes datasets, shared)

#: Opt-in: run the GPU scenarios on CPU/gloo/fp32.
ON_CPU_ENV = "OMNI_GPU_TESTS_ON_CPU"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Target:
    """Device, collective backend and precision every run of the suite uses,
    with the tolerances that precision allows."""

    device: str
    backend: str
    precision: str
    #: CUDA devices visible (0 on CPU).
    devices: int
    #: Largest relative per-step loss / grad-norm difference between two
    #: layouts of one model (summation order only).
    loss_rtol: float
    grad_rtol: float
    #: Largest relative loss difference of a resumed run in the same layout.
    resume_rtol: float

    @property
    def dtype(self) -> str:
        """The parameters' torch dtype name for :attr:`precision`."""
        return "bfloat16" if self.precision == "bf16" else "float32"

    def overrides(self) -> list[str]:
        return [f"platform.device={self.device}", f"train.precision={self.precision}",
                "logging.tensorboard=false", "logging.progress_bar=false"]

    def require_processes(self, n: int) -> None:
        """Skip unless ``n`` ranks fit: one CUDA device per NCCL rank (any count on CPU)."""
        if self.device == "cuda" and self.devices < n:
            pytest.skip(f"needs {n} CUDA devices for {n} NCCL ranks (one rank per device); this host has "
                        f"{self.devices}")

    def env_for(self, first_device: int, n: int) -> dict:
        """Environment of a job whose ``n`` ranks take devices ``first_device...`` (CUDA only)."""
        if self.device != "cuda":
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(first_device + i) for i in range(n))}


#: fp32 numbers are those measured by tests/dist (layouts within 1e-6, resume
#: bit-identical). bf16 bounds are set from bf16's 8-bit mantissa (relative
#: rounding 4e-3 per operation), not measured: a wrong reduction or a lost
#: micro-batch moves the loss by percents within a step or two.
CPU = Target("cpu", "gloo", "fp32", 0, loss_rtol=1e-6, grad_rtol=1e-5, resume_rtol=0.0)


def cuda_target() -> Target:
    return Target("cuda", "nccl", "bf16", torch.cuda.device_count(), loss_rtol=3e-2, grad_rtol=1e-1,
                  resume_rtol=1e-2)


def skip_reason() -> str | None:
    """Why the suite cannot run here, or None."""
    if torch.cuda.is_available() or os.environ.get(ON_CPU_ENV) == "1":
        return None
    return (f"no CUDA device: torch.cuda.is_available() is False (tests/gpu needs a GPU; "
            f"{ON_CPU_ENV}=1 runs these scenarios on CPU/gloo/fp32)")


def pytest_collection_modifyitems(config, items):
    reason = skip_reason()
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def target() -> Target:
    """Where the suite runs: CUDA/NCCL/bf16, or CPU/gloo/fp32 under ``OMNI_GPU_TESTS_ON_CPU=1``
    (which also hides any GPU from the jobs the tests start)."""
    if os.environ.get(ON_CPU_ENV) == "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return CPU
    return cuda_target()


PROBE = "tests.gpu.device_probe"


def probed(target: Target, report: Path, entry: str, args: list[str]) -> list[str]:
    """Arguments that run ``entry`` (script or module) with ``args`` and
    ``target``'s overrides under :mod:`tests.gpu.device_probe`, which checks
    parameters and micro-batches at every step and reports to ``report``."""
    return ["--device", target.device, "--dtype", target.dtype, "--report", str(report), entry, *args,
            *target.overrides()]


def read_probe(report: Path, ranks: int) -> list[dict]:
    """What each of ``ranks`` ranks saw (:mod:`tests.gpu.device_probe`)."""
    import json

    found = sorted(report.glob("rank*.json"))
    assert len(found) == ranks, f"probe reports {[p.name for p in found]}, want {ranks}"
    return [json.loads(p.read_text()) for p in found]
