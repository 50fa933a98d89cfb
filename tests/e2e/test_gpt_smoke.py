"""The GPT smoke trainer learns under plain ``python`` and writes its logs."""

from __future__ import annotations

import sys

import pytest

from tests.launcher import read_metrics, run

pytestmark = pytest.mark.timeout(240)


def test_smoke_learns_and_logs(tmp_path):
    out = tmp_path / "run"
    res = run(
        [sys.executable, "-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml", "train.steps=60",
         f"logging.output_dir={out}", "logging.log_interval=20"],
        timeout=200,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    records = read_metrics(out)
    assert len(records) == 60
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < 0.9 * first, (first, last)
    # One log line per log_interval, with the fields users grep for.
    lines = [ln for ln in res.stderr.splitlines() if "| loss " in ln]
    assert len(lines) == 3
    for field in ("lr ", "grad_norm ", "tok/s ", "samples/s ", "step "):
        assert field in lines[-1]
    assert (out / "config.yaml").is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # Held-out evaluation ran at the end.
    evals = [r for r in map(__import__("json").loads, (out / "metrics.jsonl").read_text().splitlines())
             if "eval/loss" in r]
    assert len(evals) == 1 and evals[0]["eval/loss"] < first
