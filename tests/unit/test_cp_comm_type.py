"""``parallel.cp_comm_type`` under transformer-engine (no TE needed here).

Claims: our ``allgather`` reaches megatron/TE as ``all_gather`` (TE raises on
our spelling); packed (THD) language-model batches refuse ``allgather`` with
one ConfigError naming the field; ``a2a+p2p`` needs
``parallel.hierarchical_cp_sizes`` with product ``cp`` and it reaches
megatron's ``TransformerConfig``; the groups themselves are checked on gloo
in tests/dist/test_hierarchical_cp.py.
"""

from __future__ import annotations

import pytest

from megascale_omni.config import load_job_config
from megascale_omni.config.errors import ConfigError
from megascale_omni.config.validate import require_cp_seq_length
from megascale_omni.models.specs import te_cp_comm_type
from megascale_omni.parallel.state import ParallelDims

LLAVA = "examples/llava/tiny_cpu.yaml"


@pytest.mark.parametrize("ours,te", [("p2p", "p2p"), ("a2a", "a2a"), ("allgather", "all_gather"),
                                     ("a2a+p2p", "a2a+p2p")])
def test_cp_comm_type_maps_to_transformer_engine_names(ours, te):
    assert te_cp_comm_type(ours) == te


def test_unknown_cp_comm_type_is_a_config_error():
    with pytest.raises(ConfigError, match="parallel.cp_comm_type='ring'"):
        te_cp_comm_type("ring")


def _cfg(*overrides):
    from tests.launcher import REPO

    return load_job_config(["--config", str(REPO / LLAVA), *overrides])


def test_packed_thd_batches_refuse_allgather():
    cfg = _cfg("parallel.cp=2", "parallel.cp_comm_type=allgather")
    with pytest.raises(ConfigError) as err:
        require_cp_seq_length(cfg)
    assert err.value.field == "parallel.cp_comm_type"
    assert "\n" not in str(err.value) and "THD" in str(err.value)
    require_cp_seq_length(_cfg("parallel.cp=2", "parallel.cp_comm_type=a2a"))  # accepted


@pytest.mark.parametrize("sizes,fragment", [(None, "needs hierarchical CP groups"), ("[2,3]", "product"),
                                            ("[4,1]", "both > 1"), ("[2,2,1]", "product")])
def test_a2a_p2p_needs_hierarchical_sizes_with_product_cp(sizes, fragment):
    extra = [] if sizes is None else [f"parallel.hierarchical_cp_sizes={sizes}"]
    with pytest.raises(ConfigError, match="parallel.hierarchical_cp_sizes") as err:
        _cfg("parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", *extra)
    assert fragment in err.value.hint


def test_hierarchical_sizes_only_with_a2a_p2p():
    with pytest.raises(ConfigError, match="applies to parallel.cp_comm_type: a2a\\+p2p"):
        _cfg("parallel.cp=4", "parallel.hierarchical_cp_sizes=[2,2]")


def test_hierarchical_sizes_reach_parallel_dims_and_transformer_config():
    import torch

    from megascale_omni.models.gpt import transformer_config

    cfg = _cfg("parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hierarchical_cp_sizes=[2,2]")
    assert ParallelDims.from_config(cfg.parallel, 8).hierarchical_cp == (2, 2)
    config = transformer_config(cfg.model, cfg.parallel, torch.float32)
    assert config.cp_comm_type == "a2a+p2p" and config.hierarchical_context_parallel_sizes == [2, 2]
    allgather = _cfg("parallel.cp=2", "parallel.cp_comm_type=allgather")
    assert transformer_config(allgather.model, allgather.parallel, torch.float32).cp_comm_type == "all_gather"


def test_a2a_p2p_without_einops_is_a_config_error(monkeypatch):
    """megatron builds hierarchical groups with einops; without it the run
    stops with one line before any group exists, not an ImportError deep in megatron."""
    import importlib.util

    from megascale_omni.parallel import state

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "einops" else real(name, *a))
    monkeypatch.setattr(state.dist, "is_initialized", lambda: True)
    dims = ParallelDims(tp=1, pp=1, cp=4, dp=1, vpp=None, world_size=4, hierarchical_cp=(2, 2))
    with pytest.raises(ConfigError, match=r"megascale-omni\[cp\]. \(einops\)"):
        state.initialize_parallel(dims, seed=0)


def test_dit_takes_allgather_as_all_gather():
    """DiT batches are [s, b], not THD: allgather is allowed and reaches TE renamed."""
    import torch

    from megascale_omni.models.dit.model import dit_transformer_config
    from tests.launcher import REPO

    cfg = load_job_config(["--config", str(REPO / "examples/dit/tiny_cpu.yaml"), "parallel.cp=2",
                           "parallel.cp_comm_type=allgather"])
    assert dit_transformer_config(cfg, torch.float32).cp_comm_type == "all_gather"
