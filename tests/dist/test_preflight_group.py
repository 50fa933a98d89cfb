"""``omni-preflight`` on a two-rank gloo group launched by omni-run
(docs/preflight.md): every check runs on both ranks, the all-reduce and the
clock exchange included; rank 1's clock is planted 5 s ahead, so the group
exits 44 with one line naming rank 1's node, and the JSON result file names
that node to exclude."""

from __future__ import annotations

import sys

import pytest

from megascale_omni.preflight.result import read_report
from tests.launcher import free_port, run
from tests.unit.test_preflight import HOST, LINE, fast, make_dataset

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def test_two_ranks_check_everything_and_a_skewed_clock_names_its_node(tmp_path):
    data = make_dataset(tmp_path / "data", shards=4)
    args = [*fast(tmp_path), f"data.path={data}", "preflight.min_allreduce_gb_s=1e-6", "preflight.allreduce_mib=1",
            "preflight.allreduce_iters=2", "preflight.timeout_s=60"]
    cmd = [sys.executable, "-m", "megascale_omni.launch", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "tests.preflight_clock", "--rank", "1", "--offset-s", "5", *args]
    res = run(cmd, timeout=150)
    assert res.returncode == 44, res.output[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("preflight:")]
    assert len(lines) == 1, res.stderr[-3000:]
    m = LINE.match(lines[0])
    assert m and (m["host"], m["rank"], m["check"], m["bound"]) == (HOST, "1", "clock_skew", "<="), lines[0]
    assert m["field"] == "preflight.max_clock_skew_ms" and m["threshold"] == "100"
    assert abs(float(m["value"]) - 5000) < 2500  # the planted offset, within generous scheduling noise
    assert "exited with code 44" in res.stderr.splitlines()[-1]  # omni-run passes the code on
    report = read_report(tmp_path / "run" / "preflight.json")
    assert report.world_size == 2 and report.failed_nodes == [HOST] and not report.group_failed
    status = {(r.rank, r.check): r.status for r in report.results}
    for rank in (0, 1):
        for check in ("device_matmul", "checkpoint_free", "checkpoint_write", "data", "allreduce"):
            assert status[rank, check] == "pass", (rank, check, report.results)
    assert status[0, "clock_skew"] == "pass" and status[1, "clock_skew"] == "fail"
    allreduce = [r for r in report.results if r.check == "allreduce"]
    assert all(r.scope == "group" and "2 ranks" in r.detail and "gloo" in r.detail for r in allreduce)
    assert not list((tmp_path / "ckpt").iterdir())  # both ranks' write probes are removed
