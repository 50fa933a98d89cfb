"""From a job config to a pipeline partition megatron-core can build.

``parallel.pipeline_partition`` is ``uniform``, ``auto`` or explicit counts.
:func:`plan_pipeline` turns any of them into per-chunk layer counts with the
predicted time and memory of every pp rank, and raises ConfigError for a plan
that cannot run (memory, too few layers) before any process group starts.
The cost model is the caller's: a model family declares its own
(``megascale_omni.tasks.registry``); nothing here depends on the family.
:func:`resolve_partition` writes the counts back into the config, and
:func:`megatron_layout` renders them as megatron's
``pipeline_model_parallel_layout`` string, which is what builds the stages.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from megascale_omni.config.errors import ConfigError
from megascale_omni.config.schema import JobConfig
from megascale_omni.parallel.pipeline_cost import CostModelFn, PipelineCostModel, load_profile, timed_at_peak
from megascale_omni.parallel.pipeline_solver import StageProblem, min_memory, solve

GIB = float(1 << 30)


@dataclass(frozen=True)
class PipelinePlan:
    """Layer counts per model chunk (megatron layout order: chunk ``v * pp + r``
    is virtual stage ``v`` of pp rank ``r``) and what the cost model predicts
    for them. ``rank_time``/``chunk_time`` are per micro-batch, in ``unit``;
    ``rank_memory`` is bytes per pp rank."""

    mode: str
    pp: int
    vpp: int
    counts: tuple[int, ...]
    rank_time: tuple[float, ...]
    chunk_time: tuple[float, ...]
    rank_memory: tuple[float, ...]
    unit: str
    source: str

    def rank_layers(self, rank: int) -> tuple[int, ...]:
        """Layers of ``rank`` per virtual stage."""
        return tuple(self.counts[v * self.pp + rank] for v in range(self.vpp))

    @property
    def imbalance(self) -> float:
        """Slowest pp rank over the mean: 1.0 is perfectly balanced."""
        mean = sum(self.rank_time) / len(self.rank_time)
        return max(self.rank_time) / mean if mean > 0 else 1.0

    @property
    def peak_memory(self) -> float:
        return max(self.rank_memory)


def build_cost_model(
    cfg: JobConfig, cost_model: CostModelFn, cuda: bool = False, world_size: Optional[int] = None
) -> PipelineCostModel:
    """``cost_model`` of ``cfg``, with measured times if ``parallel.pipeline_profile`` is set.

    A model with MoE token dispatch (``ComponentCost.dispatch_seconds``)
    plans in seconds so that the dispatch counts: measured times, or the FLOP
    model at ``logging.peak_tflops``. With neither, its times stay FLOPs and
    the dispatch is left out (tools/plan_pipeline.py says so)."""
    model = cost_model(cfg, cuda, world_size)
    if cfg.parallel.pipeline_profile:
        model = load_profile(cfg.parallel.pipeline_profile, model, cfg)
    dispatch = any(c.dispatch_seconds for c in model.components.values())
    if dispatch and cfg.logging.peak_tflops > 0:
        model = timed_at_peak(model, cfg.logging.peak_tflops)
    return model


def microbatches_in_flight(rank: int, pp: int, vpp: int, num_microbatches: int) -> float:
    """Micro-batches whose activations ``rank`` holds at its peak, in units of
    "one micro-batch through all of this rank's layers".

    1F1B: rank r runs ``pp - r`` forwards before its first backward.
    Interleaved (megatron): ``2 (pp - r - 1) + (vpp - 1) pp + 1`` chunk
    forwards, each holding one of ``vpp`` chunks (assumed equal).
    """
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - rank, num_microbatches))
    chunk_passes = min(2 * (pp - rank - 1) + (vpp - 1) * pp + 1, num_microbatches * vpp)
    return chunk_passes / vpp


def stage_problem(
    model: PipelineCostModel, num_layers: int, pp: int, vpp: int, capacity_gib: Optional[float]
) -> StageProblem:
    """The solver's view of ``model`` split over ``pp`` ranks x ``vpp`` chunks."""
    mem_fixed, mem_per_layer = [], []
    for r in range(pp):
        inflight = microbatches_in_flight(r, pp, vpp, model.num_microbatches)
        fixed = [*(model.head if r == 0 else ()), *(model.tail if r == pp - 1 else ())]
        mem_fixed.append(sum(model.static_bytes(n) + inflight * model.activation_bytes(n) for n in fixed))
        mem_per_layer.append(model.static_bytes(model.layer) + inflight * model.activation_bytes(model.layer))
    return StageProblem(
        num_layers=num_layers, pp=pp, vpp=vpp,
        layer_time=model.layer_time, head_time=model.head_time, tail_time=model.tail_time,
        mem_fixed=mem_fixed, mem_per_layer=mem_per_layer,
        capacity=None if capacity_gib is None else capacity_gib * GIB,
    )


