"""Sharded async checkpoints: triggered, two-tier, atomic, reshardable across DP.

``manager.Checkpointer`` is the entry point (imports megatron-core);
``layout`` is the torch-free on-disk format used by tools as well.
"""

from megascale_omni.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
