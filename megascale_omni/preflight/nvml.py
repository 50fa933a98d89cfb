"""NVML's error counters of a CUDA device (``pynvml``, from the
``nvidia-ml-py`` package), where present.

Thin on purpose: NVML is the driver's own record of a device's health and
has no substitute in torch. Without ``pynvml``, or where the driver does not
support a query (a consumer GPU has no ECC), the check is skipped with the
reason. Never called on CPU.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megascale_omni.preflight.result import CheckResult, judge, skipped

NO_PYNVML = "pynvml is not installed (pip install nvidia-ml-py)"


def _pynvml() -> Optional[Any]:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _handle(nvml: Any, device: torch.device) -> Any:
    """The NVML handle of ``device``, found by PCI bus id (CUDA_VISIBLE_DEVICES renumbers CUDA devices)."""
    props = torch.cuda.get_device_properties(device)
    bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"  # NVML's own form
    return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)


def nvml_counters(device: torch.device, max_ecc_errors: int) -> list[CheckResult]:
    """``device_ecc``: volatile (since the driver loaded) uncorrected ECC errors, at most ``max_ecc_errors``."""
    nvml = _pynvml()
    if nvml is None:
        return [skipped("device_ecc", NO_PYNVML)]
    nvml.nvmlInit()
    try:
        handle = _handle(nvml, device)
        errors = nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    except nvml.NVMLError as exc:
        return [skipped("device_ecc", f"NVML cannot report ECC errors here ({exc})")]
    finally:
        nvml.nvmlShutdown()
    return [judge("device_ecc", float(errors), "errors", float(max_ecc_errors), "preflight.max_ecc_errors", "<=",
                  detail="volatile uncorrected")]


class XidWatch:
    """Counts critical XID events of a device while its ``with`` block runs
    (NVML reports them as events; it keeps no history to query)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.nvml = _pynvml()
        self.reason = NO_PYNVML if self.nvml is None else ""
        self.xids: list[int] = []
        self._events = None

    def __enter__(self) -> "XidWatch":
        if self.nvml is None:
            return self
        nvml = self.nvml
        nvml.nvmlInit()
        try:
            self._events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(_handle(nvml, self.device), nvml.nvmlEventTypeXidCriticalError, self._events)
        except nvml.NVMLError as exc:
            self.reason = f"NVML cannot watch XID events here ({exc})"
            self._close()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._events is None:
            return
        nvml = self.nvml
        try:
            while True:
                data = nvml.nvmlEventSetWait(self._events, 0)
                self.xids.append(int(data.eventData))
        except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: no more events
            pass
        self._close()

    def _close(self) -> None:
        if self._events is not None:
            self.nvml.nvmlEventSetFree(self._events)
            self._events = None
        self.nvml.nvmlShutdown()

    def result(self, max_xid_events: int) -> CheckResult:
        if self.reason:
            return skipped("device_xid", self.reason)
        return judge("device_xid", float(len(self.xids)), "events", float(max_xid_events), "preflight.max_xid_events",
                     "<=", detail=f"XIDs {self.xids}" if self.xids else "")
