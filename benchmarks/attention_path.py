"""Step time of the torch-only packed attention path vs the per-segment path it replaced, on CPU.

    .venv/bin/python benchmarks/attention_path.py [--rounds 5] [--quick]

Two workloads, one process, fp32, the local layer spec:

- packed GPT: ``--layers`` layers, hidden 256, 8 heads / 2 query groups
  (GQA), RoPE, RMSNorm, SwiGLU, vocab 1024; a micro-batch of 2 rows of
  ``--seq`` tokens packed with random sample lengths (8..``--seq``/2) and a
  padding tail per row, as the packer lays them out;
- LLaVA (examples/llava/tiny_cpu.yaml at seq ``--seq``, 2 query groups):
  2 rows, each with samples holding one 16-token image (bidirectional ViT).

For each workload the same model (same weights, same batch) runs forward +
backward of a mean-of-squares loss of the logits with the new path
(``megascale_omni.models.packed_kernels`` + ``packed_rope``) and with the
reference (``tests/attention_reference.py``: one SDPA call per segment,
``repeat_interleave`` for GQA, megatron's THD RoPE), switched in place in
alternating order, ``--rounds`` rounds after one warm-up step each; step =
median of the process CPU time per step (one torch thread, ``--threads``:
CPU time then counts the step's own work, not the waits for a core that a
shared host adds to wall time). The logits of the two paths are compared in
the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

QUICK = {"rounds": 1, "seq": 128, "layers": 1}


def _packed_batch(seq: int, rows: int, vocab: int, seed: int, image_token: int = -1, image_len: int = 0):
    """A THD micro-batch of ``rows`` packed rows; with ``image_len`` every
    sample opens with ``image_len`` image tokens. Returns (batch, images)."""
    import torch

    from megascale_omni.data.packing import Pack, collate_pack, packed_cu_seqlens

    g = torch.Generator().manual_seed(seed)
    collated, images = [], 0
    for _ in range(rows):
        lengths, used = [], 0
        while True:
            n = int(torch.randint(max(8, image_len + 4), max(9, seq // 2), (1,), generator=g))
            if used + n > seq - 3:  # leave a padding tail
                break
            lengths.append(n)
            used += n
        members = []
        for n in lengths:
            words = torch.randint(6, vocab, (n,), generator=g).tolist()
            if image_len:
                words[1 : 1 + image_len] = [image_token] * image_len
                images += 1
            members.append(words)
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        collated.append(collate_pack(Pack(tuple(range(len(lengths))), tuple(offsets), tuple(lengths)), members,
                                     None, None, seq_length=seq, pad_id=0))
    batch = {key: torch.stack([r[key] for r in collated]) for key in ("tokens", "position_ids", "segment_ids")}
    batch["cu_seqlens"] = packed_cu_seqlens(batch["segment_ids"])
    return batch, images


def _step(model, batch, images):
    """Forward + backward; returns (CPU seconds of this process, logits).

    CPU time, not wall time: with one torch thread it counts this step's own
    work, not the time spent waiting for a core that other jobs hold."""
    from megascale_omni.models.attention import thd_inputs

    model.zero_grad(set_to_none=True)
    start = time.process_time()
    tokens, position_ids, _, params = thd_inputs(batch)  # fresh params: per-micro-batch caches rebuilt
    if images is not None:
        out = model(tokens, position_ids, params, images=images)
    else:
        out = model(tokens, position_ids, None, packed_seq_params=params)
    out.float().pow(2).mean().backward()
    return time.process_time() - start, out.detach()


def _compare(name, model, batch, images, rounds):
    from tests.attention_reference import use_reference_attention

    times = {"new": [], "old": []}
    logits = {}
    for path in ("new", "old"):  # warm-up
        use_reference_attention(model, reference=path == "old")
        _, logits[path] = _step(model, batch, images)
    for r in range(rounds):
        for path in (("new", "old") if r % 2 == 0 else ("old", "new")):
            use_reference_attention(model, reference=path == "old")
            times[path].append(_step(model, batch, images)[0])
    use_reference_attention(model, reference=False)
    new, old = statistics.median(times["new"]), statistics.median(times["old"])
    diff = float((logits["new"] - logits["old"]).abs().max())
    segments = batch["cu_seqlens"].numel() - 1
    print(f"| {name} | {segments} | {old * 1e3:.1f} ms | {new * 1e3:.1f} ms | {new / old:.2f} | {diff:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seq", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--layers", type=int, default=4, help="GPT layers")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    add_quick_flag(parser, QUICK)
    args = apply_quick(parser.parse_args(), QUICK)

    import torch

    from megascale_omni.config import ModelConfig, load_job_config
    from megascale_omni.models.standalone import build_model, one_process

    # One thread: on a shared 2-core host a second thread mostly measures the neighbours.
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"rounds {args.rounds} (alternating order, after one warm-up step per path), step = fwd + bwd, "
          "median of process CPU time")
    print("| workload | segments | per-segment (old) | packed (new) | new / old | max logit diff |")
    print("|---|---|---|---|---|---|")
    with one_process(seed=0):
        gpt = load_job_config(["--config", str(REPO / "examples/gpt/tiny.yaml")])
        gpt.model = ModelConfig(
            num_layers=args.layers, hidden_size=256, num_attention_heads=8, num_query_groups=2, vocab_size=1024,
            seq_length=args.seq, position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
            layer_impl="local",
        )
        model = build_model(gpt, gpt.model.padded_vocab_size(1024), -1).train()
        batch, _ = _packed_batch(args.seq, 2, 1024, seed=1)
        _compare(f"packed GPT, {args.layers} layers, 2 x {args.seq} tokens", model, batch, None, args.rounds)

        image_token, vocab = 5, 64
        llava = load_job_config(["--config", str(REPO / "examples/llava/tiny_cpu.yaml"), f"model.vocab_size={vocab}",
                                 f"model.seq_length={args.seq}", "model.num_query_groups=2"])
        model = build_model(llava, llava.model.padded_vocab_size(vocab), image_token).train()
        p, size = llava.vision.tokens_per_image, llava.vision.image_size
        batch, count = _packed_batch(args.seq, 2, vocab, seed=2, image_token=image_token, image_len=p)
        images = torch.randn(count, 3, size, size, generator=torch.Generator().manual_seed(3))
        _compare(f"LLaVA, {count} images, 2 x {args.seq} tokens", model, batch, images, args.rounds)


if __name__ == "__main__":
    main()
