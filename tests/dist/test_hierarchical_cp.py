"""``parallel.cp_comm_type: a2a+p2p`` builds megatron's hierarchical CP
groups: four gloo processes, CP = 4 with ``hierarchical_cp_sizes [2, 2]``;
every rank's a2a group is ``{2i, 2i+1}`` and its p2p group ``{j, j+2}``
(megatron's ``create_hierarchical_groups`` order), exactly."""

from __future__ import annotations

import pytest

from tests.launcher import gloo_rank, run_spawned_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

# megatron builds hierarchical groups with einops, which transformer-engine
# installs; without it the run stops with a ConfigError (tests/unit/test_cp_comm_type.py).
pytest.importorskip("einops")

WORLD = 4


def _worker(rank: int, port: int, out_dir: str) -> None:
    gloo_rank(rank, port, WORLD, out_dir, _groups)


def _groups() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megascale_omni.config import ParallelConfig
    from megascale_omni.parallel.state import ParallelDims, destroy_parallel, initialize_parallel

    cfg = ParallelConfig(cp=4, cp_comm_type="a2a+p2p", hierarchical_cp_sizes=[2, 2])
    initialize_parallel(ParallelDims.from_config(cfg, WORLD), seed=0)
    groups = mpu.get_hierarchical_context_parallel_groups()
    result = {"groups": [sorted(dist.get_process_group_ranks(g)) for g in groups],
              "cp": sorted(dist.get_process_group_ranks(mpu.get_context_parallel_group()))}
    destroy_parallel()
    return result


def test_a2a_p2p_builds_hierarchical_cp_groups(tmp_path):
    for rank, data in enumerate(run_spawned_ranks(_worker, WORLD, tmp_path, timeout=240)):
        assert data["cp"] == [0, 1, 2, 3]
        assert data["groups"] == [[rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]], (rank, data)
