"""Memory per GPU of a job config: weights, gradients, optimizer state and
activations of every pipeline stage, before anything is built.

:func:`estimate_memory_per_gpu` is what a recipe or a launcher asks ("does
this fit an 80 GiB GPU?"); the pipeline planner's memory check
(``parallel.pipeline_memory_gib``) is the same sum. The caller supplies the
family's cost model (``megascale_omni.tasks.registry.estimate_memory_per_gpu``
looks it up from ``model.family``). Conventions, bytes per parameter
(:func:`~megascale_omni.parallel.pipeline_cost.memory_conventions`):

============  =======  ===============  =========================================
precision     weights  gradients        optimizer state (Adam)
============  =======  ===============  =========================================
bf16          2        4 (fp32 buffer)  12 (fp32 master, m, v) / (dp * cp) with
                                        ``parallel.use_distributed_optimizer``
fp32          4        4                8 (m, v) / (dp * cp) likewise
============  =======  ===============  =========================================

Frozen parameters keep weights only. Activations: each layer's per micro-batch
(:mod:`megascale_omni.parallel.activations`, with ``model.recompute`` and
``parallel.sequence_parallel``) times the micro-batches a stage holds at its
peak under 1F1B or interleaving
(:func:`~megascale_omni.parallel.pipeline_plan.microbatches_in_flight`).
Not counted: the framework's workspace, communication buffers, allocator
fragmentation and the transient of a layer being recomputed; leave headroom
for them. Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megascale_omni.config.schema import JobConfig
from megascale_omni.parallel.pipeline_cost import CostModelFn, memory_conventions
from megascale_omni.parallel.pipeline_plan import build_cost_model, microbatches_in_flight, plan_for

GIB = float(1 << 30)


@dataclass(frozen=True)
class StageMemory:
    """Predicted bytes on one GPU of pipeline rank ``pp_rank`` (every TP, CP
    and DP rank of that stage holds the same)."""

    pp_rank: int
    #: Decoder layers (DiT blocks) on this pp rank, over its virtual stages.
    layers: int
    weights: float
    gradients: float
    optimizer: float
    #: Activations of the micro-batches in flight at the stage's peak.
    activations: float

    @property
    def total(self) -> float:
        """Bytes: weights + gradients + optimizer state + activations."""
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def total_gib(self) -> float:
        return self.total / GIB


def estimate_memory_per_gpu(
    cfg: JobConfig, cost_model: CostModelFn, cuda: bool = True, world_size: Optional[int] = None,
) -> tuple[StageMemory, ...]:
    """Bytes per GPU of every pipeline rank of ``cfg`` (module docstring), in
    pp-rank order; ``max(s.total for s in ...)`` is what the job needs per GPU.

    ``cost_model``: the family's :data:`~megascale_omni.parallel.pipeline_cost.CostModelFn`.
    ``cuda``: what ``train.precision: auto`` means (True: bf16).
    ``world_size``: GPUs of one replica group (None: ``tp * pp * cp``, DP 1);
    DP shards the distributed optimizer's state and sets the micro-batches
    per step. The layers are split as ``parallel.pipeline_partition`` says
    (``auto``: the planner's split, ignoring ``pipeline_memory_gib``).
    Pure; any caller, before any process group. Raises ConfigError only for
    a config the planner cannot split at all.
    """
    par = cfg.parallel
    partition = par.pipeline_partition
    mode = partition if isinstance(partition, str) else "explicit"
    if mode == "auto":  # the fastest split, whatever the capacity: this estimate is what a check compares to it
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(par, pipeline_memory_gib=None))
    plan = plan_for(cfg, mode, cost_model, cuda=cuda, world_size=world_size)
    model = build_cost_model(cfg, cost_model, cuda=cuda, world_size=world_size)
    conv = memory_conventions(cfg, cuda, world_size)
    # Whatever the family keeps per parameter beyond the weights (DiT: its EMA copy) counts as weights.
    weight_bytes = model.bytes_per_frozen_param
    stages = []
    for r in range(plan.pp):
        n = sum(plan.rank_layers(r))
        names = [*(model.head if r == 0 else ()), *(model.tail if r == plan.pp - 1 else ())]
        counted = [(name, 1) for name in names] + [(model.layer, n)]
        params = sum(k * model.components[name].params for name, k in counted)
        trainable = sum(k * model.components[name].trainable_params for name, k in counted)
        inflight = microbatches_in_flight(r, plan.pp, plan.vpp, model.num_microbatches)
        stages.append(StageMemory(
            pp_rank=r, layers=n,
            weights=params * weight_bytes,
            gradients=trainable * conv.grad_bytes_per_param,
            optimizer=trainable * conv.optimizer_bytes_per_param,
            activations=inflight * sum(k * model.activation_bytes(name) for name, k in counted),
        ))
    return tuple(stages)


def format_memory_table(stages: tuple[StageMemory, ...]) -> str:
    """One line per pp rank: layers and GiB of each part and the total."""
    rows = [("pp rank", "layers", "weights", "grads", "optimizer", "activations", "total GiB")]
    for s in stages:
        rows.append((str(s.pp_rank), str(s.layers), *(f"{x / GIB:.2f}" for x in
                                                      (s.weights, s.gradients, s.optimizer, s.activations, s.total))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)
