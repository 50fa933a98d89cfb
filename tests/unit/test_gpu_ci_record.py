"""tools/gpu_ci/record.py: the JUnit summary, the step table and the merged results.json."""

from __future__ import annotations

import json
import sys

from tests.launcher import REPO

sys.path.insert(0, str(REPO / "tools/gpu_ci"))
import record  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6" time="12.5">
<testcase classname="tests.gpu.test_training" name="test_gpt" time="3.0"/>
<testcase classname="tests.gpu.test_training" name="test_llava" time="3.0"><failure message="x">boom</failure></testcase>
<testcase classname="tests.gpu.test_layouts" name="test_tp2" time="0.1"><skipped message="needs 2 GPUs"/></testcase>
<testcase classname="tests.gpu.test_layouts" name="test_pp2" time="0.1"><skipped message="needs 2 GPUs"/></testcase>
<testcase classname="tests.gpu.test_te_parity" name="test_te" time="1.0"><error message="y">setup</error></testcase>
<testcase classname="tests.gpu.test_checkpoint" name="test_async" time="5.3"/>
</testsuite></testsuites>
"""


def test_junit_summary_counts_and_names_the_failures(tmp_path):
    (tmp_path / "t.xml").write_text(JUNIT)
    assert record.junit_summary(tmp_path / "t.xml") == {
        "tests": 6, "failures": 1, "errors": 1, "skipped": 2, "passed": 2, "seconds": 12.5,
        "failed": ["tests.gpu.test_training::test_llava", "tests.gpu.test_te_parity::test_te"]}
    assert record.junit_summary(tmp_path / "absent.xml") is None
    (tmp_path / "cut.xml").write_text(JUNIT[:200])  # a run killed mid-write
    assert record.junit_summary(tmp_path / "cut.xml") is None


def test_merge_reads_every_part_and_is_ok_only_when_every_step_passed(tmp_path):
    (tmp_path / "steps.tsv").write_text("host\t0\t2\ninstall\t0\t30\npreflight\t0\t41\ntests_gpu\t1\t300\n")
    (tmp_path / "host.json").write_text(json.dumps({"python": "3.12.1", "torch": "2.11.0+cu130"}))
    (tmp_path / "install.json").write_text(json.dumps({"ok": True, "modules": {}}))
    (tmp_path / "preflight.json").write_text(json.dumps({"ok": True, "families": {"gpt": {"ok": True}}}))
    (tmp_path / "tests-gpu.xml").write_text(JUNIT)
    results = record.merge(tmp_path)
    assert results == json.loads((tmp_path / "results.json").read_text())
    assert results["ok"] is False and results["total_seconds"] == 373
    assert results["steps"]["tests_gpu"] == {"rc": 1, "seconds": 300}
    assert results["tests_gpu"]["rc"] == 1 and results["tests_gpu"]["passed"] == 2
    assert results["host"]["torch"] == "2.11.0+cu130" and results["gpu_mfu"] is None
    assert sorted(results) == ["gpu_mfu", "host", "install", "ok", "preflight", "schema", "steps", "tests_gpu",
                               "total_seconds"]

    (tmp_path / "steps.tsv").write_text("host\t0\t2\ninstall\t0\t30\n")
    assert record.merge(tmp_path)["ok"] is True
    (tmp_path / "steps.tsv").unlink()
    assert record.merge(tmp_path)["ok"] is False  # nothing ran
