"""Run a training entry point and record the dtype of every floating-point
tensor that enters a matmul, a convolution or attention during each
training step, on top of :mod:`tests.gpu.device_probe` (parameters' device
and dtype, micro-batches' device).

    python -m tests.dtype_probe --device cpu --dtype bfloat16 --report DIR TARGET [args ...]

A ``TorchDispatchMode`` sees the aten ops that actually run, forward and
backward (``nn.Linear``, megatron's linears, ``torch.matmul``, SDPA and
convolutions all reach one of :data:`OPS`), so a tensor made in fp32
anywhere (an input, a position table, a mask, a weight built outside
``params_dtype``) shows up whatever module made it. Each rank writes
``DIR/dtypes<R>.json``: ``counts`` (``{op: {dtype: count}}`` over all
steps), ``offending`` (the first few ``op dtype shape`` not in ``--dtype``)
and ``initial_weights`` (a digest of each parameter before the first step,
rounded to bf16: equal for an fp32 and a bf16 run that start from the same
weights). Test-only: production code carries no
probes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.gpu import device_probe

#: aten overload packets whose floating inputs must be in the model's dtype.
OPS = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_attention_math", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
}

#: Arguments of :data:`OPS` that are fp32 whatever the model's dtype: the
#: attention backward's saved row log-sum-exp (``[batch, heads, seq]``).
FP32_BY_DESIGN = {"logsumexp"}


class MatmulDtypes(TorchDispatchMode):
    """Counts floating inputs of :data:`OPS` by op and dtype while active."""

    def __init__(self, want: str):
        super().__init__()
        self.want = want
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.offending: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in OPS:
            # Attention's softmax statistics are fp32 by design (not an activation).
            named = zip((a.name for a in func._schema.arguments), args)
            inputs = [v for n, v in named if n not in FP32_BY_DESIGN] + list(kwargs.values())
            for t in tree_leaves(inputs):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    dtype = str(t.dtype).removeprefix("torch.")
                    self.counts[name][dtype] += 1
                    if dtype != self.want and len(self.offending) < 20:
                        self.offending.append(f"{name} {dtype} {tuple(t.shape)}")
        return func(*args, **kwargs)


def _bf16_digest(param: torch.Tensor) -> str:
    """sha256 of ``param``'s values rounded to bf16 (bit patterns)."""
    bits = param.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
    return hashlib.sha256(bits.numpy().tobytes()).hexdigest()


def install(device: str, dtype: str, report: Path) -> None:
    from megascale_omni.training import trainer

    device_probe.install(device, dtype, report)
    probed = trainer.train_step
    rank = int(os.environ.get("RANK", "0"))
    mode = MatmulDtypes(dtype)
    initial: dict[str, str] = {}

    def recorded_train_step(chunks, *args, **kwargs):
        if not initial:
            # The weights the first step starts from, rounded to bf16: an fp32 and a bf16
            # run of one seed must give identical digests.
            initial.update({f"{i}.{n}": _bf16_digest(p) for i, c in enumerate(chunks)
                            for n, p in c.named_parameters()})
        with mode:
            stats = probed(chunks, *args, **kwargs)
        report.mkdir(parents=True, exist_ok=True)
        (report / f"dtypes{rank}.json").write_text(json.dumps(
            {"counts": {op: dict(c) for op, c in mode.counts.items()}, "offending": mode.offending,
             "initial_weights": initial}))
        return stats

    trainer.train_step = recorded_train_step


if __name__ == "__main__":
    device_probe.main(install, __doc__.splitlines()[0])
