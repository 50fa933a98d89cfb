"""Hugging Face interoperability: import HF decoders (Llama/Qwen2/Mistral, and
the MoE Mixtral/Qwen2-MoE/Qwen3-MoE),
vision towers (CLIP/SigLIP) and whole LLaVA models into model-only
checkpoints, and export our checkpoints back to HF directories.

Reads and writes local directories only (safetensors); ``transformers``
itself is needed only to load the exported models.
"""
