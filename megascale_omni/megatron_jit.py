"""megatron-core's ``jit_fuser`` (``torch.compile``) sets up at a fused function's first call, not at import.

``megatron.core.jit`` binds ``jit_fuser = torch.compile``, and fifteen
megatron-core modules decorate functions with it while ``import
megatron.core`` runs. Decorating with ``torch.compile`` compiles nothing (that
happens at the first call) but builds the inductor backend object, which
imports ``torch._inductor``: 1.7 s of CPU of the 4.2 s that ``import torch,
megatron.core`` takes on the 2-core CI host (measured 2026-12-02), paid by
every rank, every checkpoint writer process and every tool that imports
megatron, whether or not a fused function ever runs.

:func:`install` (run by ``megascale_omni/__init__``, so before any module of
ours imports megatron; stdlib only: importing the package loads no torch)
adds an import hook for that one module: right after ``megatron.core.jit``
executes, its ``jit_fuser`` becomes :func:`deferred_compile`, which makes
the same ``torch.compile`` call with the same arguments when the decorated
function is first called, and calls the compiled function from then on.
What runs, and when it compiles, is unchanged; only the import is cheaper.
If megatron is imported before this package, or a megatron version binds
something other than ``torch.compile``, nothing changes.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

#: The one module whose import the hook follows.
JIT_MODULE = "megatron.core.jit"


def deferred_compile(fn: Callable | None = None, **options: Any) -> Callable:
    """``torch.compile(fn, **options)``, made at ``fn``'s first call
    (``torch.compile`` itself compiles at the first call too). Usable as
    ``@deferred_compile`` and ``@deferred_compile(**options)``, like
    ``torch.compile``."""
    if fn is None:
        return functools.partial(deferred_compile, **options)
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def compile_on_first_call(*args, **kwargs):
        if not compiled:
            import torch

            compiled.append(torch.compile(fn, **options))
        return compiled[0](*args, **kwargs)

    return compile_on_first_call


class _DeferringLoader(importlib.abc.Loader):
    """The module's own loader; after it executed the module, ``jit_fuser``
    is swapped for :func:`deferred_compile` if it is ``torch.compile``."""

    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        torch = sys.modules.get("torch")
        if torch is not None and getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = deferred_compile

    def __getattr__(self, name: str):  # get_source, get_filename, ...: tracebacks and inspect read them
        return getattr(self._inner, name)


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds :data:`JIT_MODULE` as the path finder does, behind :class:`_DeferringLoader`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (idempotent; every process
    that imports this package, before it imports megatron)."""
    if not any(isinstance(finder, _JitFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _JitFinder())
