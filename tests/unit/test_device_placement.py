"""Micro-batches follow the model to its device (parallel/schedules.py).

The host builds every micro-batch; the schedule hands the model a copy on
the device of its parameters. Checked here with the ``meta`` device, which
any host has: a tensor left behind would stay on ``cpu``.
"""

from __future__ import annotations

import torch

from megascale_omni.parallel.schedules import batch_to, model_device


def test_batch_to_moves_every_nested_tensor_and_keeps_the_rest():
    batch = {"tokens": torch.arange(6).reshape(2, 3), "pair": (torch.ones(2), 3), "list": [torch.zeros(1)],
             "name": "row", "none": None}
    meta = torch.device("meta")
    out = batch_to(batch, meta)
    assert out["tokens"].device == meta and out["tokens"].shape == (2, 3) and out["tokens"].dtype == torch.int64
    assert isinstance(out["pair"], tuple) and out["pair"][0].device == meta and out["pair"][1] == 3
    assert out["list"][0].device == meta
    assert out["name"] == "row" and out["none"] is None
    # The host batch itself is untouched (a step can be retried from it).
    assert batch["tokens"].device.type == "cpu"


def test_model_device_is_where_the_parameters_live():
    assert model_device([torch.nn.Linear(2, 2)]) == torch.device("cpu")
    assert model_device([torch.nn.Linear(2, 2, device="meta")]) == torch.device("meta")
    assert model_device([torch.nn.Identity()]) == torch.device("cpu")
