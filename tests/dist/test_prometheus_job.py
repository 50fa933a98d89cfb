"""A 2-process (PP=2) tiny GPT job serves its step record over Prometheus
(rank 1, the loss rank) and the control socket (rank 0): same fields, same
numbers, and the same as metrics.jsonl. A taken port stops the job with one
readable line from the rank that could not bind it."""

from __future__ import annotations

import math
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from megascale_omni.metrics.exchange import METRIC_FIELDS
from megascale_omni.metrics.schema import STEP_FIELDS
from tests.dist.control_helpers import omni_ctl, wait_for_server
from tests.launcher import free_port, output_of, read_metrics, spawn_torchrun, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

PREFIX = "megascale_"


def _args(run, port: int) -> list[str]:
    return ["--config", "examples/gpt/tiny.yaml", "parallel.pp=2", "train.steps=100000", f"logging.output_dir={run}",
            "logging.tensorboard=false", "logging.progress_bar=false", "logging.log_interval=1000",
            f"logging.prometheus_port={port}"]


def scrape(port: int) -> dict[str, float]:
    """``{sample name: value}`` of one scrape of the job's endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for_scrape(port: int, proc, names: tuple[str, ...], timeout_s: float = 150) -> dict[str, float]:
    """Scrape until every one of ``names`` is served; fail with the job's log
    if it exits or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"job exited with {proc.returncode}:\n{output_of(proc)[-4000:]}")
        try:
            got = scrape(port)
            if all(n in got for n in names):
                return got
        except (urllib.error.URLError, ConnectionError):
            pass  # not serving yet
        time.sleep(0.2)
    raise AssertionError(f"{names} not served on port {port} after {timeout_s}s:\n{output_of(proc)[-4000:]}")


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_prometheus_control_socket_and_jsonl_report_the_same_step_record(tmp_path):
    run, port = tmp_path / "run", free_port()
    env = {"MEGASCALE_LOG_ALL_RANKS": "1"}
    with spawn_torchrun(2, "megascale_omni.smoke", _args(run, port), timeout=200, env=env) as proc:
        first = wait_for_scrape(port, proc, (PREFIX + "step_s", PREFIX + "loss"))
        assert first[PREFIX + "step_s"] > 0 and math.isfinite(first[PREFIX + "loss"])
        assert first[PREFIX + "steps_total"] >= 1

        # Hold the job still so both exporters settle on the same step.
        wait_for_server(run, proc)
        p = omni_ctl(run, "pause")["result"]["step"]
        deadline = time.monotonic() + 120  # a hang guard, not a latency bound
        while (records := omni_ctl(run, "metrics")["result"]["records"])[-1]["step"] != p:
            assert time.monotonic() < deadline, f"control metrics stuck at {records[-1]['step']}, paused at {p}"
            time.sleep(0.2)
        control = records[-1]
        scraped = scrape(port)
        assert scraped[PREFIX + "step"] == p
        exported = {name[len(PREFIX):]: v for name, v in scraped.items() if name[len(PREFIX):] in STEP_FIELDS}
        assert set(control) == set(exported), (sorted(control), sorted(exported))
        assert {"loss", "lr", "step_s", "tokens", "skipped"} <= set(exported)
        for name, value in control.items():
            assert _same(float(value), exported[name]), (name, value, exported[name])

        assert omni_ctl(run, "drain")["result"]["state"] == "draining"
        assert proc.wait(timeout=60) == 0
        text = output_of(proc)
    assert "Traceback" not in text
    # Served by rank 1, the loss rank under PP=2.
    assert f"[rank 1] INFO megascale_omni.metrics.prometheus: metrics: Prometheus endpoint " \
           f"http://127.0.0.1:{port}/metrics" in text
    # metrics.jsonl holds the same record (its scalar schema fields).
    logged = next(r for r in read_metrics(run) if r["step"] == p)
    jsonl = {k: v for k, v in logged.items() if k in METRIC_FIELDS and v is not None}
    assert set(jsonl) == set(control)
    assert all(_same(float(jsonl[k]), float(control[k])) for k in jsonl)
    with pytest.raises(urllib.error.URLError):  # the endpoint went away with the job
        scrape(port)


# slow: the other rank only stops after torchrun's SIGTERM grace period (~30 s);
# tests/unit/test_prometheus.py covers the taken port in one process.
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_taken_port_stops_the_job_with_one_line_from_the_loss_rank(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = torchrun(2, "megascale_omni.smoke", _args(tmp_path / "run", port), timeout=150)
    assert res.returncode != 0
    # Rank 1 (the loss rank under PP=2) could not bind: it says so, not rank 0.
    line = f"config error: logging.prometheus_port={port}: port {port} is already in use on 127.0.0.1"
    assert line in res.stderr, res.stderr[-3000:]
    assert "megascale_omni/metrics" not in res.stderr  # no traceback through our code
