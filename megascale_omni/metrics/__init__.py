"""Step metrics and exporters (JSONL, TensorBoard, Prometheus).

The exporters load on first use (PEP 562), so importing
:mod:`megascale_omni.metrics.schema` pulls in neither prometheus_client nor
the config package: the scheduler reads the schema and nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "JsonlWriter": "megascale_omni.metrics.writers",
    "MetricSink": "megascale_omni.metrics.writers",
    "PrometheusExporter": "megascale_omni.metrics.prometheus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
