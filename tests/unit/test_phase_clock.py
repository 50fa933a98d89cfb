"""The step's one clock (metrics/clock.py): spans and phases come from its
event source and are resolved with one synchronisation per step.

A fake event source stands in for CUDA events: the k-th event it records
happens 2**k microseconds in, and (like a CUDA event) its time can only be
read once an event at or after it was synchronised. Distinct powers of two
make every reported number name the events it came from.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from megascale_omni.entry import parse_for_family
from megascale_omni.metrics.breakdown import PHASES, install_dispatch_timer, install_pipeline_timer
from megascale_omni.metrics.clock import CudaEvents, HostEvents, PhaseClock, events_for
from megascale_omni.metrics.replica_group import rank_row
from megascale_omni.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

US = 1e-6


class FakeEvents:
    """Event ``k`` at ``2**k`` µs; counts synchronisations and refuses unsynchronised reads."""

    def __init__(self) -> None:
        self.recorded = 0
        self.synced_through = -1
        self.syncs: list[int] = []

    def record(self) -> int:
        self.recorded += 1
        return self.recorded - 1

    def synchronize(self, event: int) -> None:
        self.syncs.append(event)
        self.synced_through = max(self.synced_through, event)

    def seconds(self, start: int, end: int) -> float:
        if end > self.synced_through:
            raise RuntimeError(f"event {end} read before it was synchronised")
        return (2**end - 2**start) * US


def test_marks_and_phases_are_read_after_one_synchronisation():
    fake = FakeEvents()
    clock = PhaseClock(fake)
    clock.start()  # event 0
    with clock.phase("grad_sync"):  # 1 .. 2
        with clock.phase("cross_replica"):  # nested: counted in the outer phase, no events
            pass
    with clock.phase("pipeline_wait"):  # 3 .. 4
        pass
    assert clock.mark("fwd_bwd") == 5
    with clock.phase("pipeline_wait"):  # 6 .. 7
        pass
    clock.mark("optimizer")  # 8
    assert fake.syncs == []  # nothing waits while the step runs
    reading = clock.read()
    assert fake.syncs == [8]
    assert reading.spans == pytest.approx({"fwd_bwd": (32 - 1) * US, "optimizer": (256 - 32) * US}, rel=1e-12)
    assert reading.phases == pytest.approx(
        {"pipeline_wait": (16 - 8 + 128 - 64) * US, "moe_dispatch": 0.0, "grad_sync": (4 - 2) * US,
         "cross_replica": 0.0}, rel=1e-12)
    # A new step forgets the old one's marks and phases.
    clock.start()
    assert clock.read().spans == {} and clock.read().phases["pipeline_wait"] == 0.0


def test_event_source_follows_the_device():
    import torch

    assert isinstance(events_for(torch.device("cpu")), HostEvents)
    assert isinstance(events_for(torch.device("cuda", 0)), CudaEvents)
    host = HostEvents()
    a, b = host.record(), host.record()
    host.synchronize(b)
    assert host.seconds(a, b) == b - a >= 0.0


def test_the_pipeline_hook_feeds_the_same_clock(monkeypatch):
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    calls = []
    monkeypatch.setattr(P2PCommunicator, "_communicate", lambda self, **kw: calls.append(kw) or (None, None, None))
    install_pipeline_timer()
    fake = FakeEvents()
    previous = PHASES.use(fake)
    try:
        PHASES.start()  # 0
        P2PCommunicator._communicate(None, tensor_send_next=None)  # 1 .. 2
        PHASES.mark("fwd_bwd")  # 3
        reading = PHASES.read()
    finally:
        PHASES.use(previous)
    assert calls == [{"tensor_send_next": None}]
    assert reading.phases["pipeline_wait"] == pytest.approx((4 - 2) * US, rel=1e-12)
    assert fake.syncs == [3]


@pytest.mark.parametrize("dispatcher", ["MoEAlltoAllTokenDispatcher", "MoEAllGatherTokenDispatcher"])
def test_the_moe_dispatch_is_timed_in_forward_and_backward(monkeypatch, dispatcher):
    """A dispatcher's token exchange counts as ``moe_dispatch`` in forward (the
    call) and in backward (from its output tokens' gradient to its input's)."""
    import torch
    from megatron.core.transformer.moe import token_dispatcher

    cls = getattr(token_dispatcher, dispatcher)
    monkeypatch.setattr(cls, "token_dispatch", lambda self, tokens, probs: (tokens * 2, probs))
    install_dispatch_timer()
    fake = FakeEvents()
    previous = PHASES.use(fake)
    try:
        PHASES.start()  # 0
        x = torch.ones(3, requires_grad=True)
        tokens, _ = cls.token_dispatch(None, x, None)  # forward: 1 .. 2
        tokens.sum().backward()  # backward: 3 (gradient reaches the output) .. 4 (reaches the input)
        PHASES.mark("fwd_bwd")  # 5
        reading = PHASES.read()
    finally:
        PHASES.use(previous)
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert reading.phases["moe_dispatch"] == pytest.approx((4 - 2 + 16 - 8) * US, rel=1e-12)
    with torch.no_grad():  # no autograd: the forward call only, nothing left pending
        PHASES.use(fake)
        try:
            PHASES.start()  # 6
            cls.token_dispatch(None, torch.ones(3), None)  # 7 .. 8
            PHASES.mark("fwd_bwd")  # 9
            reading = PHASES.read()
        finally:
            PHASES.use(previous)
    assert reading.phases["moe_dispatch"] == pytest.approx((2**8 - 2**7) * US, rel=1e-12)


@pytest.fixture
def single_process_env():
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    yield
    for k in names:
        os.environ.pop(k, None)
    os.environ.update(saved)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_step_record_and_busy_time_come_from_the_clock(tmp_path, single_process_env):
    """Three steps of the tiny GPT in this process: per step the clock records
    5 events (start, grad sync begin and end, end of forward/backward, end of
    the optimizer) and synchronises once, on the last."""
    cfg, family = parse_for_family("gpt", [
        "--config", "examples/gpt/tiny.yaml", f"logging.output_dir={tmp_path}", "logging.tensorboard=false",
        "logging.progress_bar=false", "train.steps=3", "train.eval_interval=0",
    ], world_size=1)
    trainer = Trainer(cfg, family)
    fake = FakeEvents()
    previous = PHASES.use(fake)
    try:
        records = [r for r in trainer.train() if "step_s" in r]
    finally:
        PHASES.use(previous)
        trainer.close()
    assert isinstance(previous, HostEvents)  # what the Trainer chose on CPU
    assert fake.syncs == [4, 9, 14]  # once per step, not per phase
    for i, r in enumerate(records):
        scale = 32**i * US  # step i's events are 5i .. 5i + 4
        assert r["fwd_bwd_s"] == pytest.approx((8 - 1) * scale, rel=1e-12)
        assert r["grad_sync_s"] == pytest.approx((4 - 2) * scale, rel=1e-12)
        assert r["optimizer_s"] == pytest.approx((16 - 8) * scale, rel=1e-12)
        assert r["compute_s"] == pytest.approx(5 * scale, rel=1e-12)
        assert r["pipeline_wait_s"] == 0.0  # PP1: no pipeline send/receive
        # Straggler detection's busy time: the host's data wait + the clock's compute.
        assert r["busy_s"] == rank_row(r)[0] == pytest.approx(r["data_s"] + 5 * scale, rel=1e-12)
        # The model FLOPs of the step's 8 rows of one 32-token sample (tests/unit/test_model_flops.py).
        assert r["model_tflop"] == pytest.approx(327_761_920 / 1e12, rel=1e-12)
