"""Device health: a timed matmul against a floor, and on CUDA the free
device memory and NVML's error counters (:mod:`.nvml`).

Every rank checks its own device; all results are node-scope.
"""

from __future__ import annotations

import time

import torch

from megascale_omni.config.preflight_section import PreflightConfig
from megascale_omni.preflight.nvml import XidWatch, nvml_counters
from megascale_omni.preflight.result import CheckResult, judge

#: Matmul side when ``preflight.matmul_size`` is null.
DEFAULT_MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, iters: int) -> float:
    """FLOP/s of ``iters`` back-to-back ``n x n`` matmuls after one warm-up.

    Raises ValueError when the product is not finite (a device computing garbage).
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype) / n ** 0.5
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        out = torch.matmul(a, b, out=out)
    synchronize(device)
    elapsed = time.perf_counter() - start
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"the {n}x{n} matmul on {device} produced NaN or Inf")
    return 2.0 * n ** 3 * iters / max(elapsed, 1e-9)


def check_device(pf: PreflightConfig, device: torch.device) -> list[CheckResult]:
    """``device_matmul`` on every device; on CUDA also ``device_memory``,
    and ``device_ecc`` / ``device_xid`` where NVML is present."""
    n = pf.matmul_size or DEFAULT_MATMUL_SIZE["cuda" if device.type == "cuda" else "cpu"]
    if device.type != "cuda":
        gflops = matmul_flops(device, torch.float32, n, pf.matmul_iters) / 1e9
        return [judge("device_matmul", gflops, "GFLOP/s", pf.min_cpu_matmul_gflops, "preflight.min_cpu_matmul_gflops",
                      detail=f"fp32 {n}x{n} on cpu")]
    free, total = torch.cuda.mem_get_info(device)  # before our own operands take any
    results = [judge("device_memory", free / total, "of total", pf.min_free_memory_fraction,
                     "preflight.min_free_memory_fraction",
                     detail=f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB on {device}")]
    with XidWatch(device) as xids:
        tflops = matmul_flops(device, torch.bfloat16, n, pf.matmul_iters) / 1e12
    results.append(judge("device_matmul", tflops, "TFLOP/s", pf.min_matmul_tflops, "preflight.min_matmul_tflops",
                         detail=f"bf16 {n}x{n} on {torch.cuda.get_device_name(device)}"))
    results.append(xids.result(pf.max_xid_events))
    results.extend(nvml_counters(device, pf.max_ecc_errors))
    return results
