"""Start torchft's lighthouse in about a second: run this file by its path
with the lighthouse's own arguments (``python .../lighthouse_main.py
--min_replicas 1 --bind [::]:29510 ...``; :func:`lighthouse_argv`).

torchft's ``torchft_lighthouse`` script imports the ``torchft`` package,
which imports torch: 25 s at a load average of 55 on the 2-core development
machine (0.7 s for this file), and while a killed lighthouse is being
restarted no replica group can get a quorum. The lighthouse itself is Rust
(``torchft._torchft.lighthouse_main``); this file loads that extension
module alone, without running the package's ``__init__``, and calls it with
the same arguments (it reads the process's arguments after the interpreter:
this file's path stands where the script's name would).

Only the standard library is imported here (run by path, not ``-m``: the
``megascale_omni`` package's ``__init__`` imports megatron).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def lighthouse_argv(python: str, args: list[str]) -> list[str]:
    """The command line that starts a lighthouse with ``args`` under ``python``."""
    return [python, str(Path(__file__).resolve()), *args]


def _load_extension():
    """torchft's compiled module, loaded without importing the ``torchft`` package."""
    spec = importlib.util.find_spec("torchft")  # finds a top-level package without running it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torchft is not installed: pip install torchft (setup.py's pin)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"_torchft{suffix}"
        if path.exists():
            loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(path))
            module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
            loader.exec_module(module)
            return module
    raise SystemExit(f"torchft's compiled module _torchft is missing from {folder}")


if __name__ == "__main__":
    sys.exit(_load_extension().lighthouse_main())
