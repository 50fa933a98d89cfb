"""tools/gpu_ci/preflight.py trains 2 steps of each family and records them;
run.sh stops after a failed pre-flight. On CPU in fp32 (the device runs bf16)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.launcher import run

pytestmark = pytest.mark.timeout(900)


def test_preflight_trains_two_steps_of_every_family(tmp_path):
    out = tmp_path / "preflight.json"
    res = run([sys.executable, "tools/gpu_ci/preflight.py", "--precision", "fp32", "--budget", "540",
               "--json", str(out), "--workdir", str(tmp_path / "work")], 600)
    assert res.returncode == 0, res.output[-4000:]
    result = json.loads(out.read_text())
    assert result["ok"] is True and result["precision"] == "fp32" and result["steps"] == 2
    assert sorted(result["families"]) == ["dit", "gpt", "llava"]
    for name, fam in result["families"].items():
        assert fam["ok"] and fam["rc"] == 0, (name, fam)
        assert len(fam["losses"]) == 2 and all(math.isfinite(x) and x > 0 for x in fam["losses"]), (name, fam)
    assert result["seconds"] <= 540
    assert (tmp_path / "work/llava/metrics.jsonl").is_file()


def test_run_sh_stops_after_a_failed_preflight_and_records_why(tmp_path):
    out = tmp_path / "out"
    res = run(["tools/gpu_ci/run.sh", str(tmp_path / "no-wheels")], 600,
              env={"PYTHON": sys.executable, "OUT": str(out), "GPU_CI_PRECISION": "fp64", "GPU_CI_PREFLIGHT_S": "400"})
    assert res.returncode == 1, res.output[-4000:]
    assert "pre-flight failed; tests/gpu and gpu_mfu not run" in res.output
    results = json.loads((out / "results.json").read_text())
    assert results["ok"] is False and sorted(results["steps"]) == ["host", "install", "preflight"]
    assert results["steps"]["preflight"]["rc"] == 1 and results["tests_gpu"] is None
    assert results["install"]["ok"] is True and results["install"]["site"] == ""  # the environment as it is
    for fam in results["preflight"]["families"].values():
        assert fam["rc"] == 2 and not fam["ok"]
        assert "train.precision='fp64': must be one of" in fam["error"]
