"""Context parallelism: activation memory per rank and step time for one long sequence at CP = 1, 2, 4.

    .venv/bin/python benchmarks/context_parallel.py [--tokens 16384] [--cp 1 2 4] [--repeats 2] [--quick]

One sequence of ``--tokens`` tokens (one THD segment) through a small GPT of
megatron-core with our local layer spec (``--layers`` layers, hidden
``--hidden``, ``--heads`` heads, RoPE, RMSNorm, SwiGLU, vocab ``--vocab``,
fp32, the layout-invariant init, so every CP size runs the same weights on
the same tokens). The benchmark starts ``max(--cp)`` processes itself
(torch.multiprocessing spawn, gloo, one torch thread each, so megatron is
imported once per process). For each CP size, one after the other, every
process initialises megatron's parallel state with
``context_parallel_size=cp``; ranks ``0 .. cp - 1`` (one CP group) build the
model, take their ``tokens / cp`` tokens of the load-balanced split
(``megascale_omni.parallel.context.cp_token_index``) and run forward +
backward, ring attention over the CP group in every layer, while the other
processes wait idle in a barrier.

Measured per rank:

- activation memory: the bytes of the unique storages saved for backward
  during the forward (``torch.autograd.graph.saved_tensors_hooks``; the
  parameters excluded), i.e. what forward leaves alive for backward. This
  is exact and independent of the allocator; the first step (also the
  warm-up) measures it;
- peak RSS growth during that first step (``malloc_trim``, VmHWM reset
  through ``/proc/self/clear_refs``, then VmHWM after the step minus VmRSS
  before it), a secondary number that also holds backward's transient
  buffers, the gradients and the allocator's fragmentation;
- step time: forward + backward wall time, ``--repeats`` steps after the
  first, slowest rank per step, the median over steps. Gradients are not
  reduced across ranks (the same amount at every CP size).

Correctness: the CP = 1 process also runs the forward with the ring forced
(a ring of one rank) and prints its loss beside the plain THD path's; every
CP size prints its loss (all-reduced over the CP group) and the largest
difference of its gradients (summed over the CP group) from CP = 1's.

``--quick``: 2048 tokens, CP 1 and 2, 1 timed step.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

QUICK = {"tokens": 2048, "cp": [1, 2], "repeats": 1}
SEED = 1234


# ------------------------------------------------------------------ per rank


def _proc_status(field: str) -> int:
    """``VmRSS``/``VmHWM`` of this process in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Return freed heap memory to the OS, then reset VmHWM to the current RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class SavedActivations:
    """Unique storages saved for backward while active (parameters excluded)."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip:
            self.storages[ptr] = max(self.storages.get(ptr, 0), storage.nbytes())
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())




def measure(cp: int, args: argparse.Namespace, out_dir: str) -> dict:
    """One CP size on this rank (a rank of the CP group ``0 .. cp - 1``)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megascale_omni.config import ModelConfig, ParallelConfig
    from megascale_omni.models.attention import PackedCoreAttention, cp_shard_batch, thd_inputs
    from megascale_omni.models.gpt import build_gpt_chunks, transformer_config
    from megascale_omni.models.init import init_layout_invariant

    group = mpu.get_context_parallel_group()
    cp_rank = mpu.get_context_parallel_rank()
    model_cfg = ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, vocab_size=args.vocab,
        seq_length=args.tokens, position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        layer_impl="local",
    )
    config = transformer_config(model_cfg, ParallelConfig(cp=cp), torch.float32)
    (model,) = build_gpt_chunks(model_cfg, config, vocab_size=model_cfg.padded_vocab_size(args.vocab),
                                max_sequence_length=args.tokens)
    init_layout_invariant([model], seed=SEED, std=model_cfg.init_method_std, num_layers=args.layers)
    params = list(model.parameters())

    # One sequence of the full length, one THD segment; this rank keeps its 2 chunks.
    seq = torch.randint(0, args.vocab, (1, args.tokens + 1), generator=torch.Generator().manual_seed(SEED))
    full = {
        "tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(),
        "loss_mask": torch.ones(1, args.tokens), "position_ids": torch.arange(args.tokens).unsqueeze(0),
        "cu_seqlens": torch.tensor([0, args.tokens], dtype=torch.int32),
    }
    batch = cp_shard_batch(full, cp, cp_rank)
    tokens, position_ids, labels, packed = thd_inputs(batch, cp)
    loss_mask = batch["loss_mask"].reshape(-1)

    def forward():
        per_token = model(tokens, position_ids, None, labels=labels, packed_seq_params=packed)
        return (per_token.reshape(-1) * loss_mask).sum()

    def step(saved: SavedActivations | None = None) -> tuple[float, float, float]:
        for p in params:
            p.grad = None
        dist.barrier(group)
        t0 = time.perf_counter()
        with (torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack) if saved
              else contextlib.nullcontext()):
            loss_sum = forward()
        t1 = time.perf_counter()
        (loss_sum / args.tokens).backward()  # the mean over all CP ranks' tokens
        t2 = time.perf_counter()
        return loss_sum.item(), t1 - t0, t2 - t0

    # Step 1 (also the warm-up): saved activations, peak RSS growth (nothing is
    # cached by the allocator yet), the loss and the gradients (summed over the
    # CP group) for the cross-check.
    saved = SavedActivations(params)
    reset = _reset_peak_rss()
    before = _proc_status("VmRSS")
    loss_sum, _, _ = step(saved)
    rss_growth = _proc_status("VmHWM") - before if reset else None
    loss = torch.tensor([loss_sum], dtype=torch.float64)
    dist.all_reduce(loss, group=group)
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(grads, group=group)
    if cp_rank == 0:
        torch.save(grads, f"{out_dir}/grads-cp{cp}.pt")
    del grads

    times, fwd_times = [], []
    for _ in range(args.repeats):
        _, fwd_s, step_s = step()
        times.append(step_s)
        fwd_times.append(fwd_s)

    result = {
        "cp": cp, "cp_rank": cp_rank, "local_tokens": tokens.numel(), "saved_bytes": saved.bytes,
        "saved_storages": len(saved.storages), "rss_growth": rss_growth, "step_s": times, "fwd_s": fwd_times,
        "loss": float(loss) / args.tokens,
    }
    if cp == 1:  # a ring of one rank against the plain THD path (step 1), same weights and tokens
        for module in model.modules():
            if isinstance(module, PackedCoreAttention):
                module.force_ring = True
        with torch.no_grad():
            result["ring_loss"] = forward().item() / args.tokens
    return result


