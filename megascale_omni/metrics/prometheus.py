"""Prometheus exporter of the step record.

The loss-owning rank of each replica group (the rank whose
:class:`~megascale_omni.metrics.writers.MetricSink` is enabled) serves
``http://<logging.prometheus_host>:<logging.prometheus_port>/metrics``:

- ``megascale_<field>``: one gauge per numeric field of the last step record
  that :data:`~megascale_omni.metrics.schema.STEP_FIELDS` names (help text =
  the schema's meaning and unit; bools as 0/1). A field absent from the last
  record is absent from the scrape, never zero-filled; list values and keys
  the schema does not name (task counters, ``eval/*``) are not exported,
  except the per-layer MoE lists below.
- ``megascale_moe_load_max{layer}``, ``megascale_moe_tokens_dropped{layer}``
  and ``megascale_moe_expert_tokens{layer,expert}``: the step record's
  per-MoE-layer lists (:data:`LAYER_FIELDS`), one series per element;
  ``layer`` counts the MoE layers in order (0 = the first MoE layer).
- ``megascale_checkpoint_failed_saves_total``: the step record's
  ``checkpoint_failed_saves`` (:data:`COUNTER_FIELDS`: counts that only grow
  while the process lives, exported as counters, so ``increase()`` alerts
  on a failed save).
- ``megascale_steps_total``: step records this process logged (a counter:
  ``rate()`` is steps per second; it restarts at 0 with the process).
- ``megascale_last_step_timestamp_seconds``: Unix time of the last step
  record; a job that stopped stepping shows a growing
  ``time() - megascale_last_step_timestamp_seconds``.

Every series carries the exporter's constant labels: an elastic replica
group's ``replica_group`` (its ``elastic.replica_id``), so the job's view
is one query over the groups' endpoints, e.g.
``max(megascale_step_s)`` or ``topk(1, megascale_busy_s_max)``.

Each exporter has a registry of its own (not prometheus_client's global one),
so several exporters in one process do not collide. The HTTP server runs on a
daemon thread; a scrape reads one reference to the last record, so it never
waits on training and training never waits on a scrape.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from typing import Any, Iterator, Mapping, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from megascale_omni.config.errors import ConfigError
from megascale_omni.metrics.schema import STEP_FIELDS
from megascale_omni.metrics.values import scalar_value

logger = logging.getLogger(__name__)

#: Prefix of every exported metric name.
PREFIX = "megascale_"
#: How long close() waits for the server thread to finish, seconds.
_JOIN_TIMEOUT_S = 5.0


def is_step_record(record: Mapping[str, Any]) -> bool:
    """True for a training step's record; False for e.g. an evaluation record
    (``step`` plus ``eval/*`` keys), which must not replace the step gauges."""
    return any(key in STEP_FIELDS and key != "step" for key in record)


def exported_fields(record: Mapping[str, Any]) -> dict[str, float]:
    """The fields of ``record`` the exporter serves, in schema order, as floats."""
    out = {}
    for name in STEP_FIELDS:
        value = scalar_value(record.get(name))
        if value is not None:
            out[name] = float(value)  # bools as 1.0 / 0.0
    return out


#: Step-record fields that are counts growing over the process's life: counters (``<name>_total``), not gauges.
COUNTER_FIELDS = frozenset({"checkpoint_failed_saves"})
#: List fields of the step record exported one series per MoE layer (lists of lists: per layer and expert).
LAYER_FIELDS = ("moe_load_max", "moe_tokens_dropped", "moe_expert_tokens")


def layer_series(record: Mapping[str, Any]) -> dict[str, list[tuple[list[str], float]]]:
    """The :data:`LAYER_FIELDS` of ``record`` as ``name -> [(label values, value)]``
    (labels ``[layer]`` or ``[layer, expert]``); absent fields and non-numbers are left out."""
    out: dict[str, list[tuple[list[str], float]]] = {}
    for name in LAYER_FIELDS:
        layers = record.get(name)
        if not isinstance(layers, list):
            continue
        series = []
        for i, value in enumerate(layers):
            if isinstance(value, list):
                series += [([str(i), str(e)], float(v)) for e, v in enumerate(value) if scalar_value(v) is not None]
            elif scalar_value(value) is not None:
                series.append(([str(i)], float(value)))
        out[name] = series
    return out


def _help(name: str) -> str:
    unit, meaning = STEP_FIELDS[name]
    return f"{meaning} [{unit}]" if unit else meaning


class StepRecordCollector(Collector):
    """Serves the last step record (thread-safe: :meth:`observe` from the
    training thread, :meth:`collect` from the HTTP server's threads)."""

    def __init__(self, labels: Optional[Mapping[str, str]] = None) -> None:
        self._label_names = list(labels or {})
        self._label_values = [str(v) for v in (labels or {}).values()]
        # Replaced whole on every step, never mutated: a scrape sees one record.
        self._snapshot: tuple[dict[str, float], dict, int, Optional[float]] = ({}, {}, 0, None)

    def observe(self, record: Mapping[str, Any]) -> None:
        """Take ``record`` if it is a step record (see :func:`is_step_record`)."""
        if not is_step_record(record):
            return
        _, _, steps, _ = self._snapshot
        self._snapshot = (exported_fields(record), layer_series(record), steps + 1, time.time())

    def collect(self) -> Iterator[Metric]:
        fields, layered, steps, at = self._snapshot
        for name, value in fields.items():
            kind = CounterMetricFamily if name in COUNTER_FIELDS else GaugeMetricFamily
            yield self._one(kind(PREFIX + name, _help(name), labels=self._label_names), value)
        for name, series in layered.items():
            per = ["layer", "expert"] if series and len(series[0][0]) == 2 else ["layer"]
            family = GaugeMetricFamily(PREFIX + name, _help(name), labels=[*self._label_names, *per])
            for labels, value in series:
                family.add_metric([*self._label_values, *labels], value)
            yield family
        yield self._one(CounterMetricFamily(PREFIX + "steps", "step records logged by this process",
                                            labels=self._label_names), steps)
        if at is not None:
            yield self._one(GaugeMetricFamily(PREFIX + "last_step_timestamp_seconds",
                                              "Unix time of the last step record [s]", labels=self._label_names), at)

    def _one(self, family, value: float) -> Metric:
        family.add_metric(self._label_values, value)
        return family


class PrometheusExporter:
    """The HTTP endpoint and its collector (loss-owning rank only).

    ``port`` 0 asks the OS for a free port (tests); the bound port is
    :attr:`port`. Raises ConfigError (``rank_local``: only this rank knows)
    when the address cannot be bound, e.g. the port is taken.
    """

    def __init__(self, host: str, port: int, labels: Optional[Mapping[str, str]] = None):
        self.host = host
        self.registry = CollectorRegistry()
        self.collector = StepRecordCollector(labels)
        self.registry.register(self.collector)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except socket.gaierror as e:
            raise ConfigError(
                "logging.prometheus_host", host, f"not an address this host can bind ({e.strerror}); e.g. 127.0.0.1",
                rank_local=True,
            ) from None
        except OSError as e:
            raise _bind_error(host, port, e) from None
        self.port: int = self._server.server_port
        logger.info("metrics: Prometheus endpoint http://%s:%d/metrics", _url_host(host), self.port)

    def observe(self, record: Mapping[str, Any]) -> None:
        """Publish ``record`` (training thread; eval records are ignored)."""
        self.collector.observe(record)

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(_JOIN_TIMEOUT_S)
        self._server = None


def _bind_error(host: str, port: int, e: OSError) -> ConfigError:
    where = f"{_url_host(host)}:{port}"
    if e.errno == errno.EADDRINUSE:
        hint = (f"port {port} is already in use on {host} (another job, replica group or exporter on this host?); "
                "choose a free port, or 0 to turn the Prometheus exporter off")
        return ConfigError("logging.prometheus_port", port, hint, rank_local=True)
    if e.errno == errno.EACCES:
        hint = f"no permission to bind {where} (ports below 1024 need privileges); choose a port above 1023, or 0"
        return ConfigError("logging.prometheus_port", port, hint, rank_local=True)
    if e.errno == errno.EADDRNOTAVAIL:
        hint = f"no interface of this host has this address ({e.strerror}); use 127.0.0.1 or one of this host's"
        return ConfigError("logging.prometheus_host", host, hint, rank_local=True)
    hint = f"cannot serve Prometheus metrics on {where}: {e.strerror or e}; choose another port, or 0 to turn it off"
    return ConfigError("logging.prometheus_port", port, hint, rank_local=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
