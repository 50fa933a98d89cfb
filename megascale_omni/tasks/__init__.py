"""Per-family glue plugged into the training loop: model builder + data + loss + eval.

A task is the seam between the generic loop (``training/``) and a model
family (``models/`` + ``data/``): see :class:`megascale_omni.tasks.base.Task`.
Each family is declared once in :mod:`megascale_omni.tasks.registry`.
"""
