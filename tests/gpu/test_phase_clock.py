"""The phase clock on CUDA: events time the queued kernels, where a host timer only sees their launch.

One process, no training: 50 bf16 matmuls of 4096 x 4096 (about 7 TFLOP,
milliseconds on any data-centre GPU) are queued inside a phase timed by
both clocks at once. The host clock's phase ends when the launches return;
the CUDA clock's when the stream finished them, which the one
synchronisation of ``read`` waits for.
"""

from __future__ import annotations

import time

import pytest
import torch

from megascale_omni.metrics.clock import CudaEvents, HostEvents, PhaseClock

pytestmark = pytest.mark.timeout(120)


def test_cuda_events_time_the_queued_work_not_its_launch(target):
    if target.device != "cuda":
        pytest.skip("CUDA events need a CUDA device (on CPU the clock is the host's, tests/unit/test_phase_clock.py)")
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # cuBLAS handle and kernel selection before the timed launches
        x @ x
    torch.cuda.synchronize()
    device, host = PhaseClock(CudaEvents()), PhaseClock(HostEvents())
    t0 = time.perf_counter()
    device.start()
    host.start()
    with device.phase("grad_sync"), host.phase("grad_sync"):
        for _ in range(50):
            x @ x
    device.mark("fwd_bwd")
    host.mark("fwd_bwd")
    on_device = device.read()
    wall = time.perf_counter() - t0
    on_host = host.read()
    print(f"\nhost timer {on_host.phases['grad_sync'] * 1e3:.3f} ms, CUDA events "
          f"{on_device.phases['grad_sync'] * 1e3:.3f} ms, synchronised wall {wall * 1e3:.3f} ms")
    assert on_host.phases["grad_sync"] < on_device.phases["grad_sync"] <= wall
    assert on_device.phases["grad_sync"] <= on_device.spans["fwd_bwd"] <= wall
