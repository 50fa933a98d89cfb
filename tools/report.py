"""PNG plots and a one-page summary of a training run's metrics.

    python tools/report.py RUN_DIR [--out DIR] [--smooth N]

Reads ``RUN_DIR/metrics.jsonl`` (the ``logging.output_dir`` of a run) and,
if present, ``RUN_DIR/checkpoints.jsonl``, and writes into ``--out``
(default ``RUN_DIR/report``): ``loss.png``, ``throughput.png``,
``step_time.png``, ``memory.png`` and ``timeline.png`` (each only when the
run has the fields it shows) and ``summary.md``. Field names and units come
from ``megascale_omni.metrics.schema.STEP_FIELDS``; absent fields are left
out and listed in the summary. ``--smooth N`` adds a moving average over N
steps to the loss plot (1, the default, draws the raw curve only).

A job directory (no metrics.jsonl of its own, one sub-directory per replica
group that has one, as an elastic job writes them) gets one report per
group in ``OUT/<group>/`` plus ``job.png`` and ``job.md``: the job's step
time and throughput, each group's busy time, the slowest and straggling
groups and membership changes (``megascale_omni/report/job.py``).

Malformed lines are skipped and counted. Exit code 2 with one line for a
missing run directory, no metrics.jsonl, no valid step record, or an
``--out`` that holds files other than a previous report. The report is
built in a temporary directory beside ``--out`` and renamed into place, so
an interrupted run leaves the previous report (or none), never half of one.
Needs matplotlib: ``pip install -e '.[report]'``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megascale_omni.config import ConfigError  # noqa: E402
from megascale_omni.entry import run_cli  # noqa: E402
from megascale_omni.report.job import group_dirs, load_job  # noqa: E402
from megascale_omni.report.run import load_run  # noqa: E402
from megascale_omni.report.write import check_out, write_report  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's logging.output_dir (holds metrics.jsonl)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: RUN_DIR/report)")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window for the loss plot, in steps")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smooth < 1:
        raise ConfigError("--smooth", args.smooth, "must be >= 1 (1 = no smoothing)")
    job = None
    if not (args.run_dir / "metrics.jsonl").exists() and group_dirs(args.run_dir):
        job = load_job(args.run_dir)
    run = job or load_run(args.run_dir)
    out = args.out if args.out is not None else args.run_dir / "report"
    check_out(out)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("matplotlib", None, "not installed; pip install -e '.[report]'") from None
    try:
        plots = write_report(run, out, args.smooth)
    except OSError as e:
        raise ConfigError("--out", str(out), f"cannot write: {e.strerror or e}") from None
    runs = job.runs.values() if job else [run]
    skipped = sum(r.malformed["metrics.jsonl"] + r.malformed["checkpoints.jsonl"] for r in runs)
    what = f"{len(job.runs)} replica groups, {len(job.steps)} job steps" if job else f"{len(run.steps)} steps"
    print(f"report: {what}, {plots} plots, {skipped} malformed line(s) skipped -> "
          f"{out / ('job.md' if job else 'summary.md')}")


if __name__ == "__main__":
    run_cli(main)
