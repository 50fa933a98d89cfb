"""The scheduler is a client: of the framework it imports only the control
client (with its protocol), the metrics schema and stdlib-only leaves, so it
can be versioned and deployed apart."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.launcher import REPO

PACKAGE = REPO / "megascale_omni"
#: Framework modules the scheduler may import. Each imports nothing of the
#: framework outside this set (checked below), and none imports torch.
ALLOWED = frozenset({
    "megascale_omni.control.client",
    "megascale_omni.control.protocol",
    "megascale_omni.metrics.schema",
    "megascale_omni.errors",  # ConfigError: bad input exits 2 as in every entry point
    "megascale_omni.utils.files",  # atomic writes of the scheduler's state snapshot
    "megascale_omni.utils.processes",  # killing a launched replica group
    "megascale_omni.preflight.result",  # a group's pre-flight result file: the nodes to exclude (exit 44)
    "megascale_omni.megatron_jit",  # stdlib only: the package's __init__ installs its import hook
})
#: Packages whose __init__ runs on the way to an allowed module (kept free of other imports).
PACKAGES = frozenset({"megascale_omni", "megascale_omni.control", "megascale_omni.metrics", "megascale_omni.utils",
                      "megascale_omni.preflight"})


def framework_imports(source: str, module: str) -> set[str]:
    """Modules of megascale_omni (outside the scheduler) that ``source``, the
    text of ``module``, imports; relative imports resolved, ``from pkg import
    name`` counted as ``pkg.name`` when that is a module."""
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if (PACKAGE.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(
                ".py").exists() else base for a in node.names]
        else:
            continue
        found |= {n for n in names
                  if n.split(".")[0] == "megascale_omni" and not n.startswith("megascale_omni.scheduler")}
    return found


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def test_the_scheduler_imports_only_the_control_client_and_the_metrics_schema():
    offending = {}
    for path in sorted((PACKAGE / "scheduler").glob("*.py")):
        outside = framework_imports(path.read_text(), _module_of(path)) - ALLOWED
        if outside:
            offending[path.name] = sorted(outside)
    assert offending == {}
    # The allowed modules stay leaves: they import nothing of the framework beyond each other.
    for module in sorted(ALLOWED):
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        assert framework_imports(path.read_text(), module) <= ALLOWED, module


def test_the_check_catches_a_framework_import():
    source = ("from megascale_omni.config import JobConfig\nfrom ..training import trainer\n"
              "import megascale_omni.metrics.schema\n")
    assert framework_imports(source, "megascale_omni.scheduler.x") == {"megascale_omni.config",
                                                                       "megascale_omni.training.trainer",
                                                                       "megascale_omni.metrics.schema"}


def test_importing_every_scheduler_module_loads_no_torch_and_nothing_else_of_the_framework():
    code = ("import importlib, json, pkgutil, sys\n"
            "import megascale_omni.scheduler as s\n"
            "for m in pkgutil.iter_modules(s.__path__): importlib.import_module('megascale_omni.scheduler.' + m.name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=120)
    loaded = set(json.loads(out.stdout))
    assert "torch" not in loaded
    framework = {m for m in loaded if m.startswith("megascale_omni") and not m.startswith("megascale_omni.scheduler")}
    assert framework <= ALLOWED | PACKAGES, sorted(framework - ALLOWED - PACKAGES)
