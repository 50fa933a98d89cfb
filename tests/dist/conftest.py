"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import pytest

from megascale_omni.demo.llava_shapes import make_shapes_dataset


@pytest.fixture(scope="session")
def llava_dataset(tmp_path_factory):
    """A small shapes dataset (600 train / 40 val samples, 32 px) built once per session."""
    root = tmp_path_factory.mktemp("shapes")
    make_shapes_dataset(root / "d", num_train=600, num_val=40, seed=7, image_size=32, samples_per_shard=200)
    return root / "d"
