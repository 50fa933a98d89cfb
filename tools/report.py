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
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's package, then reportlib beside this file
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megascale_omni.config import ConfigError  # noqa: E402
from megascale_omni.entry import run_cli  # noqa: E402

#: What a report directory holds; an existing --out with anything else is not replaced.
REPORT_SUFFIXES = (".png", ".md")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's logging.output_dir (holds metrics.jsonl)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: RUN_DIR/report)")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window for the loss plot, in steps")
    return p.parse_args(argv)


def check_out(out: Path) -> None:
    """Raise ConfigError unless ``out`` is absent or a directory holding only report files."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", str(out), "exists and is not a directory")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if not (p.is_file() and p.suffix in REPORT_SUFFIXES)]
        if foreign:
            raise ConfigError("--out", str(out), f"holds files that are not a report ({', '.join(sorted(foreign)[:3])}"
                              "); choose another --out")


def write_report(run, out: Path, smooth: int) -> tuple[list, list]:
    """Build the plots and summary.md in a temporary directory beside ``out``, then
    put it in place of ``out`` (a previous report is replaced). Returns write_plots' result."""
    import reportlib

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old = None
    try:
        plots, notes = reportlib.write_plots(run, tmp, smooth)
        (tmp / "summary.md").write_text(reportlib.summary_markdown(run, plots, notes), encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a report is meant to be read
        if out.exists():
            old = out.parent / f"{tmp.name}.old"
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return plots, notes


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smooth < 1:
        raise ConfigError("--smooth", args.smooth, "must be >= 1 (1 = no smoothing)")
    import reportlib

    run = reportlib.load_run(args.run_dir)
    out = args.out if args.out is not None else args.run_dir / "report"
    check_out(out)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("matplotlib", None, "not installed; pip install -e '.[report]'") from None
    try:
        plots, _ = write_report(run, out, args.smooth)
    except OSError as e:
        raise ConfigError("--out", str(out), f"cannot write: {e.strerror or e}") from None
    skipped = run.malformed["metrics.jsonl"] + run.malformed["checkpoints.jsonl"]
    print(f"report: {len(run.steps)} steps, {len(plots)} plots, {skipped} malformed line(s) skipped -> "
          f"{out / 'summary.md'}")


if __name__ == "__main__":
    run_cli(main)
