#!/usr/bin/env python
"""Import Hugging Face weights (local directories, no download) as a model-only checkpoint.

    # a decoder -> gpt family
    python tools/hf_import.py --llm /models/Qwen2-0.5B --out ckpt/qwen2-0.5b
    # a whole LLaVA -> llava family
    python tools/hf_import.py --llava /models/llava-1.5-7b-hf --out ckpt/llava-1.5-7b
    # decoder + vision tower -> llava with a freshly initialised projector (stage 1 trains it)
    python tools/hf_import.py --llm /models/vicuna-7b --vision /models/clip-vit-large-patch14-336 \\
        --feature-layer -2 --out ckpt/llava-stage0

Supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, and the MoE decoders
MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM (a moe: section in model.yaml,
docs/moe.md; also as LLaVA's text model); CLIPVisionModel/CLIPModel,
SiglipVisionModel/SiglipModel; LlavaForConditionalGeneration, LlavaOnevisionForConditionalGeneration
(SigLIP + Qwen2: its image_newline and video token too; docs/hf.md). OUT gets step_00000000/ (loads
under any TP/PP/VPP), model.yaml (the model/vision sections and checkpoint.pretrained: OUT)
and tokenizer/ (the HF tokenizer files, chat template and image processor config; a copy
inside step_00000000/ travels into every checkpoint of a run from OUT, so tools/hf_export.py
writes them back). Train from it with `checkpoint.pretrained=OUT` and the sections of model.yaml.

Anything else (LlavaNextForConditionalGeneration, ...), or
a directory with a tensor the mapping does not place, is refused: never imported half.

Exit codes: 2 bad arguments, unsupported architecture or option, a tensor left unmapped; 4 a broken
directory (missing shard or tensor, unreadable file, weights that do not
match config.json). OUT is written under a temporary name and renamed at the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import megascale_omni  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale_omni.config import ConfigError
from megascale_omni.entry import run_cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llm", type=Path, help="HF decoder directory (Llama/Qwen2/Mistral/Mixtral/Qwen2-MoE/Qwen3-MoE)")
    p.add_argument("--vision", type=Path, help="HF CLIP/SigLIP directory (with --llm: LLaVA, fresh projector)")
    p.add_argument("--llava", type=Path,
                   help="HF LlavaForConditionalGeneration or LlavaOnevisionForConditionalGeneration directory")
    p.add_argument("--out", type=Path, required=True, help="output directory (must not exist)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="model.seq_length to record (default: min(max_position_embeddings, 4096))")
    p.add_argument("--feature-layer", type=int, default=None,
                   help="with --vision: tower layer feeding the projector (default -2 for CLIP, -1 for SigLIP)")
    p.add_argument("--seed", type=int, default=1234, help="init seed of parts not imported (the projector)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if bool(args.llava) == bool(args.llm):
        raise ConfigError("--llm/--llava", None, "give --llava DIR, or --llm DIR (optionally with --vision DIR)")
    if args.vision and not args.llm:
        raise ConfigError("--vision", str(args.vision), "needs --llm: a tower alone is not a trainable family")
    from megascale_omni.hf.directory import HFDirectory
    from megascale_omni.hf.importer import read_llava, read_llm, read_llm_and_tower, write_import

    main_dir = HFDirectory(args.llava or args.llm, "--llava" if args.llava else "--llm")
    text = main_dir.config.get("text_config", main_dir.config)
    seq = args.seq_length or min(int(text.get("max_position_embeddings", 4096)), 4096)
    if seq <= 0:
        raise ConfigError("--seq-length", seq, "must be > 0")
    if args.llava:
        imp = read_llava(main_dir, seq)
    elif args.vision:
        imp = read_llm_and_tower(main_dir, HFDirectory(args.vision, "--vision"), args.feature_layer, seq)
    else:
        imp = read_llm(main_dir, seq)
    out = write_import(imp, args.out, args.seed, imp.provenance.get("image_token_id", -1))
    print(f"wrote {out} ({imp.sections['model']['family']}; {len(imp.state)} tensors"
          + (f", fresh: {', '.join(imp.fresh)}" if imp.fresh else "") + f"); train with: "
          f"--config <job>.yaml plus the sections of {out / 'model.yaml'}")


if __name__ == "__main__":
    run_cli(main)
