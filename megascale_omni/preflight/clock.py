"""Clock skew between ranks: each rank's wall clock against rank 0's.

Every round, the ranks leave a barrier together (within the collective's
latency: microseconds on a fabric, well under a millisecond on loopback),
read their clock at once and all-gather the readings; a rank's offset is the
median over rounds of its reading minus rank 0's. Timestamps in logs, step
records and checkpoints of different nodes are comparable only when this
is small. The clock is injectable (``clock``), so tests plant an offset.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megascale_omni.config.preflight_section import PreflightConfig
from megascale_omni.preflight.result import CheckResult, judge, skipped

Clock = Callable[[], float]
#: ``(this rank's reading) -> every rank's reading``, in rank order, after a barrier.
Exchange = Callable[[float], Sequence[float]]


def offsets_vs_rank0(clock: Clock, exchange: Exchange, rounds: int) -> list[float]:
    """Median offset of every rank's clock from rank 0's, seconds, in rank order."""
    per_round = [list(exchange(clock())) for _ in range(rounds)]
    return [statistics.median(r[i] - r[0] for r in per_round) for i in range(len(per_round[0]))]


def group_exchange(device: torch.device) -> Exchange:
    """:data:`Exchange` over the default process group (fp64 readings on ``device``)."""
    def exchange(reading: float) -> list[float]:
        out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(out, torch.tensor([reading], dtype=torch.float64, device=device))
        return [float(t.item()) for t in out]

    return exchange


def check_clock(pf: PreflightConfig, device: torch.device, clock: Clock, rank: int) -> list[CheckResult]:
    """``clock_skew``: |this rank's offset from rank 0| against ``preflight.max_clock_skew_ms`` (every rank)."""
    if dist.get_world_size() == 1:
        return [skipped("clock_skew", "one rank: no other clock")]
    exchange = group_exchange(device)

    def read_after_barrier() -> float:
        dist.barrier()
        return clock()

    offsets = offsets_vs_rank0(read_after_barrier, exchange, pf.clock_rounds)
    return [skew_result(offsets[rank], pf.max_clock_skew_ms, reference=rank == 0)]


def skew_result(offset_s: float, max_skew_ms: float, reference: bool = False) -> CheckResult:
    """``clock_skew`` of a rank whose clock is ``offset_s`` seconds off rank 0's (``reference``: rank 0 itself)."""
    detail = "the reference clock" if reference else f"clock {'ahead of' if offset_s >= 0 else 'behind'} rank 0's"
    return judge("clock_skew", abs(offset_s) * 1e3, "ms", max_skew_ms, "preflight.max_clock_skew_ms", "<=",
                 detail=detail)
