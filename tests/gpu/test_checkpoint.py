"""Async checkpoint save and resume, and a TP2 -> TP1 reshard, on the device.

The tiny GPT with a constant learning rate (so a run of 10 steps and one of
20 apply the same rate per step): a 10-step run saves asynchronously at
steps 5 and 10 (``checkpoint.async_save``, the default); a 20-step run in
the same directory resumes at step 10, and its steps 11-20 must reproduce
an uninterrupted 20-step run (fp32: bit for bit; bf16: within
``resume_rtol``). The reshard saves from TP2 (two ranks) and resumes under
TP1 (one), within the layout tolerance (only the TP summation order differs).
"""

from __future__ import annotations

import json

import pytest

from megascale_omni.checkpoint import layout
from tests.gpu.conftest import PROBE, probed
from tests.launcher import finish, launch_cmd, read_metrics, spawn

pytestmark = pytest.mark.timeout(600)

STEPS = 20
HALF = 10
BASE = ["--config", "examples/gpt/tiny.yaml", "train.lr_decay_style=constant", "train.lr_warmup_steps=0"]


def _run(target, out, nproc: int, steps: int, extra=(), env=None) -> tuple[str, dict[int, float]]:
    """One training run under the device probe; its stderr and per-step losses."""
    args = probed(target, out / "probe", "megascale_omni.smoke",
                  [*BASE, f"train.steps={steps}", *extra, f"logging.output_dir={out}"])
    res = finish(spawn(launch_cmd(nproc, PROBE, args), 300, env), 300)
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stderr, {r["step"]: r["loss"] for r in read_metrics(out)}


def _assert_close(reference: dict, got: dict, rtol: float, what: str) -> None:
    steps = range(HALF + 1, STEPS + 1)
    assert sorted(got) == list(steps), sorted(got)
    worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in steps)
    print(f"\n{what}: worst relative loss difference vs the uninterrupted run over steps 11-20: {worst:.2e}")
    assert worst <= rtol, [(s, got[s], reference[s]) for s in steps]


@pytest.fixture(scope="module")
def straight(target, tmp_path_factory) -> dict[int, float]:
    """The uninterrupted TP1 run, 20 steps."""
    return _run(target, tmp_path_factory.mktemp("straight"), 1, STEPS)[1]


def test_async_save_then_resume_continues_the_run(target, tmp_path, straight):
    ckpt = tmp_path / "ckpt"
    save = [f"checkpoint.dir={ckpt}", "checkpoint.interval=5"]
    _run(target, tmp_path / "first", 1, HALF, save)
    saves = [json.loads(line) for line in (tmp_path / "first" / "checkpoints.jsonl").read_text().splitlines()]
    assert [(s["step"], s["mode"]) for s in saves if s["reason"] == "interval"][:2] == [(5, "async"), (HALF, "async")]
    assert max(info.step for info in layout.scan_tier(ckpt, "persistent") if info.complete) == HALF
    stderr, losses = _run(target, tmp_path / "second", 1, STEPS, save)
    assert "resumed from" in stderr and f"at step {HALF}" in stderr
    _assert_close(straight, losses, target.resume_rtol, f"async save/resume ({target.device}, {target.precision})")


def test_tp2_checkpoint_resumes_under_tp1(target, tmp_path, straight):
    target.require_processes(2)
    ckpt = tmp_path / "ckpt"
    save = [f"checkpoint.dir={ckpt}", f"checkpoint.interval={HALF}"]
    _run(target, tmp_path / "tp2", 2, HALF, [*save, "parallel.tp=2"], env=target.env_for(0, 2))
    stderr, losses = _run(target, tmp_path / "tp1", 1, STEPS, save)
    assert "saved with tp2 pp1 dp1, now tp1 pp1 dp1" in stderr, stderr[-3000:]
    _assert_close(straight, losses, target.loss_rtol, f"TP2 -> TP1 ({target.device}, {target.precision})")
