"""megatron's ``jit_fuser`` defers ``torch.compile`` to a fused function's
first call (megascale_omni/megatron_jit.py): the same call, the same
arguments, once; and importing megatron after our package no longer loads
``torch._inductor``."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from megascale_omni.megatron_jit import deferred_compile
from tests.launcher import REPO


def _recording_compile(calls: list):
    def fake_compile(fn, **options):
        calls.append((fn, options))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))
    return fake_compile


def test_the_first_call_compiles_once_with_the_decorators_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", _recording_compile(calls))

    def add(a, b):
        """Adds."""
        return a + b

    plain = deferred_compile(add)
    with_options = deferred_compile(mode="max-autotune", dynamic=False)(add)
    assert calls == []  # decorating compiles nothing
    assert plain.__name__ == "add" and plain.__doc__ == "Adds." and plain.__wrapped__ is add
    assert plain(1, 2) == ("compiled", 3) and plain(b=4, a=5) == ("compiled", 9)
    assert calls == [(add, {})]  # once, at the first call
    assert with_options(2, 3) == ("compiled", 5)
    assert calls[1] == (add, {"mode": "max-autotune", "dynamic": False})


def test_megatron_imported_after_the_package_defers_its_jit_and_skips_inductor():
    code = ("import json, sys, warnings\n"
            "warnings.simplefilter('ignore')\n"
            "import megascale_omni\n"
            "import megatron.core\n"
            "from megatron.core import jit\n"
            "from megatron.core.fusions import fused_bias_geglu\n"
            "from megascale_omni.megatron_jit import deferred_compile\n"
            "print(json.dumps({'deferred': jit.jit_fuser is deferred_compile,\n"
            "                  'inductor': 'torch._inductor.compile_fx' in sys.modules,\n"
            "                  'wrapped': fused_bias_geglu.geglu.__wrapped__.__module__}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "deferred": True, "inductor": False, "wrapped": "megatron.core.fusions.fused_bias_geglu"}
