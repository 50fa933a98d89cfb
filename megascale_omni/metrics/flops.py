"""Model FLOPs of a step and model FLOPs utilisation (MFU): one count, one peak table.

The count (the step record's ``model_tflop``, the report, ``benchmarks/gpu_mfu.py``)
is the family's pipeline cost model evaluated on the global batch the step
really trained (:class:`~megascale_omni.parallel.batch_shape.BatchShape`,
built by the task from its data plan): the same component formulas that
place layers on pipeline stages. What it counts:

- 2 FLOPs per multiply-add of every weight matrix: attention QKV and output
  projections, the MLP (SwiGLU: three matrices), the output layer; LLaVA's
  ViT patch embedding and layers and its projector; DiT's patch and caption
  projections, timestep and caption MLPs, adaLN modulation, cross-attention
  and output linear.
- Attention: ``4 * h`` FLOPs per query-key pair forward (scores and
  attention-times-values). The language model is causal *per packed
  sample*: ``s * (s + 1) / 2`` pairs for a sample of ``s`` tokens, nothing
  across samples of a row or for padding. The ViT is bidirectional: ``P * P``
  pairs per image of ``P`` tokens. The DiT: ``n * n`` pairs per image of ``n``
  tokens, plus ``n * L`` to its ``L`` caption tokens.
- Small terms: embedding gather and add (3 per token and hidden unit),
  softmax cross-entropy (5 per logit), DiT's squared error.
- Forward + backward: one forward, plus one forward-equivalent for input
  gradients where a gradient flows and one for weight gradients where the
  weights train, so 3x forward when everything trains. A frozen ViT counts
  its forward only; a frozen LM forward plus input gradients when the
  projector before it trains.
- Not counted: recomputation (work, not model FLOPs), padding tokens and
  padding package slots, norms, biases and activation functions, and the ViT
  that every CP rank repeats. The count is layout-free: the same for any tp,
  pp, cp and dp.

MFU = model FLOPs / step time / devices / the dense bf16 peak of one device:
``logging.peak_tflops``, or on CUDA when that is 0 the table entry for the
exact device name (:data:`DEVICE_PEAK_TFLOPS`); a name that only matches a
family (:data:`FAMILY_PEAK_TFLOPS`) gets that family's number and the log
says it was guessed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Optional

from megascale_omni.config import JobConfig
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.parallel.pipeline_cost import CostModelFn

logger = logging.getLogger(__name__)

#: Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, by the exact name
#: ``torch.cuda.get_device_name`` reports (NVIDIA datasheets).
DEVICE_PEAK_TFLOPS: dict[str, float] = {
    "NVIDIA H100 80GB HBM3": 989.0,  # H100 SXM5
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H800": 989.0,
    "NVIDIA H200": 989.0,  # H200 SXM
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA GH200 480GB": 989.0,
    "NVIDIA B200": 2250.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A800-SXM4-80GB": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA A10G": 70.0,
}
#: A guess for names the table lacks, by model family (a whole word of the
#: name): the family's most common part.
FAMILY_PEAK_TFLOPS: dict[str, float] = {
    "H100": 989.0, "H800": 989.0, "H200": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "A800": 312.0,
    "L40S": 362.0,
}


@dataclass(frozen=True)
class DevicePeak:
    """One device's peak and where it came from: ``"logging.peak_tflops"``,
    ``"table"`` (exact name), ``"guessed"`` (family only) or ``"unknown"``
    (``tflops`` None: no MFU)."""

    tflops: Optional[float]
    source: str


def device_peak(configured: float, device_name: Optional[str]) -> DevicePeak:
    """Dense bf16 peak of one device: ``configured`` if > 0, else the table
    entry for ``device_name`` (CUDA; None elsewhere), else its family's with
    a warning that it was guessed."""
    if configured > 0:
        return DevicePeak(configured, "logging.peak_tflops")
    if not device_name:
        return DevicePeak(None, "unknown")
    if device_name in DEVICE_PEAK_TFLOPS:
        return DevicePeak(DEVICE_PEAK_TFLOPS[device_name], "table")
    words = set(re.split(r"[^A-Za-z0-9]+", device_name))
    for family, tflops in FAMILY_PEAK_TFLOPS.items():
        if family in words:
            logger.warning("peak TFLOP/s of %r guessed from its family %s: %g (set logging.peak_tflops for an "
                           "exact MFU)", device_name, family, tflops)
            return DevicePeak(tflops, "guessed")
    return DevicePeak(None, "unknown")


class StepFlops:
    """Model FLOPs of training on a global batch, by the module's convention
    (callable; the unsplit model's config is prepared once, not per step).

    ``vocab_size``: the vocabulary the model was built with, when the task
    resolved it (``model.vocab_size: 0`` takes a tokenizer's); 0: the config's.
    """

    def __init__(self, cfg: JobConfig, cost_model_fn: CostModelFn, vocab_size: int = 0):
        model = dataclasses.replace(cfg.model, recompute="none", vocab_size=vocab_size or cfg.model.vocab_size)
        # One unsplit model: the count does not depend on the layout (and CP's repeated ViT is not model work).
        unsplit = dataclasses.replace(cfg.parallel, tp=1, cp=1, sequence_parallel=False)
        self.cfg = dataclasses.replace(cfg, model=model, parallel=unsplit)
        self.cost_model_fn = cost_model_fn
        # Fixed-shape batches (GPT's full rows) repeat every step: count them once.
        self._last: tuple[Optional[BatchShape], float] = (None, 0.0)

    def __call__(self, batch: BatchShape) -> float:
        """FLOPs of ``batch`` (a whole global batch: every DP rank's and every replica group's share)."""
        if batch == self._last[0]:
            return self._last[1]
        m = self.cost_model_fn(self.cfg, False, None, batch)
        fixed = sum(m.components[n].flops for n in (*m.head, *m.tail))
        flops = fixed + self.cfg.model.num_layers * m.components[m.layer].flops
        self._last = (batch, flops)
        return flops


def step_model_flops(cfg: JobConfig, cost_model_fn: CostModelFn, batch: BatchShape, vocab_size: int = 0) -> float:
    """:class:`StepFlops` of ``batch``, once."""
    return StepFlops(cfg, cost_model_fn, vocab_size)(batch)


def vision_token_cost(cfg: JobConfig, cost_model_fn: CostModelFn, vocab_size: int = 0) -> float:
    """Model FLOPs of one vision-tower token over one language-model token of
    ``cfg``'s LLaVA model, both trained as a step trains them (the
    scheduler's weight of ``vision_tokens`` in a step's work; docs/scheduler.md).

    Tower: the ViT and projector on one tower input, per
    ``vision.tokens_per_image``. LM: embedding, every decoder layer and the
    output layer on one packed sample of ``model.seq_length`` tokens, per
    token (causal attention included). Layout-free, like :class:`StepFlops`.
    """
    count = StepFlops(cfg, cost_model_fn, vocab_size)
    tower = count(BatchShape(tower_inputs=1.0)) / cfg.vision.tokens_per_image
    lm = count(BatchShape(segments=(cfg.model.seq_length,))) / cfg.model.seq_length
    return tower / lm


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
