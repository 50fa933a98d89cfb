"""The built package metadata installs beside an existing torch and declares
every third-party import.

The metadata is read from a wheel built from a copy of this checkout
(``pip wheel --no-deps --no-build-isolation``: the metadata pip itself would
install). The imports are found by scanning ``megascale_omni/`` with ``ast``:
``import x`` / ``from x import y`` anywhere, plus string literals passed to
``importlib.util.find_spec``, ``importlib.import_module``, ``__import__`` and
the latent tools' ``_require``.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]

# Import name -> distribution name where they differ (otherwise "_" -> "-").
DIST_OF_IMPORT = {
    "yaml": "pyyaml",
    "PIL": "pillow",
    "megatron": "megatron-core",
    "transformer_engine": "transformer-engine",
    "pynvml": "nvidia-ml-py",
}
# Imports only optional features make; each must sit in these extras and not in install_requires,
# and never at a module's top level (a core install would fail to import that module).
OPTIONAL_EXTRAS = {
    "safetensors": {"hf"},
    "transformers": {"chat", "latents", "hf"},
    "diffusers": {"latents"},
    "matplotlib": {"report"},
    "transformer-engine": {"gpu"},
    "flash-attn": {"gpu"},
    "nvidia-ml-py": {"gpu"},
    "einops": {"cp"},
    "av": {"video"},
}
# Names a module may not use under Python 3.10 (added in 3.11). Syntax new in 3.12 already fails
# to parse here; except* parses here and is checked separately.
NEW_IN_311_MODULES = {"tomllib", "wsgiref.types"}
NEW_IN_311_NAMES = {
    "typing": {"Self", "Never", "LiteralString", "assert_never", "assert_type", "reveal_type", "NotRequired",
               "Required", "TypeVarTuple", "Unpack", "dataclass_transform", "override"},
    "datetime": {"UTC"},
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member", "nonmember", "global_enum"},
    "hashlib": {"file_digest"},
    "contextlib": {"chdir"},
    "operator": {"call"},
    "math": {"cbrt", "exp2"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner"},
    "itertools": {"batched"},
    "logging": {"getLevelNamesMapping"},
    "sys": {"exception"},
    "re": {"NOFLAG"},
}
DYNAMIC_IMPORTERS = {"find_spec", "import_module", "__import__", "_require"}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def dist_of(import_name: str) -> str:
    return canonical(DIST_OF_IMPORT.get(import_name, import_name))


class _ImportScan(ast.NodeVisitor):
    """Top-level third-party import names of one module, with whether each
    occurrence is eager (at module level, outside try)."""

    def __init__(self) -> None:
        self.found: dict[str, bool] = {}  # name -> any eager occurrence
        self._depth = 0  # enclosing functions / try blocks

    def _add(self, dotted: str) -> None:
        top = dotted.split(".")[0]
        if top and top not in sys.stdlib_module_names and top != "megascale_omni" and top != "__future__":
            self.found[top] = self.found.get(top, False) or self._depth == 0

    def _nested(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Try = _nested
    visit_TryStar = _nested

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.level and node.module:
            self._add(node.module)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in DYNAMIC_IMPORTERS and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            # A probe (find_spec) or a guarded lazy import: never eager.
            depth, self._depth = self._depth, self._depth + 1
            self._add(node.args[0].value)
            self._depth = depth
        self.generic_visit(node)


def scan_imports(root: Path) -> dict[str, dict[str, bool]]:
    """Distribution name -> {module path: eager} for every third-party import under ``root``."""
    out: dict[str, dict[str, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        scan = _ImportScan()
        scan.visit(ast.parse(path.read_text(), filename=str(path)))
        for name, eager in scan.found.items():
            out.setdefault(dist_of(name), {})[str(path.relative_to(root.parent))] = eager
    return out


def declared(requires: list[str]) -> tuple[dict[str, Requirement], dict[str, set[str]]]:
    """``Requires-Dist`` lines -> (core requirements by name, extras that list each name)."""
    core: dict[str, Requirement] = {}
    extras: dict[str, set[str]] = {}
    for line in requires:
        req = Requirement(line)
        name = canonical(req.name)
        marker = str(req.marker) if req.marker else ""
        if "extra" in marker:
            extra = marker.split("==")[1].strip().strip("'\"")
            extras.setdefault(name, set()).add(extra)
        else:
            core[name] = req
    return core, extras


def import_problems(imports: dict[str, dict[str, bool]], requires: list[str]) -> list[str]:
    """Every scanned import that the metadata does not declare where it belongs."""
    core, extras = declared(requires)
    problems = []
    for dist, where in sorted(imports.items()):
        if dist in OPTIONAL_EXTRAS:
            missing = OPTIONAL_EXTRAS[dist] - extras.get(dist, set())
            if missing:
                problems.append(f"{dist} (imported in {sorted(where)}) is missing from extras {sorted(missing)}")
            if dist in core:
                problems.append(f"{dist} is optional but in install_requires")
            eager = sorted(p for p, e in where.items() if e)
            if eager:
                problems.append(f"{dist} is optional but imported at module level in {eager}")
        elif dist not in core:
            problems.append(f"{dist} (imported in {sorted(where)}) is not in install_requires")
    return problems


def torch_problems(requires: list[str]) -> list[str]:
    """The torch requirement must be a range that admits the GPU image's and the CPU environment's torch."""
    core, _ = declared(requires)
    torch = core.get("torch")
    if torch is None:
        return ["torch is not in install_requires"]
    problems = [f"torch is pinned exactly ({torch.specifier})" for s in torch.specifier if s.operator in ("==", "===")]
    for version in ("2.11.0+cu130", "2.11.0a0+nv25.10", "2.13.0+cpu"):
        if not torch.specifier.contains(version, prereleases=True):
            problems.append(f"torch {torch.specifier} refuses {version}")
    return problems


def new_in_311(root: Path) -> list[str]:
    """Uses of stdlib names and syntax that Python 3.10 lacks."""
    found = []
    for path in sorted(root.rglob("*.py")):
        aliases: dict[str, str] = {}
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if type(node).__name__ == "TryStar":
                found.append(f"{where} except*")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name] = a.name
                    if a.name in NEW_IN_311_MODULES:
                        found.append(f"{where} import {a.name}")
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module in NEW_IN_311_MODULES:
                    found.append(f"{where} from {node.module}")
                found += [f"{where} {node.module}.{a.name}" for a in node.names
                          if a.name in NEW_IN_311_NAMES.get(node.module, ())]
            elif isinstance(node, ast.Name) and node.id in ("ExceptionGroup", "BaseExceptionGroup"):
                found.append(f"{where} {node.id}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                module = aliases.get(node.value.id)
                if module and node.attr in NEW_IN_311_NAMES.get(module, ()):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {module}.{node.attr}")
    return found


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    """PKG metadata (an email.message.Message) of a wheel built from a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    src.mkdir()
    shutil.copy(REPO / "setup.py", src)
    shutil.copytree(REPO / "megascale_omni", src / "megascale_omni",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp / "wheel"), str(src)],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    [wheel] = (tmp / "wheel").glob("megascale_omni-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        [name] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(zf.read(name).decode())


def test_torch_is_a_range_and_megatron_core_one_minor_line(metadata):
    requires = metadata.get_all("Requires-Dist")
    assert torch_problems(requires) == []
    core, _ = declared(requires)
    assert str(core["megatron-core"].specifier) == "<0.17,>=0.16.1"
    # Every core requirement is a range: an exact pin would make pip replace what an image already has.
    assert [str(r) for r in core.values() if any(s.operator in ("==", "===") for s in r.specifier)] == []


def test_python_requires_admits_310_to_312(metadata):
    spec = SpecifierSet(metadata["Requires-Python"])
    assert [v for v in ("3.10.0", "3.11.7", "3.12.1") if v not in spec] == []
    assert "3.9.18" not in spec


def test_every_third_party_import_is_declared(metadata):
    imports = scan_imports(REPO / "megascale_omni")
    # The scan sees what the package imports (a scan that found nothing would pass anything).
    assert {"torch", "megatron-core", "torchft", "pyyaml", "pillow", "safetensors", "transformers",
            "diffusers", "transformer-engine"} <= set(imports)
    assert import_problems(imports, metadata.get_all("Requires-Dist")) == []


def test_the_checks_fail_on_an_undeclared_import_and_an_exact_torch_pin(metadata, tmp_path):
    pkg = tmp_path / "megascale_omni"
    pkg.mkdir()
    (pkg / "good.py").write_text("import yaml\nimport torch.nn\n\ndef f():\n    import safetensors\n")
    (pkg / "bad.py").write_text("import numpy\nimport undeclared_pkg.sub\nfrom transformers import AutoTokenizer\n")
    problems = import_problems(scan_imports(pkg), metadata.get_all("Requires-Dist"))
    assert problems == [
        "transformers is optional but imported at module level in ['megascale_omni/bad.py']",
        "undeclared-pkg (imported in ['megascale_omni/bad.py']) is not in install_requires",
    ]
    pinned = [r if Requirement(r).name != "torch" else "torch==2.13.0" for r in metadata.get_all("Requires-Dist")]
    assert torch_problems(pinned)[0] == "torch is pinned exactly (==2.13.0)"
    assert torch_problems(["torch>=2.12,<2.14"]) == ["torch <2.14,>=2.12 refuses 2.11.0+cu130",
                                                      "torch <2.14,>=2.12 refuses 2.11.0a0+nv25.10"]
    undeclared = [r for r in metadata.get_all("Requires-Dist") if Requirement(r).name != "safetensors"]
    assert import_problems({"safetensors": {"megascale_omni/hf/directory.py": False}}, undeclared) == [
        "safetensors (imported in ['megascale_omni/hf/directory.py']) is missing from extras ['hf']"]


def test_no_stdlib_name_newer_than_python_310():
    assert new_in_311(REPO / "megascale_omni") == []


def test_the_311_scan_finds_each_kind_of_use(tmp_path):
    pkg = tmp_path / "megascale_omni"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import tomllib\nimport datetime as dt\nfrom typing import Self\n"
        "x = dt.UTC\ntry:\n    pass\nexcept* ValueError:\n    pass\n")
    assert new_in_311(pkg) == ["megascale_omni/m.py:1 import tomllib", "megascale_omni/m.py:3 typing.Self",
                               "megascale_omni/m.py:5 except*", "megascale_omni/m.py:4 datetime.UTC"]
