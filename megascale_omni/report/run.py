"""Loading and statistics of a run's records for the report (plots: :mod:`.plots`, summary page: :mod:`.summary`).

Input contract: ``<run>/metrics.jsonl`` as the Trainer writes it (one flat
JSON object per line; a *step record* has an integer ``step`` and a ``loss``
key, an *evaluation record* an integer ``step`` and ``eval/...`` keys) and,
if present, ``<run>/checkpoints.jsonl`` (one object per committed save with
an integer ``step`` and ``blocking_s``, ``total_s``, ``reason`` ...). Field
names, units and meanings come from
:data:`megascale_omni.metrics.schema.STEP_FIELDS`. A field a run does not
have is absent, never zero: its plot or series is left out and the summary
says so. Lines that are not JSON objects are skipped and counted.

matplotlib (Agg backend) is imported only inside
:func:`megascale_omni.report.plots.write_plots`, so loading and validating a
run needs neither matplotlib nor torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from megascale_omni.config import ConfigError
from megascale_omni.metrics.schema import STEP_FIELDS

#: Throughput series, one panel each (MFU goes on the first panel's right axis).
RATES = ("tokens_per_s", "samples_per_s", "images_per_s", "tflops_per_device")
#: The schema's step-time breakdown, in stacking order; they sum to step_s.
FINE_BREAKDOWN = ("data_s", "compute_s", "pipeline_wait_s", "moe_dispatch_s", "grad_sync_s", "cross_replica_s",
                  "optimizer_s", "checkpoint_s", "control_s", "other_s")
#: Today's coarser split; fwd_bwd_s covers compute + pipeline wait + gradient sync.
COARSE_BREAKDOWN = ("data_s", "fwd_bwd_s", "optimizer_s")
#: Name of the computed component step_s minus the others (when other_s is absent).
REMAINDER = "remainder"
MEMORY_GIB = ("mem_allocated_gib", "mem_reserved_gib", "mem_peak_gib", "rss_gib")


@dataclass
class Run:
    """One run directory's records, ready for statistics and plots.

    ``steps`` holds one record per step number, ascending; when a step was
    recorded more than once (a resumed run appends to metrics.jsonl), the
    last record wins and ``superseded`` counts the earlier ones.
    """

    path: Path  # absolute
    steps: list[dict]
    evals: list[dict]
    checkpoints: list[dict]
    checkpoint_log: bool
    malformed: dict[str, int]
    ignored: int = 0
    superseded: int = 0
    resumes: int = 0
    _cache: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def step_numbers(self) -> np.ndarray:
        return np.array([r["step"] for r in self.steps], dtype=float)

    def values(self, key: str) -> np.ndarray:
        """``key`` per step as floats; NaN where absent, not a number (bool included) or not finite."""
        if key not in self._cache:
            self._cache[key] = np.array([_number(r.get(key)) for r in self.steps], dtype=float)
        return self._cache[key]

    def has(self, key: str) -> bool:
        """True when at least one step record has a finite number for ``key``."""
        return bool(np.isfinite(self.values(key)).any())


def _number(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    v = float(v)
    return v if math.isfinite(v) else math.nan


def _is_step_number(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """The JSON objects of ``path``, one per non-blank line, and the number of
    lines that were not a JSON object (skipped). Raises ConfigError if the
    file cannot be read."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError("RUN_DIR", str(path), f"cannot read: {e.strerror or e}") from None
    objects, malformed = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            malformed += 1
            continue
        if isinstance(obj, dict):
            objects.append(obj)
        else:
            malformed += 1
    return objects, malformed


def load_run(run_dir: Path) -> Run:
    """Read ``run_dir``'s metrics.jsonl (required) and checkpoints.jsonl (optional).

    Raises ConfigError (one line, exit 2 under run_cli) for a missing
    directory, a missing metrics.jsonl, or one without a single valid step
    record.
    """
    if not run_dir.is_dir():
        raise ConfigError("RUN_DIR", str(run_dir), "no such directory")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError("RUN_DIR", str(run_dir), "has no metrics.jsonl (logging.output_dir of a training run)")
    objects, malformed = read_jsonl(metrics)
    by_step: dict[int, dict] = {}
    evals, ignored, superseded, resumes, last = [], 0, 0, 0, None
    for obj in objects:
        if not _is_step_number(obj.get("step")):
            ignored += 1
        elif "loss" in obj:
            if last is not None and obj["step"] <= last:
                resumes += 1
            last = obj["step"]
            superseded += obj["step"] in by_step
            by_step[obj["step"]] = obj
        elif any(k.startswith("eval/") for k in obj):
            evals.append(obj)
        else:
            ignored += 1
    if not by_step:
        skipped = f"; {malformed} malformed line(s) skipped" if malformed else ""
        raise ConfigError("RUN_DIR", str(run_dir),
                          f"metrics.jsonl has no valid step record ({len(objects)} JSON object(s){skipped})")
    checkpoints, ckpt_malformed = [], 0
    ckpt_log = run_dir / "checkpoints.jsonl"
    if ckpt_log.is_file():
        objs, ckpt_malformed = read_jsonl(ckpt_log)
        checkpoints = sorted((o for o in objs if _is_step_number(o.get("step"))), key=lambda o: o["step"])
        ckpt_malformed += len(objs) - len(checkpoints)
    return Run(
        path=run_dir.resolve(), steps=[by_step[s] for s in sorted(by_step)],
        evals=sorted(evals, key=lambda r: r["step"]),
        checkpoints=checkpoints, checkpoint_log=ckpt_log.is_file(),
        malformed={"metrics.jsonl": malformed, "checkpoints.jsonl": ckpt_malformed},
        ignored=ignored, superseded=superseded, resumes=resumes,
    )


