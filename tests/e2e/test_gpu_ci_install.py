"""tools/gpu_ci/run.sh --check-install on this CPU host: an interpreter that has
only torch gets constraints.txt's wheels for its Python with no index, into
a --target folder, and imports megascale_omni (from the checkout),
megatron.core and torchft (from that folder) without touching its torch.

The torch-only venv (``pip install -c constraints.txt torch``: this disk's CPU
wheel) and the wheels (tools/gpu_ci/prepare_wheels.sh for this Python, from
the package registry) are built once, concurrently, and cached under the
pytest cache, keyed by constraints.txt, prepare_wheels.sh and the Python
version; run.sh itself installs and imports afresh every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher import REPO, finish, run, spawn

# Generous: under a loaded 2-core machine the first run (building the cached venv) took 9.5 minutes.
pytestmark = pytest.mark.timeout(1200)
PYV = f"{sys.version_info.major}.{sys.version_info.minor}"


def _pip_list(python: Path) -> list[str]:
    res = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return sorted(res.stdout.split())


@pytest.fixture(scope="module")
def torch_only(request):
    """(python of a venv with torch and its dependencies only, cp{PYV} wheel folder)."""
    key = hashlib.sha256(b"".join((REPO / f).read_bytes() for f in ("constraints.txt", "tools/gpu_ci/prepare_wheels.sh"))
                         + PYV.encode()).hexdigest()[:16]
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    root = (Path(cache.mkdir("gpu-ci-torch-only")) if cache else request.getfixturevalue("tmp_path_factory").mktemp(
        "gpu-ci-torch-only")) / key
    venv, wheels, done = root / "venv", root / "wheels", root / "complete"
    if not done.is_file():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        download = spawn(["bash", "tools/gpu_ci/prepare_wheels.sh", "--python-version", PYV, str(wheels)], 500,
                         env={"PYTHON": sys.executable})
        made = run([sys.executable, "-m", "venv", str(venv)], 300)
        assert made.returncode == 0, made.output[-3000:]
        torch = run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "-c", str(REPO / "constraints.txt"),
                     "torch"], 500)
        assert torch.returncode == 0, torch.output[-3000:]
        got = finish(download, 500)
        assert got.returncode == 0, got.output[-3000:]
        done.write_text("ok\n")
    return venv / "bin/python", wheels


def test_check_install_installs_the_wheels_beside_the_interpreters_torch(torch_only, tmp_path):
    python, wheels = torch_only
    before = _pip_list(python)
    assert [p for p in before if p.startswith(("megatron", "torchft", "numpy"))] == []
    torch_version = next(p for p in before if p.startswith("torch=="))
    site, out = tmp_path / "site", tmp_path / "out"
    res = run(["tools/gpu_ci/run.sh", "--check-install", str(wheels)], 600,
              env={"PYTHON": str(python), "OUT": str(out), "GPU_CI_SITE": str(site), "PYTHONPATH": ""})
    assert res.returncode == 0, res.output[-4000:]
    assert "imports ok: megatron-core 0.16.1" in res.stdout

    results = json.loads((out / "results.json").read_text())
    assert results["ok"] is True and sorted(results["steps"]) == ["host", "install"]
    install = results["install"]
    modules = {name: Path(m["file"]) for name, m in install["modules"].items()}
    assert modules["megascale_omni"] == REPO / "megascale_omni/__init__.py"
    assert modules["megatron.core"].is_relative_to(site) and modules["torchft"].is_relative_to(site)
    assert install["modules"]["megatron.core"]["version"] == "0.16.1"
    # The interpreter's own torch served the import, and its environment is unchanged.
    assert Path(install["torch"]["file"]).is_relative_to(python.parent.parent)
    assert results["host"]["torch"].split("+")[0] == torch_version.split("==")[1].split("+")[0]
    assert not any(site.glob("torch/__init__.py"))
    assert _pip_list(python) == before
    assert len(install["wheels"]) == len(list(wheels.glob("*.whl"))) > 20


def test_check_install_fails_naming_the_module_a_missing_wheel_breaks(torch_only, tmp_path):
    python, wheels = torch_only
    partial = tmp_path / "wheels"
    partial.mkdir()
    # Only PyYAML: the install succeeds (quickly), the import check must not.
    [yaml] = wheels.glob("pyyaml-*.whl")
    os.symlink(yaml, partial / yaml.name)
    out = tmp_path / "out"
    res = run(["tools/gpu_ci/run.sh", "--check-install", str(partial)], 600,
              env={"PYTHON": str(python), "OUT": str(out), "GPU_CI_SITE": str(tmp_path / "site"), "PYTHONPATH": ""})
    assert res.returncode == 3, res.output[-4000:]
    assert "install check: import megatron.core failed: ModuleNotFoundError(\"No module named 'megatron'\")" in res.output
    results = json.loads((out / "results.json").read_text())
    assert results["ok"] is False and results["steps"]["install"]["rc"] == 3

    empty = tmp_path / "none"
    res = run(["tools/gpu_ci/run.sh", "--check-install", str(empty)], 300,
              env={"PYTHON": str(python), "OUT": str(out), "PYTHONPATH": ""})
    assert res.returncode == 3
    assert f"--check-install: no wheels in {empty}; run tools/gpu_ci/prepare_wheels.sh" in res.stderr


def test_make_test_gpu_runs_with_the_given_interpreter_and_no_venv(tmp_path):
    """`make test-gpu` neither builds .venv nor needs python3.11: here GPU_PYTHON is this
    interpreter, no wheels, and tests/gpu skips every case on a host without CUDA."""
    out = tmp_path / "out"
    res = run(["make", "--no-print-directory", "test-gpu", f"GPU_PYTHON={sys.executable}",
               f"GPU_WHEELS={tmp_path / 'none'}", "PYTHON=/nonexistent/python3.11", f"VENV={tmp_path / 'venv'}"], 600,
              env={"OUT": str(out)})
    assert res.returncode == 0, res.output[-4000:]
    assert not (tmp_path / "venv").exists()
    results = json.loads((out / "results.json").read_text())
    assert sorted(results["steps"]) == ["host", "install", "tests_gpu"] and results["ok"] is True
    tests = results["tests_gpu"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"] and tests["rc"] == 0
    assert results["host"]["executable"] == sys.executable


def test_pip_installs_the_package_beside_an_existing_torch_without_replacing_it(torch_only, tmp_path):
    """setup.py's ranges alone (no constraints file), resolved by pip against the package
    registry in the torch-only venv: everything but torch is to be installed."""
    python, _ = torch_only
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "setup.py", src)
    shutil.copytree(REPO / "megascale_omni", src / "megascale_omni", ignore=shutil.ignore_patterns("__pycache__"))
    built = run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                 "-w", str(tmp_path / "whl"), str(src)], 240)
    assert built.returncode == 0, built.output[-3000:]
    [wheel] = (tmp_path / "whl").glob("megascale_omni-*.whl")
    report = tmp_path / "report.json"
    res = run([str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--only-binary=:all:", "--report",
               str(report), f"{wheel}[hf,chat]"], 400)
    assert res.returncode == 0, res.output[-3000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"megascale-omni", "megatron-core", "torchft", "safetensors", "transformers"} <= names
    assert [n for n in names if n == "torch" or n.startswith(("nvidia-", "triton"))] == []
