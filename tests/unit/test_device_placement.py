"""Tensors stay on the device of the data they are built from, and the
per-layer attention path never makes the host wait for the device.

* Micro-batches follow the model to its device (parallel/schedules.py): the
  host builds every micro-batch; the schedule hands the model a copy on the
  device of its parameters. Checked with the ``meta`` device, which any host
  has: a tensor left behind would stay on ``cpu``.
* The context-parallel split (parallel/context.py) runs on the micro-batch
  after it moved to the GPU. Checked with the inputs on ``cpu`` standing for
  the GPU and ``meta`` as the default device: a tensor built without
  ``device=`` lands on ``meta``, and mixing it with an input raises or shows
  in the output's device.
* Ring attention's forward (models/ring_attention.py) is checked for the ops
  that read a device value back to the host (``.item()``, ``nonzero``,
  boolean-mask indexing), each a stall of the host's kernel queue per layer.
* THD micro-batches (models/attention.py) read their segment boundaries to
  the host once, when ``PackedSeqParams`` is built; the local core attention
  then runs with every tensor on ``meta`` (nothing to read back per layer).
* A step's loss reports (parallel/schedules.py) reach the host in one copy,
  counted with the reports on ``meta``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megascale_omni.models.attention import PackedCoreAttention, cp_shard_batch, packed_seq_params, thd_inputs
from megascale_omni.models.ring_attention import ring_attention
from megascale_omni.parallel.context import cp_token_index, local_segments, pad_segments
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


def _thd_batch() -> dict:
    rows, s = 2, 8
    return {
        "tokens": torch.arange(rows * s).view(rows, s),
        "labels": torch.arange(rows * s).view(rows, s) + 100,
        "loss_mask": torch.ones(rows, s),
        "position_ids": torch.arange(s).repeat(rows, 1),
        "cu_seqlens": torch.tensor([0, 4, 8, 16], dtype=torch.int32),
    }


def test_the_cp_split_is_built_on_the_device_of_the_micro_batch():
    cpu = torch.device("cpu")
    cu = torch.tensor([0, 5, 6, 15])
    want_pad = pad_segments(cu, 4)
    want_index = cp_token_index(want_pad.cu_seqlens_padded, 2, 1)
    want_local = cp_shard_batch(_thd_batch(), 2, 1)
    batch = _thd_batch()
    with torch.device("meta"):  # where anything built without device= goes
        padded = pad_segments(cu, 4)
        index = cp_token_index(padded.cu_seqlens_padded, 2, 1)
        local = cp_shard_batch(batch, 2, 1)
        packed = thd_inputs(local, cp_size=2).packed_seq_params
    assert all(x.device == cpu for x in padded) and padded.position.tolist() == want_pad.position.tolist()
    assert index.device == cpu and index.tolist() == want_index.tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]
    assert local["cp_index"].device == cpu and local["cp_index"].tolist() == want_local["cp_index"].tolist()
    assert local["tokens"].tolist() == want_local["tokens"].tolist() == [[1, 2, 5, 6, 10, 11, 12, 13]]
    assert packed.cu_seqlens_q.device == cpu


class _HostReads(TorchDispatchMode):
    """Records the ops that make the host wait for a device value."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default)
    INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default)

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.seen.append(str(func))
        elif func in self.INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.seen.append(f"{func} with a boolean mask")
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def one_rank():
    """megatron's TP1/PP1/CP1 state in this process (a gloo world of one)."""
    from megascale_omni.models.standalone import one_process

    with one_process(seed=0):
        yield dist.group.WORLD


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_forward_reads_nothing_back_from_the_device(one_rank, causal):
    # Padded segments (real 5, 1, 9 tokens), so the padding mask is applied.
    segments = local_segments(torch.tensor([0, 5, 6, 15]), torch.tensor([0, 6, 8, 18]), 1)
    q, k, v = (torch.randn(1, heads, 18, 8) for heads in (4, 2, 2))
    with _HostReads() as reads:
        out = ring_attention(q, k, v, segments, causal=causal, scale=0.3, group=one_rank)
    assert reads.seen == []
    assert out.shape == q.shape and out[0, :, 5].abs().max() == 0 and out[0, :, 4].abs().max() > 0


class _HostCopies(TorchDispatchMode):
    """Counts copies from the stand-in device (``meta``) to the host; each
    would be a wait for the GPU. Returns zeros for them (meta holds no data)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].is_meta and kwargs.get("device") == torch.device("cpu"):
            self.count += 1
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        return func(*args, **kwargs)


def test_step_reports_reach_the_host_in_one_copy(one_rank):
    from megascale_omni.parallel import schedules

    reports = [{schedules.LOSS_KEY: torch.ones(2, device="meta"), "accuracy": torch.ones(2, device="meta")}
               for _ in range(8)]
    with _HostCopies() as copies:
        totals = schedules.reduce_reports(reports)
    assert copies.count == 1
    assert sorted(totals) == ["accuracy", schedules.LOSS_KEY] and all(v.device.type == "cpu" for v in totals.values())
    # The numbers, on the host.
    host = [{k: torch.tensor([2.0, 3.0]) for k in r} for r in reports]
    assert schedules.reduce_reports(host)[schedules.LOSS_KEY].tolist() == [16.0, 24.0]


def test_thd_inputs_read_the_boundaries_once(monkeypatch):
    lists = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: lists.append(self.shape) or tolist(self))
    with _HostReads() as reads:
        packed = thd_inputs(_thd_batch()).packed_seq_params
    assert reads.seen == [] and len(lists) == 1
    assert packed.host_cu_seqlens == (0, 4, 8, 16) and packed.max_seqlen_q == 8


@pytest.mark.parametrize("ring", [False, True])
def test_local_core_attention_takes_segments_from_the_host_copy(one_rank, ring):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, hidden_dropout=0.0)
    attn = PackedCoreAttention(config, 1, AttnMaskType.causal, "self")
    attn.force_ring = ring  # ring attention over a CP group of one
    cu = packed_seq_params(torch.tensor([0, 4, 6, 12]), with_padded=ring)
    meta_cu = cu.cu_seqlens_q.to("meta")
    params = dataclasses.replace(cu, cu_seqlens_q=meta_cu, cu_seqlens_kv=meta_cu,
                                 **({"cu_seqlens_q_padded": meta_cu, "cu_seqlens_kv_padded": meta_cu} if ring else {}))
    q, k, v = (torch.randn(12, heads, 8, device="meta") for heads in (4, 2, 2))
    out = attn(q, k, v, None, packed_seq_params=params)  # a read of meta_cu would raise
    assert out.shape == (12, 32) and out.is_meta
