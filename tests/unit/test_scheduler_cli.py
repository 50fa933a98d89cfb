"""``omni-sched`` in process: a malformed trace or config exits 2 with one
line naming the field, the value and the fix (no traceback); simulate and
validate succeed on good input; an unreachable job socket is retried with
backoff and reported, never raised."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from megascale_omni.scheduler.cli import cli
from megascale_omni.scheduler.live import observe
from megascale_omni.scheduler.report import PLOTS

pytestmark = pytest.mark.timeout(60)

GOOD = {
    "version": 1, "tick_min": 1, "horizon_min": 240,
    "pools": [{"name": "bm", "kind": "bare_metal", "gpus_per_node": 8, "nodes": 4},
              {"name": "vm", "kind": "vm", "gpus_per_node": 8, "nodes": 4, "reclaim_notice_min": 10,
               "availability": [{"at_min": 0, "nodes": 4}, {"at_min": 60, "nodes": 1}, {"at_min": 120, "nodes": 4}]}],
    "jobs": [{"name": "A", "replica_gpus": 8, "replicas": {"min": 2, "max": 6}, "work_samples": 2.0e6,
              "throughput": [[2, 200], [6, 560]],
              "demand": {"period_min": 60, "phases": [{"at_min": 0, "gpus": 48}, {"at_min": 30, "gpus": 24}]}}],
}


def _exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _write(tmp_path, doc, name="trace.yaml"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc), encoding="utf-8")
    return str(path)


def _with(change):
    doc = copy.deepcopy(GOOD)
    change(doc)
    return doc


BAD_TRACES = [
    ("replicas max below min", lambda d: d["jobs"][0]["replicas"].update(max=1),
     "omni-sched: config error: jobs[0].replicas.max=1: must be >= 2"),
    ("unknown key", lambda d: d["jobs"][0].update(replica=8),
     "omni-sched: config error: jobs[0].replica=8: unknown key; known: ['arrive_min', 'demand', 'name', "
     "'priority', 'replica_gpus', 'replicas', 'standby', 'throughput', 'work_samples']"),
    ("exponent read as text", lambda d: d["jobs"][0].update(work_samples="2.0e6"),
     "omni-sched: config error: jobs[0].work_samples='2.0e6': must be a number >= 1e-09 (YAML reads 2.0e6 as "
     "text: write the exponent with a sign, e.g. 1.5e+8)"),
    ("group not whole nodes", lambda d: d["jobs"][0].update(replica_gpus=12),
     "omni-sched: config error: jobs[0].replica_gpus=12: a replica group takes whole nodes: use a multiple of "
     "pool 'bm''s gpus_per_node (8)"),
    ("availability above inventory", lambda d: d["pools"][1]["availability"][1].update(nodes=9),
     "omni-sched: config error: pools[1].availability[1].nodes=9: must be in [0, 4]"),
    ("no bare metal", lambda d: d["pools"].pop(0),
     "omni-sched: config error: pools=['vm']: add a bare_metal pool: it holds every job's core"),
    ("unsorted curve", lambda d: d["jobs"][0].update(throughput=[[6, 560], [2, 200]]),
     "omni-sched: config error: jobs[0].throughput[1][0]=2.0: replica counts must ascend"),
    ("demand not at 0", lambda d: d["jobs"][0]["demand"]["phases"][0].update(at_min=5),
     "omni-sched: config error: jobs[0].demand.phases[0].at_min=5.0: the first entry must be at_min: 0"),
    ("core too big", lambda d: d["jobs"][0]["replicas"].update(min=5, max=6),
     "omni-sched: config error: jobs[0].replicas.min=5: the core (5 x 8 GPUs) must fit the bare_metal pools "
     "(32 GPUs); lower it or add bare-metal nodes"),
    ("costs and cost_model", lambda d: d.update(costs={"drain_s": 1}, cost_model={"state_gb": 10}),
     "omni-sched: config error: cost_model={'state_gb': 10}: give either costs (latencies) or cost_model (state "
     "size, bandwidths, start-up), not both"),
    ("zero heal bandwidth", lambda d: d.update(cost_model={"heal_gb_per_s": 0}),
     "omni-sched: config error: cost_model.heal_gb_per_s=0: must be >= 1e-09"),
    ("stragglers not a list", lambda d: d.update(stragglers=5),
     "omni-sched: config error: stragglers=5: must be a list of {job, at_min, until_min, slowdown} mappings (or "
     "left out)"),
    ("infinite horizon", lambda d: d.update(horizon_min=float("inf")),
     "omni-sched: config error: horizon_min=inf: must be a finite number >= 1"),
    ("mixed-type keys", lambda d: d["jobs"][0].update({1: "x", "replica": 8}),
     "omni-sched: config error: jobs[0].1='x': keys must be text; int key 1: quote it or use a name"),
    ("mixed-type policy keys", lambda d: d.update(policy={2: 1.0, "cooldown_min": 5}),
     "omni-sched: config error: policy.2=1.0: keys must be text; int key 2: quote it or use a name"),
]


@pytest.mark.parametrize("change, line", [pytest.param(c, l, id=i) for i, c, l in BAD_TRACES])
def test_malformed_trace_exits_2_with_one_line(tmp_path, capsys, change, line):
    path = _write(tmp_path, _with(change))
    for cmd in ("simulate", "validate"):
        code, out, err = _exit([cmd, "--trace", path], capsys)
        assert code == 2 and out == ""
        assert err == line + "\n"


def test_unreadable_and_unparsable_traces(tmp_path, capsys):
    code, _, err = _exit(["simulate", "--trace", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2
    assert err == f"omni-sched: config error: --trace='{tmp_path}/missing.yaml': cannot read it (No such file or " \
                  "directory); give an existing trace file\n"
    code, _, err = _exit(["simulate", "--trace", _write(tmp_path, "pools: [\n", "broken.yaml")], capsys)
    assert code == 2 and err.count("\n") == 1 and "not valid YAML" in err and "Traceback" not in err
    code, _, err = _exit(["simulate", "--trace", _write(tmp_path, "{\"pools\": ", "broken.json")], capsys)
    assert code == 2 and err.count("\n") == 1 and "not valid JSON" in err


def test_non_utf8_files_and_non_text_live_config_keys_exit_2(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    trace = _write(tmp_path, GOOD)
    fix = "not UTF-8 text (byte 0xe9 at offset 9); save it as UTF-8"
    for argv, flag in ((["simulate", "--trace", str(bad)], "--trace"),
                       (["simulate", "--trace", trace, "--config", str(bad)], "--config"),
                       (["run", "--config", str(bad)], "--config")):
        code, out, err = _exit(argv, capsys)
        assert (code, out, err) == (2, "", f"omni-sched: config error: {flag}='{bad}': {fix}\n")
    live = _write(tmp_path, "out: runs/x\n1: one\nfoo: 2\n", "live.yaml")
    code, out, err = _exit(["run", "--config", live], capsys)
    assert (code, err) == (2, "omni-sched: config error: config.1='one': keys must be text; int key 1: quote it "
                              "or use a name\n")


def test_bad_knobs_and_flags_exit_2(tmp_path, capsys):
    trace = _write(tmp_path, GOOD)
    knobs = _write(tmp_path, {"grow_above": 0.5}, "knobs.yaml")
    code, _, err = _exit(["simulate", "--trace", trace, "--config", knobs], capsys)
    assert code == 2
    assert err.startswith(f"omni-sched: config error: {knobs}.shrink_below=0.85: need 0 < shrink_below < target_load")
    bad_knob = _write(tmp_path, _with(lambda d: d.update(policy={"cooldown_min": "x"})), "knob.yaml")
    code, _, err = _exit(["simulate", "--trace", bad_knob], capsys)
    assert (code, err) == (2, "omni-sched: config error: policy.cooldown_min='x': must be a number >= 0\n")
    code, _, err = _exit(["simulate", "--trace", trace, "--noise", "1.5"], capsys)
    assert (code, err) == (2, "omni-sched: config error: --noise=1.5: give a fraction in [0, 1), e.g. 0.2 for +-20%\n")


def test_validate_and_simulate_good_trace(tmp_path, capsys):
    trace = _write(tmp_path, GOOD)
    code, out, _ = _exit(["validate", "--trace", trace], capsys)
    assert (code, out) == (0, f"{trace}: ok (2 pools, 1 jobs, horizon 240 min)\n")
    out_dir = tmp_path / "out"
    code, out, _ = _exit(["simulate", "--trace", trace, "--policy", "elastic", "--out", str(out_dir)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "trace trace: 1 jobs, noise +-0, seed 0"
    assert lines[3].startswith("| elastic | ") and "| 1/1 | 0 |" in lines[3]
    summary = json.loads((out_dir / "trace" / "elastic" / "summary.json").read_text())
    assert summary["reclaims_met"] == summary["reclaim_events"] == 1
    assert 0 < summary["cluster_utilisation"] <= summary["held_utilisation"] <= 1
    assert summary["jobs"][0]["below_min_minutes"] == 0 and summary["jobs"][0]["queue_min"] == 0
    assert {"gpu_hours_held", "jct_mean_min", "jct_p95_min", "queue_mean_min", "queue_p95_min"} <= set(summary)
    assert (out_dir / "trace" / "comparison.md").read_text().splitlines()[2] == lines[3]
    run = out_dir / "trace" / "elastic"
    assert sorted(p.name for p in run.iterdir()) == sorted([*PLOTS, "summary.json", "decisions.log"])
    for name in PLOTS:
        data = (run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    log = (run / "decisions.log").read_text().splitlines()
    assert log[0] == "t=0 A grow 2 on bm: admit: core of 2 group(s) on bare metal"
    assert log[1] == "t=4 A grow 4 on vm: load 3.00 > 1.05 for 3 min: 2 -> 6 groups"


def test_json_trace_is_accepted(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(GOOD), encoding="utf-8")
    code, out, _ = _exit(["validate", "--trace", str(path)], capsys)
    assert code == 0 and out.endswith("ok (2 pools, 1 jobs, horizon 240 min)\n")


# ---------------------------------------------------------------- live probe
class _Client:
    """Stands in for ControlClient: refuses the first ``failures`` connections."""

    calls = 0

    def __init__(self, failures):
        self.failures = failures

    def __call__(self, address, token=None, timeout_s=0.0):
        _Client.calls += 1
        if _Client.calls <= self.failures:
            raise ConnectionRefusedError(111, "Connection refused")
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def call(self, cmd, **args):
        if cmd == "status":
            return {"state": "running", "step": 42}
        return {"records": [{"step": 42, "samples_per_s": 96.0, "step_s": 0.5, "data_s": 0.1, "loss": 2.0,
                             "stragglers": [3], "straggler_count": 1}]}


def test_unreachable_socket_is_retried_with_backoff_and_reported(tmp_path):
    slept = []
    obs = observe("A", str(tmp_path / "nobody.sock"), attempts=5, backoff_s=0.5, max_backoff_s=4.0,
                  sleep=slept.append)
    assert slept == [0.5, 1.0, 2.0, 4.0]
    assert (obs.reachable, obs.attempts, obs.waited_s) == (False, 5, 7.5)
    assert obs.describe().startswith("A: unreachable after 5 attempt(s) over 7.5 s: FileNotFoundError")


def test_probe_recovers_after_refusals_and_reads_the_step_record():
    _Client.calls = 0
    slept = []
    obs = observe("A", "/x.sock", attempts=4, backoff_s=0.25, sleep=slept.append, connect=_Client(failures=2))
    assert (obs.reachable, obs.attempts, slept) == (True, 3, [0.25, 0.5])
    assert obs.metrics == {"step": 42, "samples_per_s": 96.0, "step_s": 0.5, "data_s": 0.1, "stragglers": [3],
                           "straggler_count": 1}
    assert obs.data_wait_fraction == pytest.approx(0.2)


def test_probe_command_reports_every_job_and_exits_3(tmp_path, capsys):
    code, out, err = _exit(["probe", "--job", f"A={tmp_path}/a.sock", "--job", f"B={tmp_path}/b.sock",
                            "--attempts", "2", "--backoff", "0.01"], capsys)
    assert code == 3
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["A", "B"]
    assert all("unreachable after 2 attempt(s)" in line for line in lines)
    code, _, err = _exit(["probe", "--job", "A"], capsys)
    assert (code, err) == (2, "omni-sched: config error: --job='A': write NAME=SOCKET, e.g. A=runs/a/control.sock "
                              "or A=127.0.0.1:7700\n")