def worker(rank: int, world: int, args: argparse.Namespace, out_dir: str) -> None:
    """A pool rank: for every CP size, ranks ``0 .. cp - 1`` measure while the others wait."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megascale_omni.parallel.state import ParallelDims, initialize_parallel
    from megascale_omni.platform.device import init_platform

    torch.set_num_threads(1)
    init_platform("cpu")  # megatron-core's CPU patches
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    for cp in args.cp:
        # TP1 PP1: the CP groups are consecutive ranks, so ranks 0 .. cp-1 form one.
        initialize_parallel(ParallelDims(1, 1, cp, world // cp, None, world), SEED)
        if rank < cp:
            t0 = time.perf_counter()
            result = measure(cp, args, out_dir)
            with open(f"{out_dir}/result-cp{cp}-rank{rank}.json", "w") as f:
                json.dump(result, f)
            if rank == 0:
                print(f"  cp={cp}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        gc.collect()
        dist.barrier()
        mpu.destroy_model_parallel()
    dist.destroy_process_group()


# ---------------------------------------------------------------------- main


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="sequence length (a multiple of 2 * every cp)")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="CP sizes (1 first: the baseline)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per CP size, after the measured first")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    if args.cp[0] != 1:
        p.error("--cp must start with 1 (the baseline)")
    if any(max(args.cp) % cp for cp in args.cp):
        p.error("every --cp must divide the largest (its ranks are a pool of max(--cp) processes)")
    bad = [cp for cp in args.cp if args.tokens % (2 * cp)]
    if bad:
        p.error(f"--tokens {args.tokens} is not a multiple of 2 * cp for cp in {bad}")

    os.environ["OMP_NUM_THREADS"] = "1"  # spawned ranks inherit it: one thread per rank, as torchrun
    import torch
    import torch.multiprocessing as mp

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="cp-bench-") as tmp:
        t0 = time.perf_counter()
        # One pool of max(cp) processes (megatron imports once per process);
        # each CP size re-initialises megatron's parallel state.
        mp.start_processes(worker, args=(max(args.cp), args, tmp), nprocs=max(args.cp), start_method="spawn")
        wall = time.perf_counter() - t0
        results = {cp: [json.loads(Path(f"{tmp}/result-cp{cp}-rank{r}.json").read_text()) for r in range(cp)]
                   for cp in args.cp}
        ref_grads = torch.load(f"{tmp}/grads-cp1.pt")
        grad_diff = {}
        for cp in args.cp:
            g = torch.load(f"{tmp}/grads-cp{cp}.pt")
            grad_diff[cp] = float((g - ref_grads).abs().max() / ref_grads.abs().max())

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, torch {torch.__version__}; load average (1 min) "
          f"{load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end; {wall:.0f} s")
    print(f"model: GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
          f"RoPE, RMSNorm, SwiGLU, fp32, local spec; one sequence of {args.tokens} tokens (one THD segment)")
    base = results[1][0]
    plain, ring = base["loss"], base["ring_loss"]
    print(f"sanity, CP=1: loss plain THD path {plain:.6f}, ring of one rank {ring:.6f}, "
          f"relative difference {abs(ring - plain) / abs(plain):.1e}")
    base_act = base["saved_bytes"]
    base_step = statistics.median(base["step_s"])  # one rank at CP=1
    print("| CP | tokens per rank | activations per rank (MiB, max over ranks) | vs CP1 | ideal 1/CP | "
          "peak RSS growth per rank (MiB) | fwd s | step s (fwd+bwd) | vs CP1 | loss | grad max rel. diff vs CP1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cp, ranks in results.items():
        act = max(r["saved_bytes"] for r in ranks)
        growth = [r["rss_growth"] for r in ranks if r["rss_growth"] is not None]
        step = statistics.median(max(r["step_s"][i] for r in ranks) for i in range(args.repeats))
        fwd = statistics.median(max(r["fwd_s"][i] for r in ranks) for i in range(args.repeats))
        print(f"| {cp} | {ranks[0]['local_tokens']} | {_mib(act)} | {act / base_act:.3f} | {1 / cp:.3f} | "
              f"{_mib(max(growth)) if growth else 'n/a'} | {fwd:.2f} | {step:.2f} | {step / base_step:.2f} | "
              f"{ranks[0]['loss']:.6f} | {grad_diff[cp]:.1e} |")
    cores = os.cpu_count() or 1
    over = [cp for cp in args.cp if cp > cores]
    if over:
        print(f"note: {cores} cores; CP={', '.join(map(str, over))} runs more ranks than cores, so its step time "
              f"measures oversubscription, not CP: time ratios mean something only up to CP={cores}.")
    print("activation ratio vs ideal: " + ", ".join(
        f"CP={cp} {max(r['saved_bytes'] for r in ranks) / base_act * cp:.3f}x of 1/CP"
        for cp, ranks in results.items()))


if __name__ == "__main__":
    main()
