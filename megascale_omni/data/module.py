"""The data part of a model family (in the spirit of torchtitan's
dataloader builder): the step-indexed plan, per-sample costs, the loader and
the broadcast inside a model replica.

One :class:`DataModule` per data kind: tokens (:mod:`megascale_omni.data.tokens_module`),
image-text conversations (:mod:`megascale_omni.data.llava.module`), DiT
images or latents (:mod:`megascale_omni.data.dit.module`); a new kind (video)
is a new subclass named by a registry entry, not an edit of the others.
The family's :class:`~megascale_omni.models.model_spec.ModelSpec` and
:class:`~megascale_omni.evaluation.base.Evaluator` read what they need of it
(vocabulary, tokenizer, held-out split).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from megascale_omni.config import JobConfig
from megascale_omni.data.bad_samples import BadSampleAccount
from megascale_omni.data.dataset_root import DefaultDataset
from megascale_omni.parallel import ParallelDims
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.platform import Platform


class DataModule(ABC):
    """The training data of one family on this rank (built on every rank,
    before the model). The global batch of step ``s`` is a pure function of
    (seed, s): the data position is the step.

    Subclasses set :attr:`seq_length` and implement :meth:`microbatches`
    and :meth:`global_batch_size_of`; the rest is optional.
    """

    #: Tokens per sequence as seen by the pipeline (the p2p tensor length).
    seq_length: int
    #: Job-wide bad-sample totals; modules that read samples set one (and
    #: update it in :meth:`microbatches`), elastic jobs sum it across replicas.
    bad_samples: Optional[BadSampleAccount] = None
    #: Vocabulary rows the language model is built with when the module
    #: resolved them (LLaVA's ``model.vocab_size: 0`` takes the tokenizer's);
    #: 0: ``model.vocab_size``. The step record's model FLOPs count with it.
    vocab_size: int = 0

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims,
                 default_dataset: Optional[DefaultDataset] = None):
        self.cfg = cfg
        self.platform = platform
        self.dims = dims
        #: Builds the family's embedded dataset when ``data.path`` is null (None: there is none).
        self.default_dataset = default_dataset

    @abstractmethod
    def microbatches(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        """DP rank ``dp_rank``'s share of global batch ``step``, as micro-batches
        (every rank; all TP/PP ranks of a replica build the same ones)."""

    @abstractmethod
    def global_batch_size_of(self, step: int) -> tuple[int, int]:
        """(samples, non-padding tokens) in global batch ``step`` over all DP
        ranks, for throughput reporting."""

    def images_of(self, step: int) -> Optional[int]:
        """Images in global batch ``step`` (None: text-only data)."""
        return None

    def batch_shape(self, step: int) -> Optional[BatchShape]:
        """What global batch ``step`` holds (all DP ranks), for its model FLOPs
        (:class:`megascale_omni.metrics.flops.StepFlops`); None: not counted."""
        return None

    def sample_ids(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        """Dataset ids in ``microbatches(step, dp_rank, dp_size)``, for the
        elastic sample ledger. Modules that support elastic jobs implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not report sample ids (elastic.ledger_dir)")

    def batch_stats(self, step: int) -> dict[str, int]:
        """Step-record fields of what global batch ``step`` holds (LLaVA: its
        modality mix and vision-token load, :mod:`megascale_omni.data.modality`);
        every rank, no I/O. Empty: none."""
        return {}

    def data_stats(self) -> dict[str, float]:
        """Cumulative data-health counters for the step record."""
        return dict(self.bad_samples.stats()) if self.bad_samples is not None else {}

    def data_identity(self) -> dict[str, dict]:
        """Content digests of the data the training plan is built from
        (:mod:`megascale_omni.data.identity`), compared before a replica group
        joins an elastic job. Computed at construction from what was already
        read: no I/O here (torchft's quorum thread calls it). Empty: nothing
        beyond the config decides the samples."""
        return {}

    def state_dict(self, sharded: bool) -> dict:
        """Data-health totals (and whatever else the data must restore), the
        same on every call. The data position is not here: it is the step."""
        return self.bad_samples.state_dict() if self.bad_samples is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict` (``state`` is the whole task state)."""
        if self.bad_samples is not None:
            self.bad_samples.load_state_dict(state)

    def close(self) -> None:
        """Release background resources (loader workers); every rank, once, at teardown."""
