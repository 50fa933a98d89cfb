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


# make test-all: a lighthouse and two replica groups of 2 processes (PP2 GPT).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_replica_group_failing_preflight_never_joins_and_the_job_trains_on(tmp_path):
    """r0 trains alone; r1 starts with ``preflight.enabled`` and an impossible
    matmul floor: it exits 44 with one line per rank before contacting the
    lighthouse, and r0 runs every step with one participant."""
    from tests.dist.elastic_helpers import start_lighthouse, start_replica, step_records, wait_for
    from tests.launcher import finish, kill_group

    steps = 12
    lighthouse, address = start_lighthouse(timeout=800)
    try:
        r0 = start_replica("r0", address, tmp_path, [f"train.steps={steps}"], timeout=700)
        wait_for("r0's step 2", lambda: len(step_records(tmp_path / "r0")) >= 2, timeout=400, procs=[r0])
        r1 = start_replica("r1", address, tmp_path, [
            f"train.steps={steps}", "preflight.enabled=true", "preflight.matmul_size=32", "preflight.matmul_iters=1",
            "preflight.min_cpu_matmul_gflops=1e12", "preflight.min_allreduce_gb_s=1e-6", "preflight.allreduce_mib=1"],
            timeout=300, omni_run=True)
        res1 = finish(r1, 300)
        res0 = finish(r0, 600)
    finally:
        kill_group(lighthouse)
        lighthouse.wait()
    assert res1.returncode == 44, res1.output[-3000:]
    lines = [ln for ln in res1.stderr.splitlines() if ln.startswith("preflight:")]
    # One line per rank: each rank's own device failed.
    assert [(m["rank"], m["check"]) for m in map(LINE.match, lines)] == [("0", "device_matmul"),
                                                                         ("1", "device_matmul")], res1.stderr[-3000:]
    assert read_report(tmp_path / "r1" / "preflight.json").failed_nodes == [HOST]
    assert not (tmp_path / "r1" / "metrics.jsonl").exists()
    assert res0.returncode == 0, res0.output[-3000:]
    records = step_records(tmp_path / "r0")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert {r["participants"] for r in records} == {1}
