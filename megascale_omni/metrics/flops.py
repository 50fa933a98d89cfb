"""Model FLOPs per step and model FLOPs utilisation (MFU).

Model FLOPs come from the family's pipeline cost model (the same counts
that place layers on pipeline stages): forward + backward of every
component of one micro-batch, times the micro-batches of the whole job.
Recomputation is not counted (it is work, not model FLOPs), frozen weights
get no weight-gradient pass, and attention is counted over the full
``seq_length`` square even when a packed mask skips most of it (Megatron's
convention, so numbers compare across frameworks).

MFU = model FLOPs / step time / devices / peak FLOP/s of one device, the
peak being ``logging.peak_tflops`` or, on CUDA when that is 0, the dense
bf16 peak of a known device.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from megascale_omni.config import JobConfig

#: Dense bf16 tensor-core peak, TFLOP/s, by substring of the CUDA device name.
DEVICE_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
)


def model_flops_per_step(cfg: JobConfig, cost_model_fn: Callable, world_size: int) -> float:
    """Model FLOPs of one optimizer step of the whole job (all replicas of
    the inner DP; every TP/PP rank's share summed).

    Counted on the model without context parallelism: CP splits the same
    work over more ranks (and repeats LLaVA's ViT on each CP rank, which is
    not model work), so the job's model FLOPs do not depend on ``cp``."""
    cp = cfg.parallel.cp
    no_recompute = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, recompute=False), parallel=dataclasses.replace(cfg.parallel, cp=1)
    )
    m = cost_model_fn(no_recompute, cuda=False, world_size=world_size // cp)
    per_microbatch = sum(m.components[n].flops for n in (*m.head, *m.tail))
    per_microbatch += cfg.model.num_layers * m.components[m.layer].flops
    dp = max(world_size // cfg.parallel.model_parallel_size, 1)  # replicas of the model (CP ranks share one)
    # Component costs are per TP rank.
    return per_microbatch * cfg.parallel.tp * m.num_microbatches * dp


def device_peak_tflops(configured: float, device_name: Optional[str]) -> Optional[float]:
    """Peak TFLOP/s of one device: ``configured`` if > 0, else the table
    entry for ``device_name`` (CUDA), else None (no MFU)."""
    if configured > 0:
        return configured
    if device_name:
        for key, peak in DEVICE_PEAK_TFLOPS:
            if key in device_name:
                return peak
    return None


def throughput_fields(flops_per_step: Optional[float], step_s: float, devices: int,
                      peak_tflops: Optional[float]) -> dict[str, float]:
    """``model_tflop``, ``tflops_per_device`` and (with a peak) ``mfu`` of one step."""
    if flops_per_step is None or step_s <= 0:
        return {}
    per_device = flops_per_step / 1e12 / step_s / max(devices, 1)
    out = {"model_tflop": flops_per_step / 1e12, "tflops_per_device": per_device}
    if peak_tflops:
        out["mfu"] = per_device / peak_tflops
    return out
