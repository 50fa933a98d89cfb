"""Step metrics and exporters (JSONL, TensorBoard)."""

from megascale_omni.metrics.writers import JsonlWriter, MetricSink

__all__ = ["JsonlWriter", "MetricSink"]
