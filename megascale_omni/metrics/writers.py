"""Metric sinks: JSONL (always) and TensorBoard (optional).

Only the loss-owning rank writes. Each record is one flat JSON object per
line, so ``jq``/pandas read it directly and tests compare numbers exactly.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)


class JsonlWriter:
    """Append-only JSON-lines file; flushed every record so a crash loses nothing."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class MetricSink:
    """Fan-out to JSONL and TensorBoard (loss-owning rank only; no-op elsewhere)."""

    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self._jsonl: Optional[JsonlWriter] = None
        self._tb = None
        if not enabled:
            return
        self._jsonl = JsonlWriter(os.path.join(output_dir, "metrics.jsonl"))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except ImportError:  # tensorboard is a pinned dependency; only a broken env lands here
                logger.warning("tensorboard is not importable; writing JSONL metrics only")

    def log(self, record: Mapping[str, Any], step: int) -> None:
        if not self.enabled:
            return
        assert self._jsonl is not None
        self._jsonl.write(record)
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(key.replace(".", "/"), value, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
