"""Writing a report directory: one run's plots and summary, or a job's
groups side by side, built beside ``--out`` and renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from megascale_omni.config import ConfigError
from megascale_omni.report.job import Job, job_markdown, write_job_plot
from megascale_omni.report.plots import write_plots
from megascale_omni.report.summary import summary_markdown

#: What a report directory holds; an existing --out with anything else is not replaced.
REPORT_SUFFIXES = (".png", ".md")


def _is_report_file(p: Path) -> bool:
    return p.is_file() and p.suffix in REPORT_SUFFIXES


def check_out(out: Path) -> None:
    """Raise ConfigError unless ``out`` is absent or a directory holding only
    report files (and, from a job report, directories of report files)."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", str(out), "exists and is not a directory")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir()
                   if not (_is_report_file(p) or p.is_dir() and all(map(_is_report_file, p.iterdir())))]
        if foreign:
            raise ConfigError("--out", str(out), f"holds files that are not a report ({', '.join(sorted(foreign)[:3])}"
                              "); choose another --out")


def _write_run(run, out: Path, smooth: int) -> int:
    """Plots and summary.md of one run into the existing directory ``out``; returns the plots written."""
    plots, notes = write_plots(run, out, smooth)
    (out / "summary.md").write_text(summary_markdown(run, plots, notes), encoding="utf-8")
    return len(plots)


def _write_job(job, out: Path, smooth: int) -> int:
    """Every group's report in ``out/<group>/``, then job.png and job.md; returns the plots written."""
    plots = 0
    for name, run in job.runs.items():
        (out / name).mkdir()
        plots += _write_run(run, out / name, smooth)
    plotted = write_job_plot(job, out)
    (out / "job.md").write_text(job_markdown(job, plotted), encoding="utf-8")
    return plots + plotted


def write_report(run_or_job, out: Path, smooth: int) -> int:
    """Build the report (a run's, or a job's when given a :class:`Job`) in a
    temporary directory beside ``out``, then put it in place of ``out`` (a
    previous report is replaced). Returns the number of plots written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old = None
    try:
        if isinstance(run_or_job, Job):
            plots = _write_job(run_or_job, tmp, smooth)
        else:
            plots = _write_run(run_or_job, tmp, smooth)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a report is meant to be read
        if out.exists():
            old = out.parent / f"{tmp.name}.old"
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return plots
