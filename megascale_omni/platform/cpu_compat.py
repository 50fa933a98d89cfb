"""Targeted patches that let megatron-core 0.16.1 build and train on CPU with gloo.

megatron-core is written for CUDA. On a host without CUDA a handful of call
sites would raise before any math happens. Each patch below names the call
site, what megatron assumes there, and why the replacement is safe.

Contract:
  * :func:`install` is a no-op when ``torch.cuda.is_available()``: GPU runs
    execute megatron-core unmodified.
  * Every patched call site would otherwise *raise* on a CUDA-less host
    ("Torch not compiled with CUDA enabled" or a type-check ``TypeError``), so
    the patches only turn crashes into CPU execution; they never change the
    result of something that worked before. One exception, for time only:
    :func:`_patch_router_expert_bias` calls the body of a ``torch.compile``-d
    counter directly (the same integer sums; the CPU compile cost seconds).
  * :func:`install` is idempotent and is called once per process by
    :func:`megascale_omni.platform.device.init_platform` before any megatron
    object is created.

Deliberately *not* done: a global device-redirecting ``TorchFunctionMode``.
It would intercept every tensor op in the training loop (slow on CPU) and
would hide new CUDA assumptions instead of surfacing them. The scoped
:class:`_CudaAsCpu` mode is only entered around the few constructors below.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}

# The list of applied patches is kept on the patched ``torch.cuda.current_device``
# itself (see install), so this module holds no state of its own.
_MARKER = "__megascale_cpu_patches__"


# --------------------------------------------------------------------------- #
# Scoped helper: run megatron constructors that hard-code ``device='cuda'`` or
# compare ``tensor.type()`` against CUDA type names.
# --------------------------------------------------------------------------- #
class _CudaAsCpu(TorchFunctionMode):
    """Within this mode, ``device='cuda'`` means CPU and CPU float tensors
    report their CUDA type name from ``Tensor.type()``.

    Only entered around the specific megatron functions wrapped below.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Fast path first: this mode also sees every op of a forward pass
        # when it wraps a pipeline schedule.
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda_device(device):
                kwargs = dict(kwargs)
                kwargs["device"] = _CPU
        else:
            kwargs = {}
            if func is torch.Tensor.type and len(args) == 1:
                name = func(*args)
                return _CUDA_TYPE_NAMES.get(name, name)
            if func is torch.Tensor.cuda:
                return args[0]
        return func(*args, **kwargs)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Bare integers are CUDA ordinals in torch's factory functions.
    return isinstance(device, int)


def _run_as_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaAsCpu():
            return fn(*args, **kwargs)

    wrapper.__megascale_cpu_compat__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_attr(applied: list[str], owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)
    if getattr(fn, "__megascale_cpu_compat__", False):
        return
    setattr(owner, name, _run_as_cpu(fn))
    applied.append(label)


# --------------------------------------------------------------------------- #
# Individual patches.
# --------------------------------------------------------------------------- #
def _patch_current_device(applied: list[str]) -> None:
    """``torch.cuda.current_device()`` is used by megatron as the allocation
    device everywhere (``GlobalMemoryBuffer.get_tensor``, DDP grad buffers,
    attention masks, pipeline p2p buffers). Without CUDA it raises, so
    returning the CPU device is the only meaningful answer."""

    def current_device() -> torch.device:
        return _CPU

    torch.cuda.current_device = current_device  # type: ignore[assignment]
    applied.append("torch.cuda.current_device -> cpu")


def _patch_rng(applied: list[str]) -> None:
    """megatron's ``CudaRNGStatesTracker`` forks the CUDA generator so that
    TP-sharded dropout differs per TP rank while replicated regions agree.
    On CPU every random op (dropout, init) draws from the default CPU
    generator, so forking *that* generator gives the same semantics."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """RNG tracker whose named states are CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # megatron seeds CUDA lazily; without CUDA the call is queued forever, so
    # make it explicit that it is meaningless here.
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
    applied.append("tensor_parallel.random: CPU generator RNG tracker")


