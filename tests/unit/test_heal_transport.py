"""elastic.heal_transport: a peer state crosses each transport intact, and a
joiner whose transport differs from its peer's gets one config error
instead of a transfer that never comes. Sender and receiver are two threads
of this process (torchft's gloo process group on a local store)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megascale_omni.config import ConfigError
from megascale_omni.elastic.adapter import process_group_for
from megascale_omni.elastic.heal import checkpoint_transport
from tests.launcher import free_port

TIMEOUT = timedelta(seconds=60)
CPU = torch.device("cpu")


def _peer_state() -> dict:
    weights = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "user": {"default": {
            "model": {"w": weights, "w_t": weights.t(), "b": torch.tensor([1, 2, 3], dtype=torch.int64),
                      "h": torch.full((5,), 0.5, dtype=torch.bfloat16)},
            "step": 7, "layout": {"tp": 1, "pp": 2}, "betas": (0.9, 0.95),
        }},
        "torchft": {"step": 7, "batches_committed": 14},
    }


def _transfer(kind: str, state: dict, step: int):
    """Send ``state`` from rank 0 to rank 1 through ``kind`` (two threads, a
    2-rank torchft gloo group on a local store); returns (the receiver's
    transport, what it received, torchft's transport class name)."""
    port = free_port()
    _store = dist.TCPStore("localhost", port, is_master=True, wait_for_workers=False)  # alive while the groups connect
    pgs = [process_group_for(torch.device("cpu"), TIMEOUT) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: pgs[r].configure(f"localhost:{port}/heal", "0", r, 2), range(2)))
    sender, receiver = (checkpoint_transport(kind, pg, CPU, TIMEOUT) for pg in pgs)
    try:
        with ThreadPoolExecutor(2) as pool:
            sent = pool.submit(sender.send_checkpoint, [1], step, state, TIMEOUT)
            got = pool.submit(receiver.recv_checkpoint, 0, sender.metadata(), step, TIMEOUT).result()
            sent.result()
    finally:
        for t in (sender, receiver):
            t.shutdown(wait=False)
    return receiver, got, sender.name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, name", [("http", "HTTPTransport"), ("pg", "PGTransport")])
def test_peer_state_crosses_the_transport_intact(kind, name):
    state = _peer_state()
    receiver, got, used = _transfer(kind, state, step=7)
    assert used == name
    mine, theirs = state["user"]["default"], got["user"]["default"]
    for key, tensor in mine["model"].items():
        assert theirs["model"][key].dtype == tensor.dtype and torch.equal(theirs["model"][key], tensor), key
        # Received into buffers of its own: the joiner's weights are not touched before the commit.
        assert theirs["model"][key].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert {k: theirs[k] for k in ("step", "layout", "betas")} == {k: mine[k] for k in ("step", "layout", "betas")}
    assert got["torchft"] == state["torchft"] and receiver.mismatch is None


@pytest.mark.parametrize("joiner, peer", [("pg", "http"), ("http", "pg")])
def test_joiner_with_the_other_transport_gets_one_config_error(joiner, peer):
    peer_meta = {"http": "http|http://host:1/checkpoint/", "pg": "pg|<n/a>"}[peer]
    transport = checkpoint_transport(joiner, None, CPU, TIMEOUT)
    try:
        with pytest.raises(ConfigError) as err:
            transport.recv_checkpoint(0, peer_meta, 7, TIMEOUT)
    finally:
        transport.shutdown(wait=False)
    assert transport.mismatch is err.value and err.value.field == "elastic.heal_transport"
    assert f"elastic.heal_transport={joiner!r}: differs from the running job's ({peer})" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["http", "pg"])
def test_views_of_one_storage_cross_once_and_stay_views(kind):
    """Parameters that are views of one buffer (the distributed optimizer's
    ``param_data``) arrive as views of one buffer of the same size, not as
    one copy of the whole buffer per view."""
    buffer = torch.arange(96, dtype=torch.float32)
    state = {"user": {"w1": buffer[:48].view(6, 8), "w2": buffer[48:].view(8, 6), "main": buffer[60:72]},
             "torchft": {"step": 3}}
    _, got, _ = _transfer(kind, state, step=3)
    received = got["user"]
    for key, tensor in state["user"].items():
        assert torch.equal(received[key], tensor), key
    storages = {received[key].untyped_storage().data_ptr() for key in received}
    assert len(storages) == 1 and received["w1"].untyped_storage().nbytes() == buffer.nbytes
