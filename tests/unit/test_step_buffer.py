"""A step's micro-batches packed into one buffer come back identical: values,
dtypes, shapes, key order and non-tensor values; every tensor is a view of
the one buffer, aligned."""

from __future__ import annotations

import pickle

import torch

from megascale_omni.data.step_buffer import ALIGN, pack_step, unpack_step


def _step() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "tokens": torch.randint(0, 1000, (2, 256), generator=g),
            "loss_mask": torch.rand(2, 256, generator=g) > 0.5,
            "cu_seqlens": torch.tensor([0, 7, 100, 256, 300, 512], dtype=torch.int32),
            "images": torch.randn(3, 3, 8, 8, generator=g),
            "note": "kept as is",
        },
        {
            "images": torch.empty(0, 3, 8, 8),
            "count": 3,
            "half": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "byte": torch.tensor([1, 2, 3], dtype=torch.uint8),
        },
    ]


def test_round_trip_is_identical_and_keeps_key_order():
    step = _step()
    back = unpack_step(pickle.loads(pickle.dumps(pack_step(step))))
    assert [list(b) for b in back] == [list(b) for b in step]
    for original, restored in zip(step, back):
        for key, value in original.items():
            if isinstance(value, torch.Tensor):
                assert restored[key].dtype == value.dtype and restored[key].shape == value.shape, key
                assert torch.equal(restored[key], value), key
            else:
                assert restored[key] == value


def test_every_tensor_is_an_aligned_view_of_one_buffer():
    packed = pack_step(_step())
    back = unpack_step(packed)
    base = packed.buffer.untyped_storage().data_ptr()
    tensors = [v for b in back for v in b.values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 7
    for t in tensors:
        assert t.untyped_storage().data_ptr() == base
        assert (t.data_ptr() - base) % ALIGN == 0
    # Nothing overlaps: writing one view leaves the others as they were.
    back[0]["tokens"].zero_()
    assert torch.equal(back[0]["cu_seqlens"], _step()[0]["cu_seqlens"])
    assert torch.equal(back[1]["half"], _step()[1]["half"])
