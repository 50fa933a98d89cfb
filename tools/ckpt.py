"""List, verify and clean checkpoints (no torch import: safe on a login node).

    python tools/ckpt.py list runs/x/checkpoints [/fast/ckpt ...] [--json]
    python tools/ckpt.py verify runs/x/checkpoints/step_00000120 [--no-checksums]
    python tools/ckpt.py verify runs/x/checkpoints          # every complete one
    python tools/ckpt.py clean /shared/ckpt [--min-age-minutes 30] [--yes]

``list`` shows every step directory of the given tiers, newest first, with
its state (complete / incomplete), size, reason and layout. ``verify`` checks
sizes and sha256 checksums against the commit marker; exit code 0 when every
checkpoint checked is intact, 1 otherwise, 2 for a bad path, 4 (the
checkpoint error code of the entry points) when a ``commit.json`` cannot be
read at all: one line on stderr per such marker, naming the file and what is
wrong. ``clean``
removes unfinished saves (incomplete step directories) that are older than
the newest complete checkpoint and untouched for ``--min-age-minutes``;
without ``--yes`` it only says what it would remove. Elastic jobs leave such
directories when a writer dies mid-save (docs/elastic.md#checkpoints).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import time
from pathlib import Path

from megascale_omni.checkpoint import layout

#: A commit marker that cannot be read (megascale_omni.entry's checkpoint error code).
EXIT_CHECKPOINT = 4


def _infos(path: Path) -> list:
    """Checkpoints at ``path``: a tier root, or a single step directory."""
    if not path.is_dir():
        raise SystemExit(_die(f"{path}: no such directory"))
    if layout.is_step_dir_name(path.name):
        return [c for c in layout.scan_tier(path.parent, str(path.parent)) if c.path.name == path.name]
    return layout.scan_tier(path, str(path))


def _die(msg: str) -> int:
    sys.stderr.write(f"ckpt: {msg}\n")
    return 2


def _row(c) -> dict:
    """One listing row; fields a hand-edited commit marker lacks or mistypes show as ``?``."""
    commit = c.commit or {}
    lay = commit.get("layout")
    when = commit.get("committed_unix")
    try:
        committed = datetime.datetime.fromtimestamp(when).isoformat(timespec="seconds") if when else ""
    except (TypeError, ValueError, OverflowError, OSError):
        committed = "?"
    return {
        "tier": c.tier,
        "step": c.step,
        "state": "complete" if c.complete else "incomplete",
        "size_mb": round(c.size_bytes / 2**20, 1),
        "reason": str(commit.get("reason", "")),
        "layout": " ".join(f"{k}{lay.get(k, '?')}" for k in ("tp", "pp", "dp")) if isinstance(lay, dict) else "",
        "committed": committed,
        "path": str(c.path),
    }


def cmd_list(args) -> int:
    rows = [_row(c) for p in args.paths for c in _infos(Path(p))]
    rows.sort(key=lambda r: r["step"], reverse=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no checkpoints")
        return 0
    cols = ["step", "state", "size_mb", "reason", "layout", "committed", "path"]
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in cols}
    print("  ".join(k.ljust(widths[k]) for k in cols))
    for r in rows:
        print("  ".join(str(r[k]).ljust(widths[k]) for k in cols))
    return 0


def cmd_verify(args) -> int:
    infos = _infos(Path(args.path))
    single = layout.is_step_dir_name(Path(args.path).name)
    # A marker is written atomically, so an unreadable one is damage, not a save in flight.
    unreadable = {c.path: problem for c in infos if (problem := layout.commit_problem(c.path))}
    for path, problem in unreadable.items():
        sys.stderr.write(f"ckpt: {path / layout.COMMIT_FILE}: {problem}\n")
    targets = [c for c in infos if c.path not in unreadable and (single or c.complete)]
    if not targets and not unreadable:
        return _die(f"{args.path}: no {'such' if single else 'complete'} checkpoint")
    bad = 0
    for c in targets:
        problems = layout.verify(c, checksums=not args.no_checksums)
        print(f"{c.path}: {'OK' if not problems else 'BROKEN: ' + '; '.join(problems)}")
        bad += bool(problems)
    return EXIT_CHECKPOINT if unreadable else 1 if bad else 0


def cmd_clean(args) -> int:
    if not args.min_age_minutes >= 0:  # also refuses nan
        return _die(f"--min-age-minutes={args.min_age_minutes}: must be >= 0 (a save in flight must be left alone)")
    infos = _infos(Path(args.path))
    complete = [c for c in infos if c.complete]
    if not complete:
        return _die(f"{args.path}: no complete checkpoint; refusing to clean (every save may still be running)")
    newest = complete[-1].step
    cutoff = time.time() - args.min_age_minutes * 60
    stale = [c for c in infos if not c.complete and c.step < newest and _last_modified(c.path) < cutoff]
    for c in stale:
        if args.yes:
            layout.remove(c)
        print(f"{'removed' if args.yes else 'would remove'} {c.path} (unfinished save of step {c.step})")
    if not stale:
        print(f"nothing to clean (newest complete checkpoint: step {newest})")
    elif not args.yes:
        print("run again with --yes to remove them")
    return 0


def _last_modified(path: Path) -> float:
    """Newest mtime of ``path`` and everything under it (a save in flight keeps touching it)."""
    return max([path.stat().st_mtime, *(p.stat().st_mtime for p in path.rglob("*"))])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="list checkpoints of one or more tiers")
    p.add_argument("paths", nargs="+")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_list)
    p = sub.add_parser("verify", help="check sizes and checksums against the commit marker")
    p.add_argument("path")
    p.add_argument("--no-checksums", action="store_true", help="check sizes only (fast)")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("clean", help="remove unfinished saves older than the newest complete checkpoint")
    p.add_argument("path")
    p.add_argument("--min-age-minutes", type=float, default=30.0,
                   help="only directories untouched this long (a save in flight keeps writing; default 30)")
    p.add_argument("--yes", action="store_true", help="remove them (default: only list them)")
    p.set_defaults(fn=cmd_clean)
    args = parser.parse_args(argv)
    # The commands report broken markers themselves, once, on stdout or stderr.
    quiet = logging.getLogger(layout.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return args.fn(args)
    finally:
        quiet.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
