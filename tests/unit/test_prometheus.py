"""The Prometheus exporter in-process: what a scrape returns, bind errors,
config validation (no training job; see tests/dist/test_prometheus_job.py)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from megascale_omni.config import ConfigError, JobConfig, from_dict
from megascale_omni.config.runtime_sections import LoggingConfig
from megascale_omni.entry import run_cli
from megascale_omni.metrics import MetricSink, PrometheusExporter
from megascale_omni.metrics.schema import STEP_FIELDS
from tests.launcher import free_port


def scrape(port: int) -> dict[str, tuple[str, float]]:
    """``{sample name: (help text, value)}`` of one scrape of 127.0.0.1:port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {s.name: (family.documentation, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


FIRST = {"step": 1, "loss": 5.0, "lr": 1e-4, "grad_norm": 3.5, "skipped": False, "tokens": 256, "step_s": 0.5}
SECOND = {
    "step": 2, "loss": 4.25, "lr": 2e-4, "grad_norm": None, "skipped": True, "tokens": 256, "step_s": 0.25,
    "mfu": 0.375, "healed": False, "stragglers": [1, 3],  # None and list values: not exported
    "packing_efficiency": 0.9, "note": "text",  # keys the schema does not name: not exported
}


def test_sink_serves_the_last_step_record(tmp_path):
    port = free_port()
    sink = MetricSink(str(tmp_path), enabled=True, tensorboard=False, prometheus_port=port)
    try:
        assert sink.prometheus is not None and sink.prometheus.port == port
        sink.log(FIRST, 1)
        sink.log(SECOND, 2)
        sink.log({"step": 2, "eval/loss": 4.0}, 2)  # an eval record leaves the step gauges alone
        got = scrape(port)
    finally:
        sink.close()
    expected = {"step": 2.0, "loss": 4.25, "lr": 2e-4, "skipped": 1.0, "tokens": 256.0, "step_s": 0.25,
                "mfu": 0.375, "healed": 0.0}
    gauges = {name[len("megascale_"):]: value for name, (_, value) in got.items()
              if name not in ("megascale_steps_total", "megascale_last_step_timestamp_seconds")}
    assert gauges == expected  # grad_norm (None now), stragglers, unknown keys and eval/* absent
    assert got["megascale_steps_total"][1] == 2.0
    assert got["megascale_last_step_timestamp_seconds"][1] > 0
    unit, meaning = STEP_FIELDS["step_s"]
    assert got["megascale_step_s"][0] == f"{meaning} [{unit}]"
    assert got["megascale_loss"][0] == STEP_FIELDS["loss"][1]
    # close() stopped the server and freed the port; the JSONL sink got every record.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    PrometheusExporter("127.0.0.1", port).close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    sink.close()  # idempotent


def test_failed_checkpoint_saves_are_a_counter():
    exporter = PrometheusExporter("127.0.0.1", 0)
    try:
        exporter.observe({"step": 7, "loss": 2.0, "checkpoint_failed_saves": 2})
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        exporter.close()
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert kinds["megascale_checkpoint_failed_saves"] == "counter" and kinds["megascale_loss"] == "gauge"
    assert "megascale_checkpoint_failed_saves_total 2.0" in text


def test_exporters_in_one_process_keep_their_own_registries():
    a, b = PrometheusExporter("127.0.0.1", 0), PrometheusExporter("127.0.0.1", 0)
    try:
        a.observe({"step": 3, "loss": 1.5})
        assert scrape(b.port)["megascale_steps_total"][1] == 0.0 and "megascale_loss" not in scrape(b.port)
        b.observe({"step": 4, "loss": 2.5})
        assert scrape(a.port)["megascale_loss"][1] == 1.5 and scrape(b.port)["megascale_loss"][1] == 2.5
    finally:
        a.close()
        b.close()


def test_a_port_in_use_is_a_config_error_naming_field_and_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as e:
            MetricSink(str(tmp_path), enabled=True, tensorboard=False, prometheus_port=port)
    err = e.value
    assert err.field == "logging.prometheus_port" and err.value == port and err.rank_local
    assert f"port {port} is already in use" in str(err) and "or 0 to turn" in str(err)
    assert not (tmp_path / "metrics.jsonl").exists()  # failed before opening anything


def test_an_address_not_on_this_host_names_prometheus_host(tmp_path):
    with pytest.raises(ConfigError) as e:
        PrometheusExporter("192.0.2.1", 0)  # TEST-NET-1: on no interface
    assert e.value.field == "logging.prometheus_host" and e.value.value == "192.0.2.1"


def test_only_the_enabled_sink_serves(tmp_path):
    port = free_port()
    sink = MetricSink(str(tmp_path), enabled=False, tensorboard=False, prometheus_port=port)
    assert sink.prometheus is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens
    off = MetricSink.from_config(LoggingConfig(output_dir=str(tmp_path), tensorboard=False), enabled=True)
    assert off.prometheus is None  # prometheus_port 0 = off
    off.close()


@pytest.mark.parametrize("port", [-1, 65536])
def test_prometheus_port_is_validated(port):
    with pytest.raises(ConfigError) as e:
        from_dict(JobConfig, {"logging": {"prometheus_port": port}})
    assert e.value.field == "logging.prometheus_port" and e.value.value == port
    cfg = JobConfig()
    assert (cfg.logging.prometheus_port, cfg.logging.prometheus_host) == (0, "127.0.0.1")


def test_a_rank_local_config_error_is_printed_by_the_rank_that_raised_it(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")

    def fails(rank_local: bool):
        def main():
            raise ConfigError("logging.prometheus_port", 9400, "already in use", rank_local=rank_local)
        return main

    for rank_local, printed in ((False, ""), (True, "config error: logging.prometheus_port=9400: already in use\n")):
        with pytest.raises(SystemExit) as e:
            run_cli(fails(rank_local))
        assert e.value.code == 2 and capsys.readouterr().err == printed


def labelled_samples(record: dict) -> list:
    """The samples of one scrape of an exporter labelled ``replica_group="r7"`` that observed ``record``."""
    exporter = PrometheusExporter("127.0.0.1", 0, labels={"replica_group": "r7"})
    try:
        exporter.observe(record)
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        exporter.close()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def test_constant_labels_on_every_series():
    """An elastic replica group's endpoint labels every series with its replica_group."""
    samples = labelled_samples(FIRST)
    names = {s.name for s in samples}
    assert {"megascale_loss", "megascale_step_s", "megascale_steps_total"} <= names
    assert all(s.labels == {"replica_group": "r7"} for s in samples)


def test_moe_per_layer_lists_are_series_labelled_by_layer_and_expert():
    """The step record's per-MoE-layer lists become one series per layer (and expert); the
    scalar router losses are plain gauges."""
    record = {**FIRST, "moe_expert_tokens": [[10, 30], [20, 20]], "moe_load_max": [1.5, 1.0],
              "moe_tokens_dropped": [4, 0], "moe_aux_loss": 1.25}
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in labelled_samples(record)}
    r7 = ("replica_group", "r7")
    assert got[("megascale_moe_load_max", (("layer", "0"), r7))] == 1.5
    assert got[("megascale_moe_load_max", (("layer", "1"), r7))] == 1.0
    assert got[("megascale_moe_tokens_dropped", (("layer", "0"), r7))] == 4.0
    assert got[("megascale_moe_expert_tokens", (("expert", "1"), ("layer", "0"), r7))] == 30.0
    assert got[("megascale_moe_expert_tokens", (("expert", "0"), ("layer", "1"), r7))] == 20.0
    assert len([k for k in got if k[0] == "megascale_moe_expert_tokens"]) == 4
    assert got[("megascale_moe_aux_loss", (r7,))] == 1.25
