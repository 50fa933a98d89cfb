"""Builds the step record (fields: :mod:`megascale_omni.metrics.schema`) and its log line.

The Trainer hands over what it measured (its clock around the step and the
step boundary, the step's own stats, the task's batch counts); the recorder
adds the time breakdown, throughput, model FLOPs/MFU and memory. Every rank
builds its record (the loss rank's is logged and exported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megascale_omni.metrics.breakdown import analytic_bubble, memory_stats
from megascale_omni.metrics.flops import throughput_fields
from megascale_omni.parallel.batch_shape import BatchShape

#: Breakdown fields, in the order they happen within a step.
BREAKDOWN = ("data_s", "compute_s", "pipeline_wait_s", "moe_dispatch_s", "grad_sync_s", "cross_replica_s",
             "optimizer_s", "metrics_s", "checkpoint_s", "control_s")


@dataclass
class StepTiming:
    """The Trainer's measurements of one step, seconds.

    ``step_s`` runs from the end of the previous step's training work to the
    end of this one's, so it includes what happened in between: building and
    exporting the previous record (``metrics_s``) and the step boundary's
    ``checkpoint_s`` and ``control_s`` (evaluation is reported separately
    and excluded).
    """

    step_s: float
    data_s: float
    #: Quorum and commit bookkeeping of an elastic step (counted as cross-replica).
    membership_s: float
    metrics_s: float
    checkpoint_s: float
    control_s: float


class StepRecorder:
    """Turns one step's measurements into its record (every rank).

    ``flops_of``: model FLOPs of training on a global batch
    (:class:`~megascale_omni.metrics.flops.StepFlops` of the family's
    cost model; None: no cost model); ``devices``: ranks of this replica
    group; ``peak_tflops``: one device's peak (None: no MFU); ``pp``/``vpp``:
    for the analytic bubble; ``vision_token_cost``: the model's tower FLOPs
    per LM FLOP and token (:func:`~megascale_omni.metrics.flops.vision_token_cost`,
    LLaVA; None: not recorded).
    """

    def __init__(self, device: torch.device, devices: int, flops_of: Optional[Callable[[BatchShape], float]],
                 peak_tflops: Optional[float], pp: int, vpp: int, vision_token_cost: Optional[float] = None):
        self.device = device
        self.devices = devices
        self.flops_of = flops_of
        self.peak_tflops = peak_tflops
        self.pp = pp
        self.vpp = vpp
        self.vision_token_cost = vision_token_cost

    def build(self, step: int, stats: Any, timing: StepTiming, samples: int, tokens: int,
              images: Optional[int], extra: dict, batch: Optional[BatchShape] = None) -> dict:
        """The record of committed step ``step`` (``stats``: the step's
        :class:`~megascale_omni.training.step.StepStats`; ``extra``: task
        data stats, membership fields; ``batch``: what its global batch held,
        for the model FLOPs, None: not counted)."""
        step_s = timing.step_s
        waits = stats.pipeline_wait_s + stats.moe_dispatch_s + stats.grad_sync_s + stats.cross_replica_s
        parts = {
            "data_s": timing.data_s,
            "compute_s": max(stats.fwd_bwd_s - waits, 0.0),
            "pipeline_wait_s": stats.pipeline_wait_s,
            "moe_dispatch_s": stats.moe_dispatch_s,
            "grad_sync_s": stats.grad_sync_s,
            "cross_replica_s": stats.cross_replica_s + timing.membership_s,
            "optimizer_s": stats.optimizer_s,
            "metrics_s": timing.metrics_s,
            "checkpoint_s": timing.checkpoint_s,
            "control_s": timing.control_s,
        }
        record = {
            "step": step,
            "loss": stats.loss,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "skipped": not stats.update_successful,
            "loss_tokens": stats.num_loss_tokens,
            "tokens": tokens,
            "samples": samples,
            "microbatches": stats.num_microbatches,
            "step_s": step_s,
            **parts,
            "other_s": step_s - sum(parts.values()),
            "fwd_bwd_s": stats.fwd_bwd_s,
            "bubble_analytic": analytic_bubble(self.pp, self.vpp, stats.num_microbatches),
            "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "samples_per_s": samples / step_s if step_s > 0 else 0.0,
        }
        if images is not None:
            record["images"] = images
            record["images_per_s"] = images / step_s if step_s > 0 else 0.0
        participants = int(extra.get("participants", 1) or 1)
        flops = self.flops_of(batch) if self.flops_of is not None and batch is not None else None
        record.update(throughput_fields(flops, step_s, self.devices * participants, self.peak_tflops))
        if self.vision_token_cost is not None:
            record["vision_token_cost"] = self.vision_token_cost
        record.update(memory_stats(self.device))
        record.update(extra)
        return record


def format_line(r: dict, total: int) -> str:
    """The one log line of a step (loss rank)."""
    loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
    gn = f"{r['grad_norm']:.3f}" if r["grad_norm"] is not None else "-"
    flags = " SKIPPED" if r["skipped"] else ""
    if "participants" in r:
        flags += f" | replicas {r['participants']}" + (" (healed)" if r["healed"] else "")
    mfu = f" | mfu {r['mfu']:.1%}" if "mfu" in r else ""
    if r.get("stragglers"):
        flags += f" | STRAGGLERS {r['stragglers']}"
    mem = (f" | mem {r['mem_allocated_gib']:.1f}/{r['mem_reserved_gib']:.1f} GiB" if "mem_reserved_gib" in r
           else f" | rss {r['rss_gib']:.2f} GiB" if "rss_gib" in r else "")
    waits = r["pipeline_wait_s"] + r.get("moe_dispatch_s", 0.0) + r["grad_sync_s"] + r["cross_replica_s"]
    return (
        f"step {r['step']}/{total} | loss {loss} | lr {r['lr']:.2e} | grad_norm {gn} | "
        f"tok/s {r['tokens_per_s']:.0f} | samples/s {r['samples_per_s']:.1f}{mfu} | "
        f"step {r['step_s']:.3f}s (data {r['data_s']:.3f} compute {r['compute_s']:.3f} wait {waits:.3f} "
        f"opt {r['optimizer_s']:.3f}){mem}{flags}"
    )