# ------------------------------------------------------------------ statistics
def fmt(v: Optional[float]) -> str:
    """A number for the summary: 4 significant digits, whole numbers from 10^4 on; '-' for None."""
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 1e4 else f"{v:.4g}"


def median(a: np.ndarray) -> Optional[float]:
    """Median of the finite values, None if there are none."""
    a = a[np.isfinite(a)]
    return float(np.median(a)) if a.size else None


def percentile(a: np.ndarray, q: float) -> Optional[float]:
    """``q``-th percentile of the finite values (numpy's linear interpolation), None if there are none."""
    a = a[np.isfinite(a)]
    return float(np.percentile(a, q)) if a.size else None


def unit(key: str) -> str:
    return STEP_FIELDS.get(key, ("", ""))[0]


def label(key: str) -> str:
    """Axis/legend label: the field name with its schema unit, e.g. ``tokens_per_s (tokens/s)``."""
    u = unit(key)
    return f"{key} ({u})" if u and u != "bool" else key


def breakdown(run: Run) -> tuple[dict[str, np.ndarray], str]:
    """Components of step_s per step in stacking order, and a sentence saying which split was used.

    The schema's fine split (compute_s, pipeline_wait_s, ...) when the run
    has any of its fields beyond data_s / optimizer_s, else data_s /
    fwd_bwd_s / optimizer_s. Without other_s a ``remainder`` component
    (step_s minus the others, floored at 0) completes the stack.
    """
    fine = [k for k in FINE_BREAKDOWN if run.has(k)]
    if set(fine) - {"data_s", "optimizer_s"}:
        parts, how = {k: run.values(k) for k in fine}, "the schema's breakdown fields present"
    else:
        parts = {k: run.values(k) for k in COARSE_BREAKDOWN if run.has(k)}
        how = ("data_s / fwd_bwd_s / optimizer_s (the run has no compute_s / pipeline_wait_s / grad_sync_s / "
               "cross_replica_s / checkpoint_s / control_s / other_s)")
    if "other_s" not in parts and run.has("step_s"):
        summed = np.nansum(np.vstack(list(parts.values())), axis=0) if parts else 0.0
        parts[REMAINDER] = np.maximum(run.values("step_s") - summed, 0.0)
        how += "; remainder = step_s minus those, floored at 0"
    return parts, how


def membership_changes(run: Run) -> list[tuple[int, float, float]]:
    """(step, participants before, participants after) wherever ``participants`` changes between recorded steps."""
    changes, prev = [], None
    for step, p in zip(run.step_numbers, run.values("participants")):
        if not math.isfinite(p):
            continue
        if prev is not None and p != prev:
            changes.append((int(step), prev, p))
        prev = p
    return changes


def wall_time(run: Run) -> np.ndarray:
    """Cumulative step_s at the end of each recorded step (missing step_s counts as 0)."""
    return np.cumsum(np.nan_to_num(run.values("step_s"), nan=0.0))


def time_at_steps(run: Run, steps: list[int]) -> list[Optional[float]]:
    """Wall time (cumulative step_s) at the end of each of ``steps``: the last recorded step <= it;
    0 before the first recorded step, None after the last."""
    numbers, t = run.step_numbers, wall_time(run)
    out = []
    for s in steps:
        if s > numbers[-1]:
            out.append(None)
            continue
        i = int(np.searchsorted(numbers, s, side="right")) - 1
        out.append(float(t[i]) if i >= 0 else 0.0)
    return out


def moving_average(a: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` steps of the finite values (NaN where the window has none)."""
    ok = np.isfinite(a)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, a, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    lo = np.maximum(np.arange(1, a.size + 1) - window, 0)
    hi = np.arange(1, a.size + 1)
    n = counts[hi] - counts[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums[hi] - sums[lo]) / np.maximum(n, 1), np.nan)
