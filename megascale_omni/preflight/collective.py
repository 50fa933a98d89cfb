"""The group's collective bandwidth: an all-reduce of a buffer, timed.

Reported as nccl-tests' bus bandwidth (``busbw = bytes / time x 2(n-1)/n``:
what each link carried in a ring all-reduce), comparable across group sizes.
Every rank of the default process group calls it; the result is the
group's (scope ``group``): a slow group names no node, since any member's
link may be the slow one.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megascale_omni.config.preflight_section import PreflightConfig
from megascale_omni.preflight.device import synchronize
from megascale_omni.preflight.result import CheckResult, judge, skipped


def allreduce_bus_gb_s(device: torch.device, mib: float, iters: int) -> float:
    """Bus bandwidth in GB/s (1e9 bytes) of ``iters`` all-reduces of ``mib`` MiB
    of fp32 on ``device``, after one warm-up (every rank of the default group)."""
    world = dist.get_world_size()
    numel = max(1, int(mib * 2**20) // 4)
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(buf)
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    synchronize(device)
    elapsed = max(time.perf_counter() - start, 1e-9)
    return numel * 4 * iters / elapsed * 2 * (world - 1) / world / 1e9


def check_allreduce(pf: PreflightConfig, device: torch.device) -> list[CheckResult]:
    """``allreduce``: the bus bandwidth against ``preflight.min_allreduce_gb_s`` (skipped for one rank)."""
    world = dist.get_world_size()
    if world == 1:
        return [skipped("allreduce", "one rank: no collective to measure", scope="group")]
    gb_s = allreduce_bus_gb_s(device, pf.allreduce_mib, pf.allreduce_iters)
    return [judge("allreduce", gb_s, "GB/s", pf.min_allreduce_gb_s, "preflight.min_allreduce_gb_s",
                  detail=f"{world} ranks, {pf.allreduce_mib:g} MiB fp32, {dist.get_backend()}", scope="group")]
