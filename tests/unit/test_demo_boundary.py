"""The demo (shapes datasets and their evaluations) stays out of the product:
no product module imports ``megascale_omni.demo``; the registry names its
parts as strings, imported only when a run uses them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megascale_omni"
#: The product packages; ``demo/`` itself and ``tasks/registry.py`` (strings only) aside.
PRODUCT = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name != "demo")


def _demo_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        else:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {n}" for n in names
                  if n == "megascale_omni.demo" or n.startswith("megascale_omni.demo.")]
    return found


def test_the_product_packages_are_the_expected_ones():
    assert {"training", "checkpoint", "parallel", "models", "data", "evaluation", "tasks"} <= set(PRODUCT)


@pytest.mark.parametrize("package", PRODUCT)
def test_no_product_package_imports_the_demo(package):
    hits = [hit for path in sorted((PACKAGE / package).rglob("*.py")) for hit in _demo_imports(path)]
    assert hits == []


def test_the_checker_sees_a_demo_import(tmp_path):
    probe = PACKAGE / "demo" / "defaults.py"
    assert _demo_imports(probe), "defaults.py imports the demo generators; the checker must see that"
