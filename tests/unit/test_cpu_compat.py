"""The megatron-core CPU compatibility layer: each patch does what it says."""

from __future__ import annotations

import pytest
import torch

from megascale_omni.platform import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


@pytest.fixture(scope="module", autouse=True)
def installed():
    return cpu_compat.install()


def test_install_is_idempotent_and_named(installed):
    assert cpu_compat.install() == installed
    assert len(installed) == len(set(installed)) >= 8
    assert any("current_device" in p for p in installed)
    assert any("DistributedOptimizer" in p for p in installed)
    assert any("forward_backward_pipelining_with_interleaving" in p for p in installed)


def test_current_device_is_cpu():
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_scoped_mode_redirects_cuda_factories_and_type_names():
    with cpu_compat.cuda_as_cpu():
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.to(torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    # Outside the scope nothing changed.
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_megatron_grad_clipping_scales_cpu_grads():
    from megatron.core.optimizer import clip_grads

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=6.0)
    assert torch.allclose(p.grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))


def test_rng_tracker_forks_the_cpu_generator():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    tracker.reset()
    tracker.add("a", 11)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    # The default stream is untouched by the fork...
    assert torch.equal(torch.get_rng_state(), before)
    # ...and the forked stream continues where it left off.
    with tracker.fork("a"):
        second = torch.rand(3)
    g = torch.Generator().manual_seed(11)
    expected = torch.rand(6, generator=g)
    assert torch.equal(torch.cat([first, second]), expected)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("b", 11)


def test_router_expert_bias_counter_runs_eagerly_and_counts():
    """The aux-loss-free bias's token counter is megatron's body, not a
    ``torch.compile`` wrapper (whose CPU compile cost seconds per process)."""
    from megatron.core.transformer.moe.router import TopKRouter

    fn = TopKRouter._apply_expert_bias
    assert fn.__megascale_cpu_compat__ and not hasattr(fn, "__wrapped__")

    class Router:
        enable_expert_bias = True
        local_tokens_per_expert = torch.zeros(3)

    routing = torch.tensor([[True, False, True], [True, True, False]])
    fn(Router, routing)
    fn(Router, routing, padding_mask=torch.tensor([[False], [True]]))
    assert Router.local_tokens_per_expert.tolist() == [3.0, 1.0, 2.0]