def _patch_optimizers(applied: list[str]) -> None:
    """megatron optimizers create scalars with ``device='cuda'`` and reject
    parameters whose ``.type()`` is not ``torch.cuda.*Tensor``. On CPU the
    same parameters have CPU type names; the arithmetic is identical."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    _wrap_attr(applied, optimizer.FP32Optimizer, "__init__", "FP32Optimizer.__init__ under cuda-as-cpu")
    _wrap_attr(
        applied,
        optimizer.Float16OptimizerWithFloat16Params,
        "__init__",
        "Float16OptimizerWithFloat16Params.__init__ under cuda-as-cpu",
    )
    _wrap_attr(
        applied,
        distrib_optimizer.DistributedOptimizer,
        "__init__",
        "DistributedOptimizer.__init__ under cuda-as-cpu",
    )
    # Checkpointing the distributed optimizer gathers each DP group's shards
    # through ``send_tensor.cuda()`` / ``device=current_device()`` buffers.
    for name in ("sharded_state_dict", "load_state_dict"):
        _wrap_attr(
            applied, distrib_optimizer.DistributedOptimizer, name, f"DistributedOptimizer.{name} under cuda-as-cpu"
        )


def _patch_schedules(applied: list[str]) -> None:
    """Each megatron pipeline schedule allocates its token counter with
    ``device="cuda"``. The schedules run under the scoped mode; the tensors
    they move between stages already live on CPU."""
    from megatron.core.pipeline_parallel import schedules

    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        _wrap_attr(applied, schedules, name, f"schedules.{name} under cuda-as-cpu")


def _patch_vision(applied: list[str]) -> None:
    """``CLIPViTModel.__init__`` moves its position-id buffer with ``.cuda()``.
    Under the scoped mode ``.cuda()`` leaves the CPU tensor where it is."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    _wrap_attr(applied, CLIPViTModel, "__init__", "CLIPViTModel.__init__ under cuda-as-cpu")


def _patch_tied_embeddings(applied: list[str]) -> None:
    """With tied input/output embeddings and PP > 1, the last stage's copy of
    the word embedding is moved with ``.cuda()`` before the embedding-group
    all-reduce that syncs it with stage 0; on CPU it already lives where it
    should."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _wrap_attr(
        applied,
        LanguageModule,
        "setup_embeddings_and_output_layer",
        "LanguageModule.setup_embeddings_and_output_layer under cuda-as-cpu",
    )


def _patch_default_causal_mask(applied: list[str]) -> None:
    """``get_default_causal_mask`` builds its cached mask with ``device="cuda"``;
    it is reached from attention whenever no explicit mask is given, also
    outside the pipeline schedules (evaluation, direct module calls)."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    _wrap_attr(
        applied, utils, "get_default_causal_mask", "transformer.utils.get_default_causal_mask under cuda-as-cpu"
    )
    fused_softmax.get_default_causal_mask = utils.get_default_causal_mask


def _patch_synchronize(applied: list[str]) -> None:
    """megatron calls ``torch.cuda.synchronize()`` after batched p2p to guard
    against a NCCL race. CPU ops are synchronous and gloo requests are waited
    on explicitly, so there is nothing to synchronise."""
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    applied.append("torch.cuda.synchronize -> no-op")


def _patch_grad_norm_and_clipping(applied: list[str]) -> None:
    """``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32`` allocate
    their overflow buffers with ``device='cuda'``; clipping also asserts that
    every grad is a ``torch.cuda.FloatTensor``. Under the scoped mode they
    run megatron's own local multi-tensor fallbacks on the CPU tensors."""
    from megatron.core.optimizer import clip_grads, optimizer

    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        _wrap_attr(applied, clip_grads, name, f"clip_grads.{name} under cuda-as-cpu")
        # optimizer.py bound the names at import time.
        setattr(optimizer, name, getattr(clip_grads, name))


class _HostStream:
    """Stands in for the CUDA stream megatron's all-to-all dispatcher keeps for
    its device-to-host copies; never used for work on CPU (see below)."""


