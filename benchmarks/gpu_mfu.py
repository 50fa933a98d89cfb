"""Training throughput and MFU of a ~1B LLaVA on one device.

    .venv/bin/python benchmarks/gpu_mfu.py [--steps 10] [--warmup 3] [--peak-tflops T] [--json PATH] [--quick]

One process trains the LLaVA trainer (``pretrain_llava.py``'s code path, in
this process) on the embedded shapes dataset, generated at 224 px into a
temporary directory, with the local layer spec (torch SDPA per packed
segment; transformer-engine is not used even when installed), bf16 on CUDA
(fp32 on CPU), no checkpointing. The model (printed with every run):

- LM: 22 layers, hidden 2048, 16 heads in 4 query groups, SwiGLU FFN 5632,
  RMSNorm, RoPE, no biases, vocabulary 32000 (untied), 2048-token packed rows;
- ViT: 12 layers, hidden 768, 12 heads, FFN 3072, 224 px images in 16 px
  patches (196 tokens per image, no class token);
- projector: MLP 768 -> 2048 -> 2048;
- data: two loader processes (``data.num_workers``) build micro-batches ahead.

1.15 B matmul weights; with the 65.5 M input embedding, about 1.2 B
parameters. Global batch 8 packed rows, micro-batch 2.

Model FLOPs of a step are the step record's ``model_tflop``: the one count
of :mod:`megascale_omni.metrics.flops` (the family's cost model on the
step's global batch), which counts every weight matrix (LM with its output
layer, ViT patch embedding and layers, projector), causal LM attention per
packed sample (``s * (s + 1) / 2`` query-key pairs of ``4 * h`` FLOPs
forward for a sample of ``s`` tokens), bidirectional ViT attention (``P^2``
pairs per image), forward + backward = 3 x forward for what trains (the
images' patch embedding gets no input gradient), no padding and no
recompute. The script recounts every measured step from the plan's packed
sample lengths and checks it against the record, and checks that the
lengths add up to the tokens the trainer recorded.

tokens/s counts non-padding LM tokens; MFU = model FLOPs / median step time
/ the device's dense bf16 peak (``--peak-tflops``, else
``megascale_omni.metrics.flops.device_peak`` by exact device name, e.g.
"NVIDIA H100 80GB HBM3" / "NVIDIA H200" 989, "NVIDIA H200 NVL" 835 TFLOP/s,
a family-only match reported as guessed); without a known peak (CPU) MFU is "n/a".

``--quick``: a tiny LLaVA (2 + 1 layers, hidden 64) on 32 px images, 2 steps
after 1 warm-up, in seconds on a CPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is installed

from _quick import add_quick_flag, apply_quick  # noqa: E402

#: The ~1B model (config overrides) and its tiny --quick stand-in.
MODEL = {
    "model.num_layers": 22, "model.hidden_size": 2048, "model.num_attention_heads": 16,
    "model.num_query_groups": 4, "model.ffn_hidden_size": 5632, "model.vocab_size": 32000,
    "model.seq_length": 2048, "vision.image_size": 224, "vision.patch_size": 16, "vision.num_layers": 12,
    "vision.hidden_size": 768, "vision.num_attention_heads": 12, "vision.ffn_hidden_size": 3072,
    # Two loader processes build the micro-batches (224 px images) ahead of the step.
    "data.num_workers": 2,
}
TINY = {
    "model.num_layers": 2, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.num_query_groups": 2,
    "model.ffn_hidden_size": 128, "model.vocab_size": 256, "model.seq_length": 256, "vision.image_size": 32,
    "vision.patch_size": 8, "vision.num_layers": 1, "vision.hidden_size": 32, "vision.num_attention_heads": 2,
    "vision.ffn_hidden_size": 64,
}
COMMON = {
    "model.family": "llava", "model.activation": "swiglu", "model.normalization": "RMSNorm",
    "model.position_embedding_type": "rope", "model.add_bias_linear": "false", "model.layer_impl": "local",
    "train.global_batch_size": 8, "train.micro_batch_size": 2, "train.lr": 1e-4, "train.min_lr": 1e-5,
    "train.lr_warmup_steps": 0, "train.eval_interval": 0, "train.precision": "auto",
    "logging.tensorboard": "false", "logging.progress_bar": "false", "logging.log_interval": 1,
}


def describe(cfg, built: int, device: str, dtype: str) -> list[str]:
    m, v = cfg.model, cfg.vision
    t = cfg.train
    return [
        f"model: LLaVA, {built / 1e6:.2f} M parameters built",
        f"LM: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads / {m.query_groups} "
        f"query groups, {m.activation} FFN {m.ffn_size}, vocab {m.padded_vocab_size(m.vocab_size)}, "
        f"seq {m.seq_length}",
        f"ViT: {v.num_layers} layers, hidden {v.hidden_size}, {v.num_attention_heads} heads, FFN {v.ffn_size}, "
        f"{v.image_size} px / {v.patch_size} px patches = {v.tokens_per_image} tokens per image; projector "
        f"{v.projector_type} {v.hidden_size} -> {v.projector_hidden_size or m.hidden_size} -> {m.hidden_size}",
        f"run: global batch {t.global_batch_size} rows, micro-batch {t.micro_batch_size}, {dtype} on {device}, "
        f"layer impl {m.layer_impl} (torch SDPA per packed segment), one process",
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the measured ones")
    parser.add_argument("--samples", type=int, default=1200, help="training samples generated")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="dense bf16 peak of the device, TFLOP/s (default: by device name)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    quick = {"steps": 2, "warmup": 1, "samples": 200}
    add_quick_flag(parser, quick)
    args = apply_quick(parser.parse_args(argv), quick)

    import torch

    from megascale_omni.demo.llava_shapes import make_shapes_dataset
    from megascale_omni.entry import parse_for_family
    from megascale_omni.metrics.flops import device_peak, step_model_flops
    from megascale_omni.training.trainer import Trainer

    sizes = TINY if args.quick else MODEL
    with tempfile.TemporaryDirectory(prefix="gpu_mfu-") as tmp:
        data = Path(tmp) / "shapes"
        make_shapes_dataset(data, num_train=args.samples, num_val=0, seed=3,
                            image_size=int(sizes["vision.image_size"]), samples_per_shard=400)
        overrides = {**COMMON, **sizes, "data.path": data, "train.steps": args.warmup + args.steps,
                     "logging.output_dir": Path(tmp) / "run"}
        cfg, family = parse_for_family("llava", ["--config", str(REPO / "examples/llava/tiny_cpu.yaml"),
                                                 *(f"{k}={v}" for k, v in overrides.items())], world_size=1)
        trainer = Trainer(cfg, family)
        try:
            device = trainer.platform.device
            dtype = str(trainer.platform.default_dtype(cfg.train.precision)).removeprefix("torch.")
            built = sum(p.numel() for c in trainer.state.chunks for p in c.parameters())
            records = [r for r in trainer.train() if "step_s" in r]
            batches = {r["step"]: trainer.task.batch_shape(r["step"] - 1) for r in records}
        finally:
            trainer.close()

    measured = records[args.warmup:]
    flops, tokens, images = [], [], []
    for r in measured:
        batch = batches[r["step"]]
        assert batch.tokens == r["tokens"], (r["step"], batch.tokens, r["tokens"])
        flops.append(step_model_flops(cfg, family.cost_model_fn(cfg), batch))
        assert abs(flops[-1] / 1e12 - r["model_tflop"]) <= 1e-9 * r["model_tflop"], (r["step"], flops[-1])
        tokens.append(r["tokens"])
        images.append(r["images"])
    step_s = statistics.median(r["step_s"] for r in measured)
    data_s = statistics.median(r["data_s"] for r in measured)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    found = device_peak(args.peak_tflops, name)
    peak = found.tflops
    tflops = statistics.mean(flops) / step_s / 1e12
    result = {
        "device": name or "cpu", "dtype": dtype, "peak_tflops": peak, "peak_source": found.source,
        "parameters": built, "steps_measured": len(measured), "median_step_s": step_s, "median_data_wait_s": data_s,
        "tokens_per_s": statistics.mean(tokens) / step_s, "images_per_s": statistics.mean(images) / step_s,
        "model_tflop_per_step": statistics.mean(flops) / 1e12, "tflops": tflops,
        "mfu": tflops / peak if peak else None, "config": {k: str(v) for k, v in {**COMMON, **sizes}.items()},
    }
    for line in describe(cfg, built, str(device), dtype):
        print(line)
    print(f"device: {result['device']}, peak " + (f"{peak:g} TFLOP/s dense bf16 ({found.source})" if peak
                                                   else "unknown (MFU n/a)"))
    print("| steps | median step (s) | of it data wait (s) | tokens/s | images/s | model TFLOP/step | TFLOP/s | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    mfu = f"{result['mfu']:.1%}" if peak else "n/a"
    print(f"| {len(measured)} | {step_s:.4f} | {data_s:.4f} | {result['tokens_per_s']:.0f} | "
          f"{result['images_per_s']:.1f} | "
          f"{result['model_tflop_per_step']:.4g} | {tflops:.4g} | {mfu} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
