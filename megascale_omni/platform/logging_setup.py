"""Process-wide logging with a rank prefix."""

from __future__ import annotations

import logging
import os
import sys
import warnings


def setup_logging(level: str = "INFO") -> None:
    """Configure root logging as ``[rank R] LEVEL name: message`` (every rank).

    Non-zero ranks log at WARNING and above unless MEGASCALE_LOG_ALL_RANKS=1,
    so a 16-rank job does not print every line 16 times.
    """
    rank = int(os.environ.get("RANK", "0"))
    verbose = rank == 0 or os.environ.get("MEGASCALE_LOG_ALL_RANKS") == "1"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level if verbose else "WARNING")
    # megatron-core logs every parameter name and its full config at INFO.
    logging.getLogger("megatron").setLevel(max(logging.WARNING, root.level))
    silence_import_warnings()


def silence_import_warnings() -> None:
    """megatron-core warns at import time that TE/apex are absent and about
    its own deprecations; on CPU that is the expected configuration, not news."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine is not installed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="megatron")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.jit")