def _patch_moe_alltoall_dispatcher(applied: list[str]) -> None:
    """``MoEAlltoAllTokenDispatcher`` creates a class-wide ``torch.cuda.Stream()``
    in its constructor and, in ``_maybe_dtoh_and_synchronize``, copies the
    split sizes to the host on that stream and waits on a CUDA event before
    the uneven all-to-all. On CPU the tensors already live on the host and
    every op is synchronous, so the copy is only the conversion the CUDA
    path makes (``maybe_move_tensor_to_cpu(..., as_numpy=True)`` for the
    three split vectors) and there is nothing to wait for. The dropped-and-
    padded path (capacity with padding) skips the method on CUDA too."""
    from megatron.core.transformer.moe import token_dispatcher

    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    if getattr(cls._maybe_dtoh_and_synchronize, "__megascale_cpu_compat__", False):
        return
    cls.cuda_dtoh_stream = _HostStream()

    def host_splits(self, point: str, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    host_splits.__megascale_cpu_compat__ = True  # type: ignore[attr-defined]
    cls._maybe_dtoh_and_synchronize = host_splits
    applied.append("MoEAlltoAllTokenDispatcher: host split sizes without a CUDA stream")


def _patch_router_gemm(applied: list[str]) -> None:
    """``moe_utils`` binds ``te_general_gemm`` only when transformer-engine
    imports, yet ``RouterGatingLinearFunction`` tests ``te_general_gemm is not
    None`` unconditionally: without TE every MoE router raises NameError.
    ``None`` is the value the check expects for "no TE" (torch's matmul)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        applied.append("moe_utils.te_general_gemm = None (router gating without transformer-engine)")


def _patch_router_expert_bias(applied: list[str]) -> None:
    """``TopKRouter._apply_expert_bias`` (the aux-loss-free bias's token
    counter, ``local_tokens_per_expert += routing_map.sum(dim=0)``) is
    decorated with megatron's ``jit_fuser``, i.e. ``torch.compile``. On CPU
    the first call runs inductor's C++ code generation: 3 s of CPU and 9 s of
    wall time per process on the 2-core CI host, for one sum of a boolean
    map, which made a 6-step test with the expert bias take twice as long as
    one without. The undecorated body (``__wrapped__``, kept by
    ``torch.compile``) computes the same integer counts."""
    from megatron.core.transformer.moe.router import TopKRouter

    compiled = TopKRouter._apply_expert_bias
    body = getattr(compiled, "__wrapped__", None)
    if body is not None and not getattr(compiled, "__megascale_cpu_compat__", False):
        body.__megascale_cpu_compat__ = True  # type: ignore[attr-defined]
        TopKRouter._apply_expert_bias = body
        applied.append("TopKRouter._apply_expert_bias: eager (no torch.compile on CPU)")


_PATCHES = (
    _patch_current_device,
    _patch_rng,
    _patch_optimizers,
    _patch_grad_norm_and_clipping,
    _patch_schedules,
    _patch_vision,
    _patch_default_causal_mask,
    _patch_tied_embeddings,
    _patch_synchronize,
    _patch_moe_alltoall_dispatcher,
    _patch_router_gemm,
    _patch_router_expert_bias,
)


def install() -> list[str]:
    """Install the CPU patches (every rank, before building any megatron object).

    Idempotent. Returns the names of the patches in effect; empty when CUDA
    is available.
    """
    if torch.cuda.is_available():
        return []
    done = getattr(torch.cuda.current_device, _MARKER, None)
    if done is not None:
        return list(done)
    applied: list[str] = []
    for patch in _PATCHES:
        patch(applied)
    setattr(torch.cuda.current_device, _MARKER, tuple(applied))
    logger.debug("megatron-core CPU compatibility: %s", "; ".join(applied))
    return applied


@contextlib.contextmanager
def cuda_as_cpu():
    """Context manager exposing the scoped mode for rare call sites of our own
    code that must call a megatron helper with a hard-coded CUDA device."""
    if torch.cuda.is_available():
        yield
        return
    with _CudaAsCpu():
        yield
