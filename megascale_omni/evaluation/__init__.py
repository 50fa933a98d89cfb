"""Held-out evaluations: one :class:`~megascale_omni.evaluation.base.Evaluator`
per measurement, named by a family's registry entry and chosen by ``train.evaluator``."""
