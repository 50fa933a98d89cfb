"""Pre-flight checks (docs/preflight.md): each check passing and with a planted
failure, the one-line message and exit 44, the JSON result file, bad settings.

``omni-preflight`` runs here in this process on a one-rank gloo group (the
two-rank run is tests/dist/test_preflight_group.py). Passing cases set every
rate floor to 1e-6 so that no test depends on how fast this machine is.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from megascale_omni.config.preflight_section import PreflightConfig
from megascale_omni.data.shard_writer import write_member_shards
from megascale_omni.entry import run_cli
from megascale_omni.errors import EXIT_PREFLIGHT_FAILED
from megascale_omni.preflight import nvml
from megascale_omni.preflight.cli import main as preflight_main
from megascale_omni.preflight.clock import offsets_vs_rank0, skew_result
from megascale_omni.preflight.data import sampled_shards
from megascale_omni.preflight.result import CheckResult, PreflightReport, failure_line, read_report, write_report

HOST = socket.gethostname()
#: ``preflight: node <host> rank <r>: <check> measured <value unit>, expected >= <threshold> (preflight.<field>)``
LINE = re.compile(r"preflight: node (?P<host>\S+) rank (?P<rank>\d+): (?P<check>\w+) measured (?P<value>\S+) "
                  r"(?P<unit>[^,]*), expected (?P<bound>>=|<=) (?P<threshold>\S+) [^(]*\((?P<field>preflight\.\w+)\)")


def fast(tmp: Path) -> list[str]:
    """Overrides for a quick run that passes on any machine (floors at 1e-6, tiny sizes)."""
    return [f"logging.output_dir={tmp}/run", f"checkpoint.dir={tmp}/ckpt", "preflight.matmul_size=32",
            "preflight.matmul_iters=1", "preflight.min_cpu_matmul_gflops=1e-6", "preflight.checkpoint_probe_mib=0.1",
            "preflight.min_checkpoint_write_mb_s=1e-6", "preflight.min_checkpoint_free_gib=0"]


def make_dataset(root: Path, shards: int = 2) -> Path:
    """A family-agnostic shard set: ``shards`` shards of 2 JSON-only samples under ``root/train``."""
    records = ({"json": json.dumps({"id": i}).encode()} for i in range(2 * shards))
    write_member_shards(records, root / "train", samples_per_shard=2)
    return root


def run(args: list[str], clock=time.time) -> tuple[int, str, str]:
    """``omni-preflight args`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    saved_env = dict(os.environ)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_cli(lambda: preflight_main(args, clock=clock))
    except SystemExit as e:
        code = e.code
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    return code, out.getvalue(), err.getvalue()


def test_passing_checks_exit_0_and_write_the_result_file(tmp_path):
    data = make_dataset(tmp_path / "data")
    code, out, err = run([*fast(tmp_path), f"data.path={data}"])
    assert code == 0, err
    report = read_report(tmp_path / "run" / "preflight.json")
    status = {r.check: r.status for r in report.results}
    assert status == {"device_matmul": "pass", "checkpoint_free": "pass", "checkpoint_write": "pass", "data": "pass",
                      "allreduce": "skip", "clock_skew": "skip"}
    assert report.ok and report.failed_nodes == [] and report.world_size == 1
    assert "device_matmul" in out and not list((tmp_path / "ckpt").iterdir())  # the write probe is removed


@pytest.mark.parametrize("case", ["matmul", "free_space", "not_writable", "corrupt_shard", "missing_shard"])
def test_a_planted_failure_is_one_line_and_exit_44(tmp_path, case):
    data = make_dataset(tmp_path / "data")
    args = [*fast(tmp_path), f"data.path={data}"]
    check, field = {
        "matmul": ("device_matmul", "min_cpu_matmul_gflops"),
        "free_space": ("checkpoint_free", "min_checkpoint_free_gib"),
        "not_writable": ("checkpoint_write", "min_checkpoint_write_mb_s"),
        "corrupt_shard": ("data", "data_sample_shards"),
        "missing_shard": ("data", "data_sample_shards"),
    }[case]
    shard = data / "train" / "shard-000001.tar"
    if case == "matmul":
        args.append("preflight.min_cpu_matmul_gflops=1e12")
    elif case == "free_space":
        args.append("preflight.min_checkpoint_free_gib=1e9")
    elif case == "not_writable":  # a directory under a regular file: no one can create it, root included
        (tmp_path / "file").write_text("x")
        args.append(f"checkpoint.dir={tmp_path}/file/ckpt")
    elif case == "corrupt_shard":
        raw = bytearray(shard.read_bytes())
        raw[600] ^= 0xFF
        shard.write_bytes(bytes(raw))
    else:
        shard.unlink()
    code, _, err = run(args)
    assert code == EXIT_PREFLIGHT_FAILED == 44
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    m = LINE.match(lines[0])
    assert m, lines[0]
    assert (m["host"], m["rank"], m["check"], m["field"]) == (HOST, "0", check, f"preflight.{field}")
    assert float(m["threshold"]) == {"matmul": 1e12, "free_space": 1e9, "not_writable": 1e-6}.get(case, 0)
    if case == "not_writable":
        assert m["value"] == "0" and "is not writable" in lines[0]
    if case == "corrupt_shard":
        assert "sha256" in lines[0] and m["value"] == "1"
    if case == "missing_shard":
        assert "missing or unreadable" in lines[0]
    report = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert report["ok"] is False and report["exit_code"] == 44 and report["failed_nodes"] == [HOST]
    assert [r["check"] for r in report["results"] if r["status"] == "fail"] == [check]


def test_a_planted_clock_offset_fails_the_rank_that_is_off():
    """Rank 2's clock runs 0.5 s ahead; readings jitter by up to 1 ms per round (the median absorbs it)."""
    now = [1000.0]
    jitter = iter([0.0, 0.001, -0.001, 0.0005, 0.0] * 3)

    def clock() -> float:
        now[0] += 0.01
        return now[0]

    def exchange(reading: float) -> list[float]:  # three ranks leaving the same barrier
        return [reading, reading + next(jitter), reading + 0.5]

    offsets = offsets_vs_rank0(clock, exchange, rounds=5)
    assert offsets[0] == 0 and abs(offsets[1]) <= 0.001 and offsets[2] == pytest.approx(0.5)
    results = [skew_result(o, PreflightConfig().max_clock_skew_ms, reference=r == 0) for r, o in enumerate(offsets)]
    assert [r.status for r in results] == ["pass", "pass", "fail"]
    assert results[2].value == pytest.approx(500.0) and results[2].bound == "<=" and "ahead" in results[2].detail


def test_ranks_sample_different_shards_until_all_are_taken():
    assert [sampled_shards(8, 2, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sampled_shards(3, 2, 5) == [1, 2] and sampled_shards(1, 4, 3) == [0]


def test_result_file_round_trip_and_group_failures_name_no_node(tmp_path):
    results = [CheckResult("allreduce", "fail", 0.5, "GB/s", 10.0, ">=", "preflight.min_allreduce_gb_s",
                           scope="group", host=h, rank=r) for r, h in enumerate(["a", "b"])]
    results.append(CheckResult("clock_skew", "fail", 900.0, "ms", 100.0, "<=", "preflight.max_clock_skew_ms",
                               host="b", rank=1))
    report = PreflightReport(results, 2)
    back = read_report(write_report(report, tmp_path / "r.json"))
    assert back.results == results and back.failed_nodes == ["b"] and back.group_failed
    lines = back.failure_lines()  # the group's all-reduce once, then the node's clock
    assert lines == ["preflight: node a rank 0: allreduce measured 0.5 GB/s, expected >= 10 GB/s "
                     "(preflight.min_allreduce_gb_s)",
                     "preflight: node b rank 1: clock_skew measured 900 ms, expected <= 100 ms "
                     "(preflight.max_clock_skew_ms)"]
    (tmp_path / "bad.json").write_text('{"format_version": 1, "results": [{"check": "x", "status": "maybe"}]}')
    with pytest.raises(ValueError, match=r"bad.json: results\[0\] is not a pre-flight check result"):
        read_report(tmp_path / "bad.json")


@pytest.mark.parametrize("override, expected", [
    ("preflight.min_allreduce_gb_s=0", "config error: preflight.min_allreduce_gb_s=0.0: must be > 0"),
    ("preflight.min_free_memory_fraction=1.5",
     "config error: preflight.min_free_memory_fraction=1.5: must be in [0, 1]"),
    ("preflight.data_sample_shards=many", "preflight.data_sample_shards"),
    ("preflight.clock_skew=1", "preflight.clock_skew"),
])
def test_bad_settings_exit_2_with_one_line(tmp_path, override, expected):
    code, out, err = run([f"logging.output_dir={tmp_path}", override])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("config error:") and expected in err, err


def test_a_check_that_raises_is_that_checks_failure_not_a_crash():
    from megascale_omni.preflight.runner import _guarded

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    [r] = _guarded("device_matmul", broken)
    r.host, r.rank = "gpu-3", 7
    assert r.failed and PreflightReport([r], 8).failed_nodes == ["gpu-3"]
    assert failure_line(r) == ("preflight: node gpu-3 rank 7: device_matmul could not be measured: "
                               "RuntimeError: CUDA error: an illegal memory access was encountered")


def test_omni_run_checks_the_preflight_config_before_any_worker():
    from torch.distributed.run import parse_args

    from megascale_omni.config import ConfigError
    from megascale_omni.launch import check_job

    args = parse_args(["--nproc-per-node=2", "-m", "megascale_omni.preflight", "preflight.max_clock_skew_ms=-1"])
    with pytest.raises(ConfigError, match=r"preflight.max_clock_skew_ms=-1.0: must be > 0"):
        check_job(args)
    check_job(parse_args(["--nproc-per-node=2", "-m", "megascale_omni.preflight", "preflight.max_clock_skew_ms=5"]))


class _FakeNvml(types.SimpleNamespace):
    """pynvml's calls used by megascale_omni.preflight.nvml, answering from fixed values."""

    class NVMLError(Exception):
        pass

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, nvmlEventTypeXidCriticalError = 1, 0, 8

    def __init__(self, ecc, xids):
        super().__init__(ecc=ecc, xids=list(xids), inits=0)

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        return "handle"

    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter):
        if self.ecc is None:
            raise self.NVMLError("Not Supported")
        return self.ecc

    def nvmlEventSetCreate(self):
        return "events"

    def nvmlDeviceRegisterEvents(self, handle, kinds, events):
        pass

    def nvmlEventSetWait(self, events, timeout_ms):
        if not self.xids:
            raise self.NVMLError("Timeout")
        return types.SimpleNamespace(eventData=self.xids.pop(0))

    def nvmlEventSetFree(self, events):
        pass


def test_nvml_counters_fail_on_ecc_errors_and_xids_and_skip_where_unsupported(monkeypatch):
    """The NVML path's logic, against a stand-in for pynvml (CPU here; tests/gpu has no NVML case yet)."""
    monkeypatch.setattr(nvml, "_handle", lambda lib, device: "handle")
    cuda0 = torch.device("cuda", 0)
    fake = _FakeNvml(ecc=2, xids=[79])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    [ecc] = nvml.nvml_counters(cuda0, max_ecc_errors=0)
    assert (ecc.status, ecc.value, ecc.field) == ("fail", 2.0, "preflight.max_ecc_errors")
    with nvml.XidWatch(cuda0) as watch:
        pass
    xid = watch.result(max_xid_events=0)
    assert (xid.status, xid.value, xid.detail, fake.inits) == ("fail", 1.0, "XIDs [79]", 0)
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(ecc=None, xids=[]))
    [ecc] = nvml.nvml_counters(cuda0, max_ecc_errors=0)
    assert ecc.status == "skip" and "Not Supported" in ecc.detail
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import raises ImportError
    assert nvml.nvml_counters(cuda0, 0)[0].detail == nvml.NO_PYNVML
