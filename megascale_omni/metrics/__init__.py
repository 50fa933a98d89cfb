"""Step metrics and exporters (JSONL, TensorBoard, Prometheus)."""

from megascale_omni.metrics.prometheus import PrometheusExporter
from megascale_omni.metrics.writers import JsonlWriter, MetricSink

__all__ = ["JsonlWriter", "MetricSink", "PrometheusExporter"]
