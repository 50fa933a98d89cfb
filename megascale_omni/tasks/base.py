"""The Task: what the training loop sees of a model family, composed of the
family's three parts.

A family's registry entry (:mod:`megascale_omni.tasks.registry`) names a
:class:`~megascale_omni.data.module.DataModule` (plan, costs, loader,
broadcast), a :class:`~megascale_omni.models.model_spec.ModelSpec` (chunks,
forward step and loss) and its evaluators (:class:`~megascale_omni.evaluation.base.Evaluator`);
:meth:`~megascale_omni.tasks.registry.ModelFamily.build_task` builds them in
that order on every rank and hands this object to the Trainer. The Trainer,
the checkpoint's :class:`~megascale_omni.checkpoint.train_state.TrainState`
and the elastic driver call the methods below and nothing else.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from megascale_omni.data.bad_samples import BadSampleAccount
from megascale_omni.data.module import DataModule
from megascale_omni.evaluation.base import Evaluator
from megascale_omni.models.model_spec import ModelSpec
from megascale_omni.parallel.batch_shape import BatchShape


class Task:
    """One family's parts behind the loop's narrow surface (every rank)."""

    def __init__(self, data: DataModule, model: ModelSpec, evaluator: Evaluator):
        self.data = data
        self.model = model
        self.evaluator = evaluator

    @property
    def cfg(self):
        """The job config the parts were built from."""
        return self.data.cfg

    # ------------------------------------------------------------- model
    @property
    def seq_length(self) -> int:
        """Tokens per sequence as seen by the pipeline (the p2p tensor length)."""
        return self.data.seq_length

    def build_model(self) -> list[torch.nn.Module]:
        """This rank's model chunks (``vpp`` of them when interleaved)."""
        return self.model.build_model()

    def forward_step(self, data_iterator: Any, model: torch.nn.Module) -> tuple[Any, Callable]:
        """megatron ``forward_step_func``: returns (output, loss_func)."""
        return self.model.forward_step(data_iterator, model)

    def pipeline_shape(self) -> tuple[int, int]:
        """``(seq_length, micro_batch_size)`` for megatron's p2p buffers."""
        return self.model.pipeline_shape()

    def lr_mult(self) -> dict[str, float]:
        """Learning-rate factors by parameter-name pattern (fnmatch)."""
        return self.model.lr_mult()

    @property
    def reads_weights_after_step(self) -> bool:
        """:meth:`after_step` reads the weights (a pending parameter gather completes first)."""
        return self.model.reads_weights_after_step

    def after_step(self, step: int) -> None:
        """After each committed optimizer step, every rank; ``step`` already counts it."""
        self.model.after_step(step)

    # -------------------------------------------------------------- data
    @property
    def bad_samples(self) -> Optional[BadSampleAccount]:
        """Job-wide bad-sample totals (elastic jobs sum them across replicas)."""
        return self.data.bad_samples

    def microbatches(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        """DP rank ``dp_rank``'s micro-batches of global batch ``step`` (every rank)."""
        return self.data.microbatches(step, dp_rank, dp_size)

    def sample_ids(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        """Dataset ids in ``microbatches(step, dp_rank, dp_size)`` (elastic ledger)."""
        return self.data.sample_ids(step, dp_rank, dp_size)

    def global_batch_size_of(self, step: int) -> tuple[int, int]:
        """(samples, non-padding tokens) in global batch ``step`` over all DP ranks."""
        return self.data.global_batch_size_of(step)

    def images_of(self, step: int) -> Optional[int]:
        """Images in global batch ``step`` (None: text-only data)."""
        return self.data.images_of(step)

    def batch_shape(self, step: int) -> Optional[BatchShape]:
        """What global batch ``step`` holds (all DP ranks), for its model FLOPs; None: not counted."""
        return self.data.batch_shape(step)

    @property
    def vocab_size(self) -> int:
        """Vocabulary rows the language model is built with (0: ``model.vocab_size``)."""
        return self.data.vocab_size

    def data_stats(self) -> dict[str, float]:
        """Cumulative data-health counters for the step record."""
        return self.data.data_stats()

    def batch_stats(self, step: int) -> dict[str, int]:
        """Step-record fields of what global batch ``step`` holds (modality mix, vision load)."""
        return self.data.batch_stats(step)

    def model_stats(self) -> dict:
        """The model's fields of the step record (MoE routing); every rank, a collective for MoE models."""
        return self.model.step_stats()

    def discard_model_stats(self) -> None:
        """Forget the model's step-record counts so far (every rank, before each step attempt)."""
        self.model.discard_step_stats()

    def data_identity(self) -> dict[str, dict]:
        """Content digests of the training data (no I/O; torchft's quorum thread calls it)."""
        return self.data.data_identity()

    # ------------------------------------------------------- evaluation
    def evaluate(self, chunks: Sequence[torch.nn.Module], step: int) -> Optional[dict[str, float]]:
        """Held-out evaluation after ``step`` steps (every rank; metrics on the loss rank)."""
        return self.evaluator.evaluate(chunks, step)

    # ------------------------------------------------------------ state
    def state_dict(self, sharded: bool) -> dict:
        """The task's own state, one flat dict: the data's (skip counters, ...)
        and the model's (EMA weights, ...), the same on every call. ``sharded``:
        for a checkpoint, where tensors that are split like the model are
        megatron ShardedTensors; else plain tensors of this rank (a joining
        replica's same rank receives them). The data position is the step."""
        return {**self.data.state_dict(sharded), **self.model.state_dict(sharded)}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict` (loaded tensors are in this rank's layout)."""
        self.data.load_state_dict(state)
        self.model.load_state_dict(state)

    def close(self) -> None:
        """Release background resources; every rank, once, at teardown."""
        self.data.close()
