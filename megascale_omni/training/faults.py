"""Fault injection for testing failure handling on real processes.

``MEGASCALE_INJECT_FAULT=step:N`` makes optimizer step N (1-based) raise
:class:`InjectedFault` on every rank after its micro-batches are built and
before any parameter changes. Unset (the default), this module does nothing.
"""

from __future__ import annotations

import os

ENV = "MEGASCALE_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """Raised on purpose by a test through ``MEGASCALE_INJECT_FAULT``."""


def injected_fault_step() -> int | None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    kind, _, value = spec.partition(":")
    if kind != "step" or not value.isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected step:N with N a positive integer")
    return int(value)


def maybe_fail(step: int, fault_step: int | None) -> None:
    """Raise if ``step`` (1-based, the step being executed) is the injected one."""
    if fault_step is not None and step == fault_step:
        raise InjectedFault(f"injected failure at step {step} ({ENV})")
