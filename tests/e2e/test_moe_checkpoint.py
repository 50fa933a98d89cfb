"""MoE checkpoints: experts saved under one expert-parallel size load under
another, and a resume in the same layout is bit-identical.

megatron's ``SequentialMLP`` names each expert's weights by its global
expert index (a ShardedTensor axis over all experts), so EP ranks write their
own experts and any EP size reads them back; Adam's state follows the same
keys (every EP size groups the expert weights in their own optimizer,
models/moe.py ``group_expert_params``). With the distributed optimizer a
model with experts saves megatron's ``fully_reshardable`` format (its Adam
state in the parameters' shapes), which reshards the same way.

One chain per optimizer, four runs (6 steps, checkpoints every 2):

- A: EP2 from scratch, saving at steps 2 and 4;
- B: EP1 resumed from A's step 2 (EP2 -> EP1): steps 3-6 within 1e-6
  relative of A (the gradient all-reduce order changes), the same tokens
  per expert at every step; it saves at step 4 under EP1;
- C: EP2 resumed from B's step 4 (EP1 -> EP2): steps 5-6 within 1e-6 of B,
  the same tokens per expert;
- D: EP2 resumed from A's step 4 (same layout): steps 5-6 equal to A's bit
  for bit (fp32, ``==``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher import read_metrics, torchrun

pytestmark = pytest.mark.timeout(900)

STEPS, INTERVAL = 6, 2
#: Synchronous saves: what is tested is the resharding. The background writer (a process per rank that
#: imports torch and megatron: ~6 s of CPU each here) runs in the dense checkpoint tests, where
#: ``checkpoint.async_save`` keeps its default (tests/e2e/test_checkpoint_faults.py and others).
BASE = ["--config", "examples/gpt/tiny_moe.yaml", f"train.steps={STEPS}", "logging.tensorboard=false",
        "logging.progress_bar=false", "checkpoint.async_save=false"]
#: A resume in another layout: the loss within this relative difference (fp32 rounding of another summation order).
RESHARD_RTOL = 1e-6


def _train(ep: int, args: list[str], out: Path) -> tuple[str, dict[int, dict]]:
    """A run of ``ep`` processes at ``parallel.ep=ep``: its log and its records by step."""
    res = torchrun(ep, "megascale_omni.smoke", [*BASE, *args, f"parallel.ep={ep}", f"logging.output_dir={out}"],
                   timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr, {r["step"]: r for r in read_metrics(out)}


def _resume(tmp_path: Path, name: str, ep: int, ckpt: Path, extra: tuple[str, ...], saved_as: str,
            every: int = 0) -> dict[int, dict]:
    """Resume ``ckpt`` under ``ep`` (saving every ``every`` steps if > 0); its records by step."""
    save = [f"checkpoint.interval={every}"] if every else ["checkpoint.save_at_end=false"]
    log, records = _train(ep, [*extra, f"checkpoint.dir={tmp_path / f'ckpt-{name}'}", f"checkpoint.resume={ckpt}",
                               *save], tmp_path / name)
    step = int(ckpt.name.split("_")[1])
    assert f"at step {step} in" in log and f"saved with {saved_as}" in log, log[-3000:]
    assert sorted(records) == list(range(step + 1, STEPS + 1)), sorted(records)
    return records


def _assert_matches(ref: dict[int, dict], got: dict[int, dict], what: str, rtol: float) -> None:
    for step, r in got.items():
        assert r["moe_expert_tokens"] == ref[step]["moe_expert_tokens"], (what, step)
        if rtol == 0.0:
            assert r["loss"] == ref[step]["loss"], (what, step, r["loss"], ref[step]["loss"])
            assert r["grad_norm"] == ref[step]["grad_norm"], (what, step)
        worst = abs(r["loss"] - ref[step]["loss"]) / ref[step]["loss"]
        print(f"{what} step {step}: relative loss difference {worst:.1e}")
        assert worst <= rtol, (what, step, r["loss"], ref[step]["loss"])


def _chain(tmp_path: Path, extra: tuple[str, ...] = ()) -> None:
    """A (EP2) -> B (EP1 from A@2) -> C (EP2 from B@4); D (EP2 from A@4) == A."""
    ckpt_a = tmp_path / "ckpt-a"
    _, a = _train(2, [*extra, f"checkpoint.dir={ckpt_a}", f"checkpoint.interval={INTERVAL}"], tmp_path / "a")
    assert sorted(a) == list(range(1, STEPS + 1))
    b = _resume(tmp_path, "b", 1, ckpt_a / "step_00000002", extra, "tp1 pp1 dp2 ep2", every=INTERVAL)
    _assert_matches(a, b, "ep2 -> ep1", RESHARD_RTOL)
    c = _resume(tmp_path, "c", 2, tmp_path / "ckpt-b" / "step_00000004", extra, "tp1 pp1 dp1, now")
    _assert_matches(b, c, "ep1 -> ep2", RESHARD_RTOL)
    d = _resume(tmp_path, "d", 2, ckpt_a / "step_00000004", extra, "tp1 pp1 dp2 ep2")
    _assert_matches(a, d, "ep2 -> ep2", 0.0)


def test_checkpoint_reshards_ep2_to_ep1_to_ep2_and_resumes_bit_identical(tmp_path):
    _chain(tmp_path)


def test_distributed_optimizer_checkpoint_reshards_ep2_to_ep1_to_ep2_and_resumes_bit_identical(tmp_path):
    """The same chain with the distributed optimizer (``fully_reshardable`` with experts)."""
    _chain(tmp_path, extra=("parallel.use_distributed_optimizer=true",))
