"""Hang detection: per-rank heartbeats and a watchdog thread that names a
stuck rank and tears its replica group down (docs/hang-detection.md)."""

from megascale_omni.watchdog.heartbeat import Beat, Heartbeat
from megascale_omni.watchdog.judge import Verdict, judge
from megascale_omni.watchdog.service import Watchdog

__all__ = ["Beat", "Heartbeat", "Verdict", "Watchdog", "judge"]
