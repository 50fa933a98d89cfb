"""transformer-engine layers train the tiny GPT like the local spec.

Same seed and layout-invariant initial weights, 20 steps, one process:
``model.layer_impl=transformer_engine`` (TE's fused linear + layer norm and
its attention) against ``model.layer_impl=local`` (megatron's torch layers,
torch SDPA), per-step loss and grad norm within the bf16 bounds of
:class:`~tests.gpu.conftest.Target` (different kernels, same math). TE runs
on CUDA only; skipped where it is not installed (``pip install -e '.[gpu]'``).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.gpu.conftest import PROBE, probed
from tests.launcher import assert_same_training, train_and_read

pytestmark = pytest.mark.timeout(600)

STEPS = 20


def _train(target, tmp_path, impl: str) -> list[dict]:
    args = probed(target, tmp_path / f"probe-{impl}", "megascale_omni.smoke",
                  ["--config", "examples/gpt/tiny.yaml", f"train.steps={STEPS}", f"model.layer_impl={impl}"])
    return train_and_read(PROBE, 1, args, tmp_path / impl, STEPS, timeout=300)


def test_transformer_engine_matches_local_spec(target, tmp_path):
    if target.device != "cuda":
        pytest.skip("transformer-engine layers run on CUDA only")
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("transformer-engine is not installed (pip install -e '.[gpu]')")
    local = _train(target, tmp_path, "local")
    te = _train(target, tmp_path, "transformer_engine")
    assert_same_training(local, te, "transformer_engine vs local", target.loss_rtol, target.grad_rtol,
                         counters=("loss_tokens",))
