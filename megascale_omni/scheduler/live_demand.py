"""Load-aware live demand: the policy's inputs for one job, from what its
running groups report in their step records (docs/scheduler.md, "Live
inputs"). Never from outside the job (no ``nvidia-smi``): memory is the
caching allocator's high-water mark the ranks measure.

Per tick, :func:`job_load` reduces the job's observations to a
:class:`JobLoad`; :class:`DemandModel` (one per job, kept across ticks)
turns it into the policy's throughput curve and demand:

- **samples/s** at each quorum size (``participants``) is remembered
  (smoothed); sizes not measured yet are extrapolated from the best measured
  rate per group, corrected for the **pipeline bubble**: the global batch is
  fixed, so at ``n`` groups each runs ``m x n_ref / n`` micro-batches and the
  1F1B bubble ``(pp-1)/(m+pp-1)`` grows (``pp-1`` is recovered from the
  reported ``bubble_analytic`` and ``microbatches``);
- the **modality mix** (images per sample) changes the cost of a sample: when
  it moves by more than :data:`MIX_SHIFT` from the mix the rates were measured
  at, the remembered rates are dropped and measured again;
- the **per-step work** of a LLaVA job, ``tokens + c x vision_tokens`` of
  its global batch (smoothed; ``c``: :func:`tower_cost`), scales its demand: the
  global batch is fixed in samples, so when videos raise the tower's share
  (a ``data.blend_schedule`` turning to video) each step holds more work and
  the job keeps proportionally more GPUs busy, ``configured x work / work at
  the first report``; when the mix turns back to images it shrinks again.
  Jobs whose records carry no ``vision_tokens`` (GPT, DiT) keep ``configured``;
- the **data-wait share** (the slowest rank's data wait / step time): above
  :data:`DATA_WAIT_HIGH` the groups outrun the input pipeline, and demand is
  what they keep busy, ``groups x replica_gpus x (1 - share)``;
- the **allocator memory high-water** (largest rank's peak tensor memory) is
  reported with the rest (``state.json`` ``load``) but moves no decision:
  a data-parallel size change keeps each group's micro-batch, so its memory
  is the same at any size; it is the number to check before placing the job
  on a pool of smaller devices.

Called from the live loop's single thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from megascale_omni.scheduler.live import Observation
from megascale_omni.scheduler.model import ThroughputCurve

#: Above this share of the step waiting for data, demand is what the groups keep busy.
DATA_WAIT_HIGH = 0.2
#: A change of the image share (images per sample) beyond this re-measures the throughput curve.
MIX_SHIFT = 0.1
#: Weight of a new samples/s (or per-step work) reading against the remembered one.
SMOOTHING = 0.5
#: Cost of one vision-tower token against one LM token in a step's work when
#: neither the live config (``jobs[i].vision_token_cost``) nor the job's step
#: records (``vision_token_cost``, its model's FLOPs ratio) say. The data
#: balancer's default (``megascale_omni.data.balance.DEFAULT_VIT_COST_PER_PATCH``,
#: equal by a test): the scheduler is a client of the control socket and
#: imports nothing of the data side.
VISION_TOKEN_COST = 0.05


@dataclass(frozen=True)
class JobLoad:
    """One job's load now, from its groups' last step records (None: not reported)."""

    samples_per_s: float = 0.0
    participants: Optional[int] = None
    data_wait: Optional[float] = None
    bubble: Optional[float] = None
    bubble_analytic: Optional[float] = None
    microbatches: Optional[int] = None
    mem_high_water_gib: Optional[float] = None
    image_share: Optional[float] = None
    #: Samples with a video per sample of the global batch.
    video_share: Optional[float] = None
    #: ``tokens + c x vision_tokens`` of the global batch (``c``: :func:`tower_cost`; None: no vision load reported).
    work: Optional[float] = None


def _share(num, den) -> Optional[float]:
    return float(num) / float(den) if num is not None and den else None


def tower_cost(configured: Optional[float], metrics: dict) -> float:
    """Weight of a vision-tower token in a step's work: ``configured`` (the
    live config's ``vision_token_cost``) when set, else the job's reported
    ``vision_token_cost`` (a finite number >= 0), else :data:`VISION_TOKEN_COST`."""
    if configured is not None:
        return configured
    reported = metrics.get("vision_token_cost")
    if isinstance(reported, (int, float)) and not isinstance(reported, bool) and 0 <= reported < float("inf"):
        return float(reported)
    return VISION_TOKEN_COST


def job_load(seen: Sequence[Observation], vision_token_cost: Optional[float] = None) -> JobLoad:
    """Reduce the job's observations: rate, quorum and bubble from the group at the latest step; data wait and
    memory as the worst over groups. ``vision_token_cost``: the live config's weight of a tower token
    (None: :func:`tower_cost` takes the job's own)."""
    latest = max(seen, key=lambda o: o.step or 0, default=None)
    if latest is None:
        return JobLoad()
    m = latest.metrics
    waits = [w for w in (_share(o.metrics.get("data_s_max", o.metrics.get("data_s")), o.metrics.get("step_s"))
                         for o in seen) if w is not None]
    mems = [v for v in (o.metrics.get("mem_peak_gib_max", o.metrics.get("mem_peak_gib")) for o in seen)
            if isinstance(v, (int, float))]
    participants = m.get("participants")
    microbatches = m.get("microbatches")
    tokens, vision = m.get("tokens"), m.get("vision_tokens")
    work = tokens + tower_cost(vision_token_cost, m) * vision if isinstance(tokens, (int, float)) and isinstance(
        vision, (int, float)) and tokens > 0 else None
    return JobLoad(
        samples_per_s=float(m.get("samples_per_s") or 0.0),
        participants=participants if isinstance(participants, int) and participants > 0 else None,
        data_wait=max(waits, default=None),
        bubble=_share(m.get("pipeline_wait_s_max", m.get("pipeline_wait_s")), m.get("step_s")),
        bubble_analytic=m.get("bubble_analytic"),
        microbatches=microbatches if isinstance(microbatches, int) and microbatches > 0 else None,
        mem_high_water_gib=max(mems, default=None),
        image_share=_share(m.get("images"), m.get("samples")),
        video_share=_share(m.get("samples_video"), m.get("samples")),
        work=work,
    )


@dataclass
class DemandModel:
    """What one job's measurements say across ticks. ``rates``: quorum size -> samples/s;
    ``mix``: the image share they were measured at; ``stages_minus_1`` and ``ref``: ``pp-1`` and the
    (size, micro-batches per group) it was derived at, for the bubble correction; ``work`` (smoothed)
    and ``work_ref`` (the first reported): per-step work, for the demand's scale."""

    rates: dict[int, float] = field(default_factory=dict)
    mix: Optional[float] = None
    stages_minus_1: float = 0.0
    ref: Optional[tuple[int, int]] = None
    work: Optional[float] = None
    work_ref: Optional[float] = None
    #: The :meth:`work_scale` last reported in ``events``.
    scale_told: float = 1.0
    events: list[str] = field(default_factory=list)

    def update(self, load: JobLoad) -> None:
        """Fold in one tick's load (a zero rate or unknown quorum changes nothing)."""
        if load.work is not None:
            self.work = load.work if self.work is None else (1 - SMOOTHING) * self.work + SMOOTHING * load.work
            if self.work_ref is None:
                self.work_ref = load.work
            scale = self.work_scale()
            if abs(scale - self.scale_told) > MIX_SHIFT:
                share = "" if load.video_share is None else f" ({load.video_share:.2f} of the samples video)"
                self.events.append(f"per-step work moved to {scale:.2f}x its first report{share}: demand scaled")
                self.scale_told = scale
        if load.image_share is not None:
            if self.mix is not None and abs(load.image_share - self.mix) > MIX_SHIFT and self.rates:
                self.events.append(f"modality mix moved from {self.mix:.2f} to {load.image_share:.2f} images per "
                                   f"sample: throughput re-measured")
                self.rates.clear()
            if not self.rates:
                self.mix = load.image_share
        n = load.participants
        if load.samples_per_s <= 0 or n is None:
            return
        old = self.rates.get(n)
        self.rates[n] = load.samples_per_s if old is None else (1 - SMOOTHING) * old + SMOOTHING * load.samples_per_s
        b, m = load.bubble_analytic, load.microbatches
        if isinstance(b, (int, float)) and 0 <= b < 1 and m:
            self.stages_minus_1, self.ref = b * m / (1 - b), (n, m)

    def efficiency(self, n: int) -> float:
        """1 - the 1F1B bubble at ``n`` groups (1 without a pipeline or before any report)."""
        if self.ref is None or self.stages_minus_1 <= 0:
            return 1.0
        m = self.ref[1] * self.ref[0] / n
        return 1.0 - self.stages_minus_1 / (m + self.stages_minus_1)

    def curve(self, max_replicas: int) -> ThroughputCurve:
        """Samples/s against groups: measured sizes as measured; the others from the best measured rate per
        group's bubble-free rate, times the bubble efficiency at that size (1 sample/s per group before any)."""
        per_group = max((r / n / self.efficiency(n) for n, r in self.rates.items()), default=None)
        points = []
        for n in range(1, max_replicas + 1):
            if n in self.rates:
                points.append((float(n), self.rates[n]))
            else:
                points.append((float(n), (per_group or 1.0) * n * (self.efficiency(n) if per_group else 1.0)))
        return ThroughputCurve(tuple(points))

    def work_scale(self) -> float:
        """Per-step work now against the first report (1 before any, or without a vision load)."""
        return self.work / self.work_ref if self.work is not None and self.work_ref else 1.0

    def demand(self, configured: float, active: int, replica_gpus: int, load: JobLoad) -> float:
        """GPUs the job can keep busy: ``configured`` times :meth:`work_scale`, or what its ``active`` groups
        keep busy when they wait for data more than :data:`DATA_WAIT_HIGH`."""
        scaled = configured * self.work_scale()
        if load.data_wait is not None and load.data_wait > DATA_WAIT_HIGH:
            return min(scaled, active * replica_gpus * (1.0 - load.data_wait))
        return scaled
