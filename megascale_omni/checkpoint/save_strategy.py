"""megatron's ``torch_dist`` save strategy, kept across the saves of a run.

Built once per checkpoint structure, the strategy lets megatron skip work
that only depends on the structure (which tensors, shapes, shards; not
their values):

* ``cached_metadata`` (megatron's ``use_cached_ckpt_structure``): from the
  third save on, no local plan is built and no plan is gathered; rank 0
  reuses the global metadata (the second save checks that the plan repeats).
* :class:`FullyParallelSaveStrategyWrapper` over the DP x CP group when it
  has more than one rank: replicated tensors are split evenly across the
  group instead of all being written by its first rank, so each rank
  copies, plans and writes about 1/DP of them; the split is computed once.
* megatron's sharding-integrity check (a collective) runs on the first save
  of each structure only.

The cache is only valid while the structure repeats, so :meth:`prepare`
compares it with the previous save's (agreed across ranks) and starts a new
strategy when it differs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, apply_factories
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.utils import extract_sharded_base


def structure(state: dict[str, Any]) -> list[tuple]:
    """What a cached save plan depends on: per sharded item its key, type,
    shape, dtype, offsets and replica id (not the values)."""
    out = []
    for v in nested_values(state):
        if not isinstance(v, ShardedBase):
            continue
        data = getattr(v, "data", None)
        tensor = (tuple(data.shape), str(data.dtype)) if isinstance(data, torch.Tensor) else None
        flat = getattr(v, "flattened_range", None)
        out.append((type(v).__name__, v.key, tuple(v.global_shape), tuple(v.global_offset), str(v.replica_id),
                    tensor, (flat.start, flat.stop) if flat is not None else None))
    return out


class SaveStrategy:
    """The strategy for every save of one Checkpointer (every rank).

    ``group``: gloo group of the job's ranks, used to agree whether the
    structure changed. ``parallel_save``: use the fully-parallel wrapper
    when the DP x CP group has more than one rank.
    """

    def __init__(self, group: dist.ProcessGroup, parallel_save: bool = True):
        self.group = group
        self.parallel_save = parallel_save
        self.strategy: Optional[AsyncSaveShardedStrategy] = None
        self._structure: Optional[list[tuple]] = None
        self._validated = False
        #: Strategies built so far (1 while the structure repeats).
        self.builds = 0

    def prepare(self, state: dict[str, Any], saving: bool = True) -> tuple[AsyncSaveShardedStrategy, bool]:
        """Apply megatron's tensor factories and the fully-parallel split to
        ``state`` in place (every rank, before staging: afterwards the main
        replicas are the tensors this rank writes). Returns the strategy and
        whether to validate the save: the first save of its structure.
        ``saving=False`` when ``state`` is only inspected, not saved."""
        apply_factories(state)
        now = structure(state)
        changed = torch.tensor([int(now != self._structure)])
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.group)
        fresh = bool(changed.item())
        if fresh:
            self.strategy = self._build()
            self._structure = now
            self.builds += 1
            self._validated = False
        if isinstance(self.strategy, FullyParallelSaveStrategyWrapper):
            # On the sharded items only, as megatron's save passes them; they
            # are the objects of ``state``, whose replica ids change in place.
            self.strategy.apply_saving_parallelization(extract_sharded_base(state)[0])
        validate = saving and not self._validated
        self._validated = self._validated or saving
        return self.strategy, validate

    def _build(self) -> AsyncSaveShardedStrategy:
        base = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1, cached_metadata=True)
        dp = mpu.get_data_parallel_world_size(with_context_parallel=True) if mpu.model_parallel_is_initialized() else 1
        if not self.parallel_save or dp <= 1:
            return base
        return FullyParallelSaveStrategyWrapper(
            base, mpu.get_data_parallel_group(with_context_parallel=True), do_cache_distribution=True
        )

    @property
    def base(self) -> Optional[TorchDistSaveShardedStrategy]:
        """The torch_dist strategy under the wrapper, if any."""
        return getattr(self.strategy, "base_strategy", self.strategy)

    @property
    def plan_cached(self) -> bool:
        """True once megatron reuses its save plan (validated by a repeat)."""
        return bool(self.base is not None and self.base.validated_cache_reuse)

