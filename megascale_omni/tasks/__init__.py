"""Per-family glue plugged into the Trainer: model builder + data + loss.

A task is the seam between the generic loop (``training/``) and a model
family (``models/`` + ``data/``); see :class:`megascale_omni.training.trainer.Task`.
"""
