"""The one atomic write-and-rename helper and the one process-tree kill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megascale_omni.utils import files
from megascale_omni.utils.files import atomic_open, atomic_write_bytes, atomic_write_json, atomic_write_text, temp_path
from megascale_omni.utils.processes import kill_process_tree


def test_writes_replace_the_target_whole(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    atomic_write_json(target, {"b": 1, "a": [1.5]}, sort_keys=True)
    assert target.read_text() == '{"a": [1.5], "b": 1}'
    atomic_write_text(target, "täxt\n")
    assert target.read_text(encoding="utf-8") == "täxt\n"
    atomic_write_bytes(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(tmp_path)) == ["state.json"]  # no temporary file left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "index.json"
    target.write_text('{"ok": true}')
    with pytest.raises(TypeError):
        atomic_write_json(target, {"bad": object()})
    with pytest.raises(RuntimeError), atomic_open(target, "wb") as f:
        f.write(b"half")
        assert temp_path(target).exists()  # written beside the target, not over it
        raise RuntimeError("writer died")
    assert json.loads(target.read_text()) == {"ok": True}
    assert sorted(os.listdir(tmp_path)) == ["index.json"]
    # The temporary is hidden, per process, and named so payload listings skip it.
    assert temp_path(target).name == f".index.json.tmp-{os.getpid()}"
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(target, "a"):
            pass


def test_durable_writes_fsync_the_file_then_the_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (synced.append(os.path.realpath(f"/proc/self/fd/{fd}")),
                                                       real_fsync(fd)))
    target = tmp_path / "commit.json"
    atomic_write_json(target, {"step": 3}, durable=True)
    assert synced == [str(temp_path(target)), str(tmp_path)]
    synced.clear()
    atomic_write_json(target, {"step": 4})
    assert synced == [] and json.loads(target.read_text()) == {"step": 4}


def test_kill_process_tree_kills_children_in_their_own_sessions():
    # A parent in its own session whose child starts another session (as torchrun's workers do).
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 30
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = psutil.Process(proc.pid).children()
    kill_process_tree(proc)
    assert proc.returncode == -9  # reaped
    child.wait(timeout=10)
    assert not child.is_running()


ADOPTER = """
import os, subprocess, sys, time
import psutil
from megascale_omni.utils.processes import adopt_orphans, end_descendants
assert adopt_orphans()
middle = subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', "
                         "'import time; time.sleep(60)'], start_new_session=True, stdout=subprocess.DEVNULL, "
                         "stderr=subprocess.DEVNULL).pid)"], capture_output=True, text=True)
orphan = psutil.Process(int(middle.stdout))  # its parent has exited
print(orphan.ppid() == os.getpid(), end_descendants(), end=" ")
time.sleep(0.2)
print(not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE)
"""


def test_a_launcher_adopts_what_a_dead_child_left_and_ends_it():
    """omni-run's net (launch.end_leftovers): a grandchild whose parent died
    is re-parented to the subreaper, not init, and ended by end_descendants."""
    out = subprocess.run([sys.executable, "-c", ADOPTER], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.split() == ["True", "1", "True"], out.stderr[-2000:]
