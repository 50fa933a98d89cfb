"""Pre-flight of a GPU run: 2 training steps per model family on its tiny config.

    python tools/gpu_ci/preflight.py [--precision bf16] [--budget 60] [--json PATH] [--workdir DIR]

Runs the GPT smoke trainer, pretrain_llava.py and pretrain_dit.py, one after
the other, each as its own single-rank process of this interpreter (a crash
or a hang in one does not take the others down), with ``train.steps=2``,
``train.precision=PRECISION`` and no TensorBoard, eval or checkpoint. Data is
generated into WORKDIR (default: a temporary folder, removed afterwards).

Writes one JSON (schema in docs/gpu_ci.md): per family ``ok`` (exit 0, two
step records, finite losses), ``rc`` (None: not started, the budget was
spent; -9: killed at the budget), ``seconds``, ``losses`` and, when not ok,
``error`` (the end of its stderr). Exit status 0 when every family is ok,
1 otherwise. The whole pre-flight stays within ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
# family -> (command after the interpreter, overrides beyond the common ones). Small data sets:
# LLaVA needs one global batch of packed rows (200 samples), DiT a few packages.
FAMILIES = {
    "gpt": (["-m", "megascale_omni.smoke", "--config", str(REPO / "examples/gpt/tiny.yaml")], []),
    "llava": ([str(REPO / "pretrain_llava.py"), "--config", str(REPO / "examples/llava/tiny_cpu.yaml")],
              ["train.eval_interval=0", "data.default_num_train=200", "data.default_num_val=8"]),
    "dit": ([str(REPO / "pretrain_dit.py"), "--config", str(REPO / "examples/dit/tiny_cpu.yaml")],
            ["checkpoint.dir=''", "checkpoint.interval=0", "dit.sample_steps=2", "dit.eval_samples_per_prompt=1",
             "data.default_num_train=64", "data.default_num_val=8"]),
}


def run_family(name: str, precision: str, workdir: Path, timeout_s: float) -> dict:
    """Train ``name`` for STEPS steps in a child process; its record for the JSON."""
    argv, extra = FAMILIES[name]
    out = workdir / name
    cmd = [sys.executable, *argv, f"train.steps={STEPS}", f"train.precision={precision}",
           f"logging.output_dir={out}", "logging.tensorboard=false", *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    # Own session, so a timeout kills the child's data-loader processes too.
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=max(timeout_s, 1.0))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        rc = -9
    record = {"rc": rc, "seconds": round(time.monotonic() - start, 2), "command": cmd[1:]}
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    steps = [r for r in map(json.loads, lines) if "loss" in r and "eval/loss" not in r]
    record["losses"] = [r["loss"] for r in steps]
    record["ok"] = rc == 0 and len(steps) == STEPS and all(math.isfinite(x) for x in record["losses"])
    if not record["ok"]:
        record["error"] = ("killed at the pre-flight budget; " if rc == -9 else "") + stderr[-2000:]
    return record


def preflight(precision: str, budget_s: float, workdir: Path) -> dict:
    """Every family in turn within ``budget_s``; the JSON's object."""
    start = time.monotonic()
    families = {}
    for name in FAMILIES:
        left = budget_s - (time.monotonic() - start)
        if left <= 0:
            families[name] = {"ok": False, "rc": None, "seconds": 0.0, "losses": [],
                              "error": f"not started: the {budget_s:g} s pre-flight budget was spent"}
            continue
        families[name] = run_family(name, precision, workdir, left)
    return {"precision": precision, "steps": STEPS, "budget_s": budget_s, "families": families,
            "seconds": round(time.monotonic() - start, 2), "ok": all(f["ok"] for f in families.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16", help="train.precision of every family (bf16, fp32, auto)")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds for all families together")
    parser.add_argument("--json", type=Path, default=None, help="write the result here (else stdout)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep data and run folders here")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget {args.budget:g}: must be > 0 seconds")
    with tempfile.TemporaryDirectory(prefix="omni-preflight-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = preflight(args.precision, args.budget, workdir.resolve())
    text = json.dumps(result, indent=2, sort_keys=True) + "\n"
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    else:
        sys.stdout.write(text)
    for name, fam in result["families"].items():
        sys.stderr.write(f"preflight {name}: {'ok' if fam['ok'] else 'FAILED'} rc {fam['rc']} "
                         f"{fam['seconds']} s losses {fam['losses']}\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
