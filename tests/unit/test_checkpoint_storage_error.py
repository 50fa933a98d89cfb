"""A full disk inside ``torch.save`` is still a full disk: torch's zip writer
reports it as a RuntimeError without errno, and
:func:`~megascale_omni.checkpoint.writer.storage_error` recovers the
``OSError`` (ENOSPC) so the ranks abandon the save instead of failing the
job (the chaos run's ``ckpt_enospc`` found it, docs/operations.md)."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from megascale_omni.chaos.capabilities import can_mount_tmpfs
from megascale_omni.checkpoint.writer import storage_error


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs filled to the last byte (needs root and mount)."""
    if not can_mount_tmpfs():
        pytest.skip("mounting a size-limited tmpfs needs root and mount(8)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, bytes(4096)):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _zip_writer_failure(path) -> RuntimeError:
    with pytest.raises(RuntimeError) as raised:
        torch.save({"w": torch.zeros(100_000)}, path)
    return raised.value


def test_torch_save_on_a_full_disk_becomes_enospc(full_disk):
    err = _zip_writer_failure(full_disk / "__0_0.distcp")
    assert not isinstance(err, OSError)  # what the ranks saw before: no errno
    found = storage_error(err, full_disk)
    assert isinstance(found, OSError) and found.errno == errno.ENOSPC, found
    assert found.filename == str(full_disk)
    assert sorted(p.name for p in full_disk.iterdir()) == ["__0_0.distcp", "filler"]  # the probe left nothing


def test_a_zip_writer_failure_on_a_disk_with_space_is_an_io_error(tmp_path):
    err = _zip_writer_failure("/dev/full")  # the real zip writer's failure, on a stream that refuses every write
    found = storage_error(err, tmp_path)
    assert isinstance(found, OSError) and found.errno == errno.EIO
    assert "unexpected pos" in str(found) and found.filename == str(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe removed itself


def test_other_errors_pass_through(tmp_path):
    bug = RuntimeError("size mismatch for weight")
    assert storage_error(bug, tmp_path) is bug
    full = OSError(errno.ENOSPC, "No space left on device")
    assert storage_error(full, tmp_path) is full
    assert storage_error(None, tmp_path) is None
