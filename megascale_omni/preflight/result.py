"""Pre-flight results: one record per check and rank, the one-line failure
message, and the JSON result file a scheduler reads.

Imports only stdlib-only leaves of the framework (errors, utils.files), so a
scheduler (a client deployed apart from the trainer) can import
:func:`read_report` without torch (tests/unit/test_scheduler_imports.py). The file (docs/preflight.md)::

    {"format_version": 1, "ok": false, "exit_code": 44, "created": "2026-12-02T11:00:00Z",
     "world_size": 2, "failed_nodes": ["node-b"], "group_failed": false,
     "results": [{"check": "clock_skew", "status": "fail", "value": 5000.1, "unit": "ms",
                  "threshold": 100.0, "bound": "<=", "field": "preflight.max_clock_skew_ms",
                  "detail": "", "scope": "node", "host": "node-b", "rank": 1}, ...]}

``failed_nodes`` lists the hosts of failed *node*-scope checks (a device, a
directory, a clock of that host): the nodes to leave out. A failed
*group*-scope check (the all-reduce bandwidth, measured by every rank
together) sets ``group_failed`` and names no node: any member could be the
slow link.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megascale_omni.errors import EXIT_PREFLIGHT_FAILED
from megascale_omni.utils.files import atomic_write_json

FORMAT_VERSION = 1
STATUSES = ("pass", "fail", "skip")


@dataclass
class CheckResult:
    """The outcome of one check on one rank.

    ``value`` is what was measured in ``unit``; the check passes when
    ``value`` is ``bound`` (``>=`` a floor, ``<=`` a ceiling) ``threshold``,
    the setting ``field`` (e.g. ``preflight.min_allreduce_gb_s``). A skipped
    check has no value and says why in ``detail``.
    """

    check: str
    status: str
    value: Optional[float] = None
    unit: str = ""
    threshold: Optional[float] = None
    bound: str = ">="
    field: str = ""
    detail: str = ""
    #: ``node``: about the host that measured it; ``group``: about the whole group.
    scope: str = "node"
    host: str = ""
    rank: int = 0

    @property
    def failed(self) -> bool:
        return self.status == "fail"


def judge(check: str, value: float, unit: str, threshold: float, field_name: str, bound: str = ">=",
          detail: str = "", scope: str = "node") -> CheckResult:
    """A pass or a fail of ``value`` against ``threshold`` (NaN always fails)."""
    ok = value >= threshold if bound == ">=" else value <= threshold
    ok = ok and not math.isnan(value)
    return CheckResult(check, "pass" if ok else "fail", value, unit, threshold, bound, field_name, detail, scope)


def skipped(check: str, reason: str, scope: str = "node") -> CheckResult:
    return CheckResult(check, "skip", detail=reason, scope=scope)


def _num(x: Optional[float]) -> str:
    if x is None:
        return "none"
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:.4g}"


def failure_line(r: CheckResult) -> str:
    """``preflight: node <host> rank <r>: <check> measured <value unit>, expected >= <threshold unit> (<field>)``,
    then ``; <detail>`` when there is one; a check that raised says so instead of a measurement."""
    if r.value is None:
        return f"preflight: node {r.host} rank {r.rank}: {r.check} could not be measured: {r.detail}"
    line = (f"preflight: node {r.host} rank {r.rank}: {r.check} measured {_num(r.value)} {r.unit}, "
            f"expected {r.bound} {_num(r.threshold)} {r.unit} ({r.field})")
    return f"{line}; {r.detail}" if r.detail else line


@dataclass
class PreflightReport:
    """Every rank's results, gathered (the same on every rank)."""

    results: list[CheckResult]
    world_size: int
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.failed]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed_nodes(self) -> list[str]:
        """Hosts of failed node-scope checks, sorted: the nodes to exclude."""
        return sorted({r.host for r in self.failed if r.scope == "node"})

    @property
    def group_failed(self) -> bool:
        return any(r.scope == "group" for r in self.failed)

    def failure_lines(self) -> list[str]:
        """One line per failed check; a group-scope check once (every rank measured the same collective)."""
        lines, seen_group = [], set()
        for r in sorted(self.failed, key=lambda r: (r.rank, r.check)):
            if r.scope == "group":
                if r.check in seen_group:
                    continue
                seen_group.add(r.check)
            lines.append(failure_line(r))
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION, "ok": self.ok, "exit_code": 0 if self.ok else EXIT_PREFLIGHT_FAILED,
            "created": self.created, "world_size": self.world_size, "failed_nodes": self.failed_nodes,
            "group_failed": self.group_failed, "results": [dataclasses.asdict(r) for r in self.results],
        }


def format_report(report: PreflightReport) -> str:
    """A table of every result, one row per rank and check (for people; the JSON is for programs)."""
    rows = [("rank", "node", "check", "status", "measured", "expected", "detail")]
    for r in report.results:
        measured = f"{_num(r.value)} {r.unit}" if r.value is not None else "-"
        expected = f"{r.bound} {_num(r.threshold)}" if r.threshold is not None else "-"
        rows.append((str(r.rank), r.host, r.check, r.status, measured, expected, r.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    return "".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + f"  {row[6]}".rstrip() + "\n" for row in rows)


def write_report(report: PreflightReport, path: str | os.PathLike) -> Path:
    """Write ``report`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, report.to_json(), indent=1, sort_keys=True)
    return path


def read_report(path: str | os.PathLike) -> PreflightReport:
    """Parse a result file written by :func:`write_report`.

    Raises:
        ValueError: one line naming the file and what is wrong with it
            (unreadable, not JSON, another format version, a malformed result).
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable pre-flight result file ({exc})") from None
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: pre-flight result format_version {version!r}, expected {FORMAT_VERSION}")
    names = {f.name for f in dataclasses.fields(CheckResult)}
    results = []
    for i, item in enumerate(doc.get("results", [])):
        if (not isinstance(item, dict) or not {"check", "status"} <= item.keys() <= names
                or item["status"] not in STATUSES):
            raise ValueError(f"{path}: results[{i}] is not a pre-flight check result")
        results.append(CheckResult(**item))
    return PreflightReport(results, int(doc.get("world_size", 0)), str(doc.get("created", "")))
