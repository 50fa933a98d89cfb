"""``preflight.enabled``: the checks run inside the training entry point,
after the process group starts and before the model, the data or any step
(docs/preflight.md). A planted failure (an impossible matmul floor) stops the
job with exit 44 and the one line before it trains."""

from __future__ import annotations

import pytest

from megascale_omni.preflight.result import read_report
from tests.launcher import torchrun
from tests.unit.test_preflight import HOST, LINE, fast

pytestmark = pytest.mark.timeout(200)


def test_a_failed_check_stops_the_job_before_it_trains(tmp_path):
    args = ["--config", "examples/gpt/tiny.yaml", *fast(tmp_path), "train.steps=2", "preflight.enabled=true",
            "preflight.min_cpu_matmul_gflops=1e12"]
    res = torchrun(1, "megascale_omni.smoke", args, timeout=180)
    assert res.returncode == 44, res.output[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("preflight:")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    m = LINE.match(lines[0])
    assert m and (m["host"], m["rank"], m["check"]) == (HOST, "0", "device_matmul"), lines[0]
    assert read_report(tmp_path / "run" / "preflight.json").failed_nodes == [HOST]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran
