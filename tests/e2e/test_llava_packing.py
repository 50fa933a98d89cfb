"""Packing efficiency on the embedded shapes data, beside padding to the max."""

from __future__ import annotations

import numpy as np

from megascale_omni.data.llava.batches import LlavaEncoder
from megascale_omni.data.packing import pack_samples, packing_efficiency, pad_to_max_efficiency
from megascale_omni.demo.llava_shapes import load_shapes_tokenizer, make_shapes_dataset, open_shapes_split


def test_packing_efficiency_on_default_data(tmp_path):
    root = tmp_path / "shapes"
    make_shapes_dataset(root, num_train=4000, num_val=20, seed=1234, image_size=32, samples_per_shard=1000)
    reader = open_shapes_split(root, "train")
    encoder = LlavaEncoder(load_shapes_tokenizer(root), tokens_per_image=16)
    lengths = np.array([encoder.length_from_metadata(reader.read_metadata(i)) for i in range(len(reader))])
    packs = pack_samples(lengths, seq_length=256)
    packed, padded = packing_efficiency(packs, 256), pad_to_max_efficiency(lengths)
    assert packed >= 0.95, packed
    assert padded < 0.7, padded  # why packing matters on this data
    assert sorted(i for p in packs for i in p.sample_ids) == list(range(4000))