def evaluate(problem: StageProblem, counts: list[int], mode: str, model: PipelineCostModel) -> PipelinePlan:
    """Predicted per-rank time/memory and per-chunk time of ``counts``."""
    p = problem
    rank_layers = [sum(counts[k] for k in p.rank_chunks(r)) for r in range(p.pp)]
    return PipelinePlan(
        mode=mode, pp=p.pp, vpp=p.vpp, counts=tuple(counts),
        rank_time=tuple(p.rank_time(r, n) for r, n in enumerate(rank_layers)),
        chunk_time=tuple(p.chunk_fixed(k) + p.layer_time * n for k, n in enumerate(counts)),
        rank_memory=tuple(p.rank_memory(r, n) for r, n in enumerate(rank_layers)),
        unit=model.unit, source=model.source,
    )


def uniform_counts(num_layers: int, chunks: int) -> list[int]:
    """megatron's even split (``num_layers`` divisible by ``chunks``)."""
    return [num_layers // chunks] * chunks


def plan_for(
    cfg: JobConfig, mode: str, cost_model: CostModelFn, cuda: bool = False, world_size: Optional[int] = None
) -> PipelinePlan:
    """The plan of partition ``mode`` (``uniform``, ``auto`` or ``explicit``
    for the configured list) under ``cfg`` and ``cost_model``, without the
    memory check. Raises ConfigError when ``auto`` finds no split within the capacity."""
    par = cfg.parallel
    vpp = par.vpp or 1
    model = build_cost_model(cfg, cost_model, cuda=cuda, world_size=world_size)
    problem = stage_problem(model, cfg.model.num_layers, par.pp, vpp, par.pipeline_memory_gib)
    if mode == "uniform":
        counts = uniform_counts(cfg.model.num_layers, par.pp * vpp)
    elif mode == "explicit":
        counts = list(par.pipeline_partition)
    else:
        counts = solve(problem)
        if counts is None:
            raise _memory_error(cfg, cost_model, problem, cuda, world_size)
    return evaluate(problem, counts, mode, model)


def plan_pipeline(
    cfg: JobConfig, cost_model: CostModelFn, cuda: bool = False, world_size: Optional[int] = None
) -> PipelinePlan:
    """The plan ``cfg`` asks for under ``cost_model`` (every rank, before any process group).

    Raises ConfigError if it does not fit ``parallel.pipeline_memory_gib``,
    naming the memory it would need and the smallest pp that fits.
    """
    partition = cfg.parallel.pipeline_partition
    mode = partition if isinstance(partition, str) else "explicit"
    plan = plan_for(cfg, mode, cost_model, cuda=cuda, world_size=world_size)
    cap = cfg.parallel.pipeline_memory_gib
    if cap is not None and plan.peak_memory > cap * GIB:
        model = build_cost_model(cfg, cost_model, cuda=cuda, world_size=world_size)
        problem = stage_problem(model, cfg.model.num_layers, plan.pp, plan.vpp, cap)
        raise _memory_error(cfg, cost_model, problem, cuda, world_size, plan)
    return plan


def plan_if_needed(
    cfg: JobConfig, cost_model: Optional[CostModelFn], cuda: bool = False, world_size: Optional[int] = None
) -> Optional[PipelinePlan]:
    """:func:`plan_pipeline` under ``cost_model``; without one (a family that
    declares none) None, unless the config needs a cost model (``auto`` or a
    memory capacity: ConfigError). Uniform and explicit splits then build
    without a plan."""
    if cost_model is not None:
        return plan_pipeline(cfg, cost_model, cuda=cuda, world_size=world_size)
    par = cfg.parallel
    why = f"model.family={cfg.model.family} has no pipeline cost model"
    if par.pipeline_partition == "auto":
        raise ConfigError("parallel.pipeline_partition", "auto", f"{why}; use uniform or explicit counts")
    if par.pipeline_memory_gib:
        raise ConfigError("parallel.pipeline_memory_gib", par.pipeline_memory_gib, f"{why}; set it to null")
    return None


def _memory_error(
    cfg: JobConfig, cost_model: CostModelFn, problem: StageProblem, cuda: bool, world_size: Optional[int],
    plan: Optional[PipelinePlan] = None,
) -> ConfigError:
    """ConfigError for a partition that exceeds the capacity, with the memory
    the best split needs at this pp and the smallest pp whose best split fits."""
    cap = cfg.parallel.pipeline_memory_gib
    need = min_memory(problem)
    need_gib = need[0] / GIB if need else float("inf")
    if plan is not None:
        hint = f"the {plan.mode} split {list(plan.counts)} needs {plan.peak_memory / GIB:.3f} GiB on its fullest pp rank"
        if need_gib <= cap:
            return ConfigError(
                "parallel.pipeline_memory_gib", cap,
                f"{hint}; a split that fits exists at pp={problem.pp} ({need_gib:.3f} GiB): "
                f"set parallel.pipeline_partition: auto",
            )
    else:
        hint = f"no split of {cfg.model.num_layers} layers over pp={problem.pp} fits"
    # Round up so that the number quoted is itself enough.
    need_text = f"{math.ceil(need_gib * 1000) / 1000:.3f}"
    hint += f"; the best split at pp={problem.pp} needs {need_text} GiB per pp rank"
    fixes = []
    sharded = _distributed_optimizer_memory(cfg, cost_model, problem, cuda, world_size)
    if sharded is not None and sharded <= cap * GIB:
        fixes.append(f"set parallel.use_distributed_optimizer=true (Adam state sharded over the data-parallel "
                     f"ranks: {math.ceil(sharded / GIB * 1000) / 1000:.3f} GiB)")
    fits = smallest_fitting_pp(cfg, cost_model, cuda, world_size)
    if fits is None:
        hint += f" and no pp up to {cfg.model.num_layers // problem.vpp} fits"
        fixes.append("raise parallel.pipeline_memory_gib")
    else:
        fixes += [f"raise parallel.pipeline_memory_gib to {need_text}", f"use parallel.pp={fits} (smallest pp that fits)"]
    hint += "; " + " or ".join(fixes)
    return ConfigError("parallel.pipeline_memory_gib", cap, hint)


def _distributed_optimizer_memory(
    cfg: JobConfig, cost_model: CostModelFn, problem: StageProblem, cuda: bool, world_size: Optional[int]
) -> Optional[float]:
    """Bytes the best split at ``problem.pp`` needs on its fullest pp rank
    with ``parallel.use_distributed_optimizer`` on; None when it is already
    on or there is one data-parallel rank (nothing to shard over)."""
    par = cfg.parallel
    dp = (world_size or par.model_parallel_size) // par.model_parallel_size
    if par.use_distributed_optimizer or dp < 2:
        return None
    trial = dataclasses.replace(cfg, parallel=dataclasses.replace(par, use_distributed_optimizer=True))
    model = build_cost_model(trial, cost_model, cuda=cuda, world_size=world_size)
    need = min_memory(stage_problem(model, cfg.model.num_layers, problem.pp, problem.vpp, None))
    return None if need is None else need[0]


def smallest_fitting_pp(
    cfg: JobConfig, cost_model: CostModelFn, cuda: bool = False, world_size: Optional[int] = None
) -> Optional[int]:
    """Smallest pp (tp, cp and dp unchanged) whose most memory-frugal split
    fits ``parallel.pipeline_memory_gib``; None if none up to num_layers/vpp does."""
    par = cfg.parallel
    vpp = par.vpp or 1
    dp = max((world_size or par.model_parallel_size) // par.model_parallel_size, 1)
    for pp in range(1, cfg.model.num_layers // vpp + 1):
        if vpp > 1 and pp < 2:
            continue
        trial = dataclasses.replace(cfg, parallel=dataclasses.replace(par, pp=pp, pipeline_partition="auto"))
        model = build_cost_model(trial, cost_model, cuda=cuda, world_size=dp * trial.parallel.model_parallel_size)
        need = min_memory(stage_problem(model, cfg.model.num_layers, pp, vpp, None))
        if need is not None and need[0] <= par.pipeline_memory_gib * GIB:
            return pp
    return None


def resolve_partition(cfg: JobConfig, plan: Optional[PipelinePlan]) -> JobConfig:
    """``cfg`` with ``parallel.pipeline_partition`` set to the plan's explicit
    counts (``[num_layers]`` for an ``auto`` plan at pp=1), or unchanged for a
    uniform plan (megatron's own even split) or no plan. The model builders
    accept only ``uniform`` or counts."""
    if plan is None or plan.mode == "uniform":
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_partition=list(plan.counts)))


def megatron_layout(counts: list[int] | tuple[int, ...], pp: int) -> str:
    """megatron ``pipeline_model_parallel_layout`` string for per-chunk counts
    (chunk ``v * pp + r``), e.g. ``[1, 3, 3, 1]`` -> ``"Et|ttt|ttt|tL"``."""
    if len(counts) % pp:
        raise ValueError(f"{len(counts)} chunk counts do not divide into pp={pp} ranks")
    stages = ["t" * n for n in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


def format_plan_table(plans: list[PipelinePlan]) -> str:
    """Side-by-side per-rank table: layers, predicted time, memory, and the
    imbalance (max/mean) of each plan."""
    unit = plans[0].unit
    scale, unit_name = (1e3, "ms") if unit == "s" else (1e-9, "GFLOP")
    header = ["pp rank"]
    for p in plans:
        header += [f"{p.mode} layers", f"{p.mode} {unit_name}", f"{p.mode} GiB"]
    rows = [header]
    for r in range(plans[0].pp):
        row = [str(r)]
        for p in plans:
            layers = p.rank_layers(r)
            row += [
                "+".join(map(str, layers)) if p.vpp > 1 else str(layers[0]),
                f"{p.rank_time[r] * scale:.2f}",
                f"{p.rank_memory[r] / GIB:.3f}",
            ]
        rows.append(row)
    foot = ["max/mean"]
    for p in plans:
        foot += ["", f"{p.imbalance:.3f}", ""]
    rows.append(foot)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)
