"""A single-host Slurm for tests (tools/slurm_local.py): one per test session.

``slurm_cluster`` installs Slurm when it is missing (apt, as root), starts
munge, slurmctld and slurmd under a temporary directory, yields the
:class:`Cluster` (its ``env`` holds ``SLURM_CONF`` for ``srun``, ``squeue``,
``scancel``) and stops them at the end. Where Slurm cannot be installed or
started, the tests that use it are skipped with the reason. Import the
fixture into a test module: ``from tests.slurm_fixture import slurm_cluster  # noqa: F401``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

from tests.launcher import REPO


def _tool():
    spec = importlib.util.spec_from_file_location("slurm_local", REPO / "tools" / "slurm_local.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["slurm_local"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


slurm_local = _tool()


@pytest.fixture(scope="session")
def slurm_cluster():
    # Short path: the munge socket's path must fit a sockaddr_un (108 bytes).
    directory = Path(tempfile.mkdtemp(prefix="omni-slurm-"))
    try:
        cluster = slurm_local.up(str(directory))
    except (slurm_local.SlurmUnavailable, OSError) as e:
        slurm_local.down(str(directory))
        pytest.skip(f"no single-host Slurm here: {e}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)  # srun, squeue and scancel started by the code under test
    try:
        yield cluster
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        slurm_local.down(str(directory))
