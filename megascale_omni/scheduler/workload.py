"""Generated many-job workloads with queues, from published summary
statistics of production GPU-cluster traces (the traces themselves are not
needed; sources and which figures are assumptions: docs/scheduler.md,
"Generated workloads").

:func:`generate` draws a trace document (the YAML/JSON format of
``trace.py``; :func:`generate_trace` validates it into a :class:`Trace`):

- **arrivals**: ``jobs`` arrivals over ``window_min``, at the trace's
  hourly rate (:func:`arrival_times`);
- **size**: a job's GPU-time class is drawn with the class shares, its
  GPU-hours from the class's empirical deciles, its requested GPUs from the
  class's empirical counts; its run time at the requested size is
  GPU-hours / GPUs;
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


#: Where every figure below comes from: Pollux's artifact (Qiao et al., OSDI'21),
#: branch ``osdi21-artifact`` of github.com/petuum/adaptdl, commit c793c70:
#: ``simulator/traces/philly.csv`` (82,247 jobs of the Microsoft Philly trace,
#: Jeon et al., ATC'19: submit time, duration, GPUs, GPU-time) and
#: ``simulator/workload.py`` (how Pollux drew its 160-job workloads from it:
#: jobs of at least 60 s and under 1000 GPU-hours, submitted between 02:00 and
#: 10:00, split by GPU-time into four classes). The counts were computed from
#: that CSV with that filter (docs/scheduler.md, "Generated workloads").
PHILLY_SOURCE = "petuum/adaptdl@c793c70 simulator/traces/philly.csv, filtered as simulator/workload.py"


@dataclass(frozen=True)
class SizeClass:
    """Jobs of ``share`` of the arrivals. A job's GPU-hours are drawn from
    the class's empirical distribution, ``gpu_hours`` = its deciles (11
    values, minimum to maximum, interpolated log-linearly between them); its
    requested GPUs from ``gpus`` = ``((gpus, jobs), ...)``, weighted by the
    job counts."""

    name: str
    share: float
    gpu_hours: tuple[float, ...]
    gpus: tuple[tuple[int, int], ...]

    def draw_gpu_hours(self, rng: random.Random) -> float:
        """GPU-hours from the deciles: a uniform quantile, log-linear between the two deciles around it."""
        u = rng.random() * 10
        i = min(int(u), 9)
        lo, hi = math.log(self.gpu_hours[i]), math.log(self.gpu_hours[i + 1])
        return math.exp(lo + (hi - lo) * (u - i))


#: The four GPU-time classes of Pollux's workload.py (< 1, 1-10, 10-100,
#: 100-1000 GPU-hours). Shares and GPU-hour deciles: the 31,293 filtered jobs
#: submitted 02:00-10:00 (24,498 / 4,771 / 1,438 / 586). GPUs: small and
#: medium jobs request what they requested in the trace (same 31,293 jobs);
#: for large and xlarge jobs Pollux draws the GPU count from the class's jobs
#: that lasted at most 24 hours (whole filtered trace: 2,499 and 169 jobs),
#: and so does this generator. Pollux then replaced the sizes by those of its
#: own benchmark models; here they are the request (``replicas.max``).
PHILLY_CLASSES = (
    SizeClass("small", 24498 / 31293,
              (0.017, 0.02, 0.044, 0.093, 0.18, 0.26, 0.369, 0.467, 0.605, 0.723, 1.0),
              ((1, 24063), (2, 74), (4, 241), (8, 109), (16, 11))),
    SizeClass("medium", 4771 / 31293,
              (1.0, 1.097, 1.167, 1.396, 1.56, 1.737, 2.468, 3.027, 3.994, 6.149, 9.983),
              ((1, 4540), (2, 9), (4, 93), (8, 103), (12, 1), (16, 15), (24, 2), (32, 8))),
    SizeClass("large", 1438 / 31293,
              (10.049, 12.332, 14.536, 17.22, 20.097, 25.746, 30.6, 37.583, 51.135, 71.353, 99.858),
              ((1, 1348), (2, 114), (4, 588), (8, 402), (12, 1), (16, 26), (32, 17), (64, 3))),
    SizeClass("xlarge", 586 / 31293,
              (100.769, 113.221, 131.567, 160.188, 201.514, 239.16, 305.612, 389.276, 502.647, 704.08, 999.307),
              ((8, 103), (16, 31), (32, 32), (64, 1), (128, 2))),
)

#: Filtered jobs submitted in each hour from 02:00 to 09:59 (same CSV and
#: filter): the arrival rate through the window, peaking at 07:00.
PHILLY_HOURLY_ARRIVALS = (3550, 3368, 2240, 3728, 5169, 6585, 3499, 3154)


@dataclass(frozen=True)
class WorkloadSpec:
    """What :func:`generate` draws. The defaults are Pollux's Philly-derived
    workload: 160 jobs submitted over 8 hours (02:00-10:00 of the trace's
    days) on 64 GPUs."""

    jobs: int = 160
    window_min: float = 480.0
    gpus: int = 64
    classes: tuple[SizeClass, ...] = PHILLY_CLASSES
    hourly_arrivals: tuple[int, ...] = PHILLY_HOURLY_ARRIVALS
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
        if self.gpus < 1 or not self.hourly_arrivals:
            raise ValueError("need gpus >= 1 and at least one arrival weight")


def arrival_times(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    """``spec.jobs`` arrival minutes, sorted: each independently in a slot of
    ``window_min / len(hourly_arrivals)`` minutes picked with the slot's
    weight, uniform within it. Like Pollux's sampling of the trace's jobs:
    a Poisson process conditioned on its count, at the trace's hourly rate."""
    slot = spec.window_min / len(spec.hourly_arrivals)
    slots = rng.choices(range(len(spec.hourly_arrivals)), spec.hourly_arrivals, k=spec.jobs)
    return sorted((k + rng.random()) * slot for k in slots)


def generate(spec: WorkloadSpec, seed: int, name: str | None = None) -> dict:
    """A trace document (the trace file format) for ``spec``, deterministic
    for ``seed``. A request above the cluster's GPUs is capped at the cluster."""
    rng = random.Random(f"workload:{seed}")
    weights = [c.share for c in spec.classes]
    jobs = []
    for i, t in enumerate(arrival_times(spec, rng)):
        cls = rng.choices(spec.classes, weights)[0]
        gpu_hours = cls.draw_gpu_hours(rng)
        request = min(spec.gpus, rng.choices([g for g, _ in cls.gpus], [n for _, n in cls.gpus])[0])
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
