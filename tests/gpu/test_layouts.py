"""TP2, PP2, DP2 with the distributed optimizer and CP2 (ring attention on the
local spec, transformer-engine's CP attention on its spec) train the tiny GPT of
tests/dist/test_layout_equivalence.py to the single-process run's per-step
losses and grad norms, on the suite's device and backend (NCCL on CUDA),
within the :class:`~tests.gpu.conftest.Target`'s tolerances for its
precision. Every rank runs under the device probe.
"""

from __future__ import annotations

import pytest

from tests.dist.test_layout_equivalence import CONFIG, LAYOUTS
from tests.gpu.conftest import PROBE, probed, read_probe
from tests.launcher import assert_same_training, train_and_read

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

STEPS = 10
NAMES = ("tp2", "pp2", "dp2-distopt", "cp2-distopt-overlap")


def _train(target, tmp_path_factory, name: str, nproc: int, overrides: list[str]) -> list[dict]:
    out = tmp_path_factory.mktemp(name)
    args = probed(target, out / "probe", "megascale_omni.smoke", ["--config", CONFIG, f"train.steps={STEPS}",
                                                                  *overrides])
    records = train_and_read(PROBE, nproc, args, out / "run", STEPS, timeout=300)
    assert all(s["steps"] == STEPS for s in read_probe(out / "probe", nproc))
    return records


@pytest.fixture(scope="module")
def baseline(target, tmp_path_factory) -> list[dict]:
    records = _train(target, tmp_path_factory, "base", 1, [])
    assert all(r["grad_norm"] > 0 for r in records)
    return records


@pytest.mark.parametrize("name", NAMES)
def test_layout_matches_single_process(target, tmp_path_factory, baseline, name):
    nproc, overrides = LAYOUTS[name]
    target.require_processes(nproc)
    records = _train(target, tmp_path_factory, name, nproc, overrides)
    assert_same_training(baseline, records, f"{name} ({target.device}, {target.precision})", target.loss_rtol,
                         target.grad_rtol, counters=("loss_tokens",), lr_rtol=1e-9)
