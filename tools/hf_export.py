#!/usr/bin/env python
"""Export a checkpoint to a Hugging Face directory that transformers loads with from_pretrained.

    python tools/hf_export.py --checkpoint runs/llava/checkpoints --out hf/llava-trained
    python tools/hf_export.py --checkpoint ckpt/qwen2-0.5b --out hf/qwen2-roundtrip

--checkpoint is a checkpoint root (its newest intact checkpoint) or one step_NNNNNNNN
directory, saved under any TP/PP/VPP/DP layout (resharded to one process here).
gpt models become LlamaForCausalLM/Qwen2ForCausalLM (or what they were imported from; MoE
models MixtralForCausalLM/Qwen2MoeForCausalLM/Qwen3MoeForCausalLM, docs/moe.md),
llava models LlavaForConditionalGeneration, or LlavaOnevisionForConditionalGeneration with
vision.image_newline (the vision tower holds the layers up to the feature layer, read with
vision_feature_layer: -1). The tokenizer, chat template and
processor config come along: every checkpoint of a run that started from tools/hf_import.py
carries them (verified with the checkpoint). Otherwise one line says what OUT lacks.

Exit codes: 2 bad arguments or a model HF cannot express; 4 a broken checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import megascale_omni  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale_omni.entry import run_cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint root or step_NNNNNNNN directory")
    p.add_argument("--out", type=Path, required=True, help="output directory (must not exist)")
    p.add_argument("--image-token-id", type=int, default=None,
                   help="LLaVA trained here from scratch: id of the <image> token (imports know it)")
    p.add_argument("--video-token-id", type=int, default=None,
                   help="LLaVA-OneVision layout (vision.image_newline) trained from scratch: id of the <video> token")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from megascale_omni.hf.exporter import export_hf

    done = export_hf(args.checkpoint, args.out, "--checkpoint", args.image_token_id, args.video_token_id)
    print(f"wrote {done.path}" + (f" (weights, config, {', '.join(done.copied)})" if done.copied else ""))
    if done.missing:
        print(f"{done.path} has no {', '.join(done.missing)}: the checkpoint carries none (its run did not start "
              "from tools/hf_import.py, or the source lacked them); copy them from the model's tokenizer "
              "before loading it with AutoTokenizer/AutoProcessor")


if __name__ == "__main__":
    run_cli(main)
