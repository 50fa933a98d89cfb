"""Generated many-job workloads with queues, from published summary
statistics of production GPU-cluster traces (the traces themselves are not
needed; sources and which figures are assumptions: docs/scheduler.md,
"Generated workloads").

:func:`generate` draws a trace document (the YAML/JSON format of
``trace.py``; :func:`generate_trace` validates it into a :class:`Trace`):

- **arrivals**: a Poisson process, ``jobs`` arrivals spread over
  ``window_min`` (exponential gaps of mean ``window_min / jobs``);
- **size**: a job's GPU-time class is drawn with the class shares, its
  GPU-hours log-uniformly within the class, its requested GPUs uniformly
  from the class's sizes; its run time at the requested size is GPU-hours
  / GPUs;
- **elasticity**: one GPU per replica group (pure data parallelism), the
  core ``ceil(min_fraction x request)`` groups, at most the request;
- **scaling**: samples/s ``rate x n / (1 + s (n - 1))`` for ``n`` groups,
  with a communication share ``s`` drawn per job, so each group adds less
  than the one before;
- **cluster**: one bare-metal pool of ``gpus`` single-GPU nodes (GPUs are
  the allocation unit, as in the cited studies' job sizes), the move costs
  from a :class:`~megascale_omni.scheduler.model.CostModel`.

Called by ``omni-sched generate``, the scheduler benchmark and the tests;
stdlib only, deterministic for a seed.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

from megascale_omni.scheduler.model import CostModel, Trace
from megascale_omni.scheduler.trace import parse_trace


@dataclass(frozen=True)
class SizeClass:
    """Jobs of ``share`` of the arrivals, each of ``gpu_hours`` (low, high)
    GPU-hours, requesting one of ``gpus``."""

    name: str
    share: float
    gpu_hours: tuple[float, float]
    gpus: tuple[int, ...]


#: Pollux's (Qiao et al., OSDI'21, section 5.1) construction from the
#: Microsoft Philly trace (Jeon et al., ATC'19): jobs split by GPU-time into
#: small (0-1 GPU-hours) 72%, medium (1-10) 20%, large (10-100) 6% and
#: xlarge (100-1000) 2%. The lower bound of "small" (0.1 GPU-hours) and the
#: GPUs each class requests are this project's assumptions (most Philly
#: jobs request one GPU, Jeon et al.).
PHILLY_CLASSES = (
    SizeClass("small", 0.72, (0.1, 1.0), (1,)),
    SizeClass("medium", 0.20, (1.0, 10.0), (1, 2, 4)),
    SizeClass("large", 0.06, (10.0, 100.0), (4, 8)),
    SizeClass("xlarge", 0.02, (100.0, 1000.0), (8, 16)),
)


@dataclass(frozen=True)
class WorkloadSpec:
    """What :func:`generate` draws. The defaults are Pollux's Philly-derived
    workload: 160 jobs arriving over the trace's busiest 8 hours on 64 GPUs."""

    jobs: int = 160
    window_min: float = 480.0
    gpus: int = 64
    classes: tuple[SizeClass, ...] = PHILLY_CLASSES
    min_fraction: float = 0.25
    comm_share: tuple[float, float] = (0.02, 0.2)
    rate_per_gpu: float = 100.0
    tick_min: float = 1.0
    horizon_min: float = 14 * 1440.0
    cost_model: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        total = sum(c.share for c in self.classes)
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"class shares sum to {total}, not 1")
        if max(g for c in self.classes for g in c.gpus) > self.gpus:
            raise ValueError("a class requests more GPUs than the cluster has")


def generate(spec: WorkloadSpec, seed: int, name: str | None = None) -> dict:
    """A trace document (the trace file format) for ``spec``, deterministic for ``seed``."""
    rng = random.Random(f"workload:{seed}")
    weights = [c.share for c in spec.classes]
    jobs, t = [], 0.0
    for i in range(spec.jobs):
        t += rng.expovariate(spec.jobs / spec.window_min)
        cls = rng.choices(spec.classes, weights)[0]
        lo, hi = cls.gpu_hours
        gpu_hours = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        request = rng.choice(cls.gpus)
        share = rng.uniform(*spec.comm_share)
        sizes = sorted({1, request, *(2 ** k for k in range(1, 12) if 2 ** k < request)})
        curve = [[n, round(spec.rate_per_gpu * n / (1 + share * (n - 1)), 6)] for n in sizes]
        hours_at_request = gpu_hours / request
        work = hours_at_request * 3600 * curve[-1][1]
        jobs.append({
            "name": f"j{i:03d}-{cls.name}", "arrive_min": round(t, 3), "replica_gpus": 1,
            "replicas": {"min": max(1, math.ceil(spec.min_fraction * request)), "max": request},
            "work_samples": round(work, 3), "throughput": curve,
            "demand": {"phases": [{"at_min": 0, "gpus": request}]},
        })
    return {
        "version": 1, "name": name or f"philly_{spec.jobs}jobs_{spec.gpus}gpus_seed{seed}",
        "tick_min": spec.tick_min, "horizon_min": spec.horizon_min,
        "pools": [{"name": "gpus", "kind": "bare_metal", "gpus_per_node": 1, "nodes": spec.gpus}],
        "jobs": jobs, "cost_model": dataclasses.asdict(spec.cost_model),
    }


def generate_trace(spec: WorkloadSpec, seed: int, name: str | None = None) -> Trace:
    """:func:`generate`, validated by the trace parser."""
    return parse_trace(generate(spec, seed, name))
