"""The GPU run's record: host facts, the import check, and the one results JSON.

    python tools/gpu_ci/record.py host OUT
    python tools/gpu_ci/record.py imports OUT --site DIR --wheels DIR
    python tools/gpu_ci/record.py merge OUT

Called by tools/gpu_ci/run.sh with the interpreter under test; standard
library only (``host`` and ``imports`` also import torch and our
dependencies, which is what they check). ``merge`` writes
``OUT/results.json`` from the parts the steps left in OUT; its schema is in
docs/gpu_ci.md. ``imports`` exits 3 with one line naming the module that
does not import (or a torch that the install replaced).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SCHEMA = 1
# What the GPU suite imports first; each must come from the install, the package from the checkout.
CHECKED_IMPORTS = ("megascale_omni", "megatron.core", "torchft", "megascale_omni.training.trainer")


def _write(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def host_facts() -> dict:
    """Interpreter, torch and device facts of this host (no exception escapes)."""
    facts = {"python": platform.python_version(), "executable": sys.executable, "machine": platform.machine()}
    try:
        import torch

        facts.update(torch=torch.__version__, torch_file=torch.__file__, cuda=torch.version.cuda,
                     cuda_available=torch.cuda.is_available(), devices=torch.cuda.device_count())
        facts["device_names"] = [torch.cuda.get_device_name(i) for i in range(facts["devices"])]
    except Exception as e:  # a broken torch is a fact to record, not a crash of the recorder
        facts["torch_error"] = repr(e)
    if shutil.which("nvidia-smi"):
        res = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        facts["nvidia_smi"] = res.stdout.strip().splitlines()
    return facts


def check_imports(site: str, wheels: str) -> dict:
    """Import CHECKED_IMPORTS; ``ok`` false with ``error`` naming the first failure."""
    out: dict = {"site": site, "wheels_dir": wheels, "modules": {}, "ok": True}
    if wheels and Path(wheels).is_dir():
        out["wheels"] = sorted(p.name for p in Path(wheels).glob("*.whl"))
    import torch

    out["torch"] = {"version": torch.__version__, "file": torch.__file__}
    if site and Path(torch.__file__).resolve().is_relative_to(Path(site).resolve()):
        out.update(ok=False, error=f"torch was installed into {site}; the wheels must not carry torch")
        return out
    for name in CHECKED_IMPORTS:
        try:
            mod = importlib.import_module(name)
        except Exception as e:
            out.update(ok=False, error=f"import {name} failed: {e!r}")
            return out
        out["modules"][name] = {"version": getattr(mod, "__version__", None), "file": getattr(mod, "__file__", None)}
    return out


def junit_summary(path: Path) -> dict | None:
    """Counts and failed test ids of a pytest JUnit XML file, or None when absent/unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    summary = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "seconds": 0.0}
    for suite in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            summary[key] += int(suite.get(key, 0))
        summary["seconds"] += float(suite.get("time", 0.0))
    summary["passed"] = summary["tests"] - summary["failures"] - summary["errors"] - summary["skipped"]
    summary["failed"] = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
                         if case.find("failure") is not None or case.find("error") is not None]
    summary["seconds"] = round(summary["seconds"], 3)
    return summary


def step_table(path: Path) -> dict:
    """run.sh's ``steps.tsv`` (name, exit status, seconds per line) as {name: {rc, seconds}}."""
    steps = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            name, rc, seconds = line.split("\t")
            steps[name] = {"rc": int(rc), "seconds": int(seconds)}
    return steps


def merge(out: Path) -> dict:
    """results.json from the parts in OUT; ``ok`` is true when every step that ran exited 0."""
    steps = step_table(out / "steps.tsv")
    mfu = _read_json(out / "gpu_mfu.json")
    results = {
        "schema": SCHEMA,
        "host": _read_json(out / "host.json"),
        "install": _read_json(out / "install.json"),
        "preflight": _read_json(out / "preflight.json"),
        "tests_gpu": junit_summary(out / "tests-gpu.xml"),
        "gpu_mfu": mfu,
        "steps": steps,
        "total_seconds": sum(s["seconds"] for s in steps.values()),
        "ok": bool(steps) and all(s["rc"] == 0 for s in steps.values()),
    }
    if results["tests_gpu"] is not None:
        results["tests_gpu"]["rc"] = steps.get("tests_gpu", {}).get("rc")
    _write(out / "results.json", results)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("host", "imports", "merge"))
    parser.add_argument("out", type=Path, help="the run's output folder")
    parser.add_argument("--site", default="", help="imports: the --target folder the wheels went into")
    parser.add_argument("--wheels", default="", help="imports: the wheel folder")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "host":
        facts = host_facts()
        _write(args.out / "host.json", facts)
        print(f"host: python {facts['python']}, torch {facts.get('torch', facts.get('torch_error'))}, "
              f"cuda {facts.get('cuda')}, devices {facts.get('devices')} {facts.get('device_names', [])}")
        return 0
    if args.what == "imports":
        result = check_imports(args.site, args.wheels)
        _write(args.out / "install.json", result)
        if not result["ok"]:
            sys.stderr.write(f"install check: {result['error']}\n")
            return 3
        mods = result["modules"]
        print(f"imports ok: megatron-core {mods['megatron.core']['version']}, torch {result['torch']['version']} "
              f"({result['torch']['file']})")
        return 0
    results = merge(args.out)
    tests = results["tests_gpu"] or {}
    families = (results["preflight"] or {}).get("families", {})
    print(f"results: ok={results['ok']} preflight {sorted(k for k, v in families.items() if v.get('ok'))} "
          f"tests/gpu passed {tests.get('passed')} failed {len(tests.get('failed', []))} "
          f"in {results['total_seconds']} s -> {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
