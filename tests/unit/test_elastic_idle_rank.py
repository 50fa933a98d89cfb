"""A rank without micro-batches in a step after its first backward (more DP
ranks than micro-batches, docs/elastic.md step 2) with
``parallel.overlap_grad_reduce=true``: megatron starts bucket reductions
only from backward hooks after the first batch, so such a rank must start
them itself (``CrossReplicaSums.finalize_without_backward``). Real megatron
DDP, a real torchft lighthouse and manager, one group of one rank, in process."""

from __future__ import annotations

import pytest
import torch

from megascale_omni.config import ElasticConfig, load_job_config
from tests.launcher import REPO

pytestmark = pytest.mark.timeout(120)


def test_rank_without_microbatches_after_a_backward_steps_with_overlap():
    from megascale_omni.elastic import adapter
    from megascale_omni.elastic.cross_replica import CrossReplicaSums
    from megascale_omni.elastic.membership import ReplicaQuorum
    from megascale_omni.models.standalone import one_process
    from megascale_omni.parallel import ParallelDims
    from megascale_omni.platform import init_platform
    from megascale_omni.tasks.registry import get_family
    from megascale_omni.training.optimizer import build_optimizer, wrap_ddp
    from megascale_omni.training.step import train_step

    cfg = load_job_config(["--config", str(REPO / "examples/gpt/tiny.yaml"), "train.global_batch_size=2",
                           "parallel.overlap_grad_reduce=true"])
    lighthouse = adapter.lighthouse_server(min_replicas=1)
    with one_process(seed=cfg.train.seed):
        task = get_family("gpt").build_task(cfg, init_platform(), ParallelDims.from_config(cfg.parallel, 1))
        model = task.build_model()
        chunks = wrap_ddp(model, model[0].config, cfg.parallel, overlap=True)
        optimizer, scheduler = build_optimizer(chunks, cfg.train, cfg.parallel, torch.float32)
        quorum = ReplicaQuorum(
            ElasticConfig(enabled=True, lighthouse=lighthouse.address().replace("[::]", "localhost"),
                          replica_id="r0", timeout_s=20, quorum_timeout_s=20),
            state_dict=dict, load_state_dict=lambda state: None)
        replica = CrossReplicaSums(quorum)
        replica.attach(chunks)
        # As the membership installs it (elastic/service.py).
        model[0].config.finalize_model_grads_func = replica.finalize_model_grads
        groups = [group for chunk in chunks for group in adapter.bucket_groups(chunk)]
        try:
            stats = []
            for step, mbs in enumerate([task.microbatches(1, 0, 1), [], task.microbatches(3, 0, 1), []], 1):
                replica.new_step()
                quorum.begin_step()
                stats.append(train_step(chunks, optimizer, scheduler, task.forward_step, mbs, cfg.model.seq_length,
                                        cfg.train.micro_batch_size, cross_replica=replica))
                # From step 2 on megatron knows each group's gradients from the
                # first batch and starts reductions only from backward hooks.
                assert all(group.is_first_batch for group in groups) == (step == 1), step
        finally:
            quorum.leave()
            lighthouse.shutdown()
    assert [s.committed for s in stats] == [True] * 4
    assert [s.num_microbatches for s in stats] == [1, 0, 1, 0]
    # Alone in the quorum, the steps without micro-batches have no tokens and zero gradients.
    assert [s.num_loss_tokens > 0 for s in stats] == [True, False, True, False]
    assert stats[1].grad_norm == stats[3].grad_norm == 0.0
    assert stats[0].grad_norm > 0 and stats[2].grad_norm > 0
