"""Killing a launched job: its process group and every descendant's; a
launcher that adopts and ends what its dead workers left behind."""

from __future__ import annotations

import os
import signal
import subprocess


def kill_process_tree(proc: subprocess.Popen, reap: bool = True) -> None:
    """SIGKILL ``proc``'s process group and every descendant's group, then
    reap ``proc`` (``reap=False``: leave the wait to the caller).

    torchrun (torch >= 2.x) starts each worker in a session of its own, so
    killing the launcher's group alone would leave the workers running;
    descendants are listed before anything is killed, while they still have
    a parent to be found through.
    """
    import psutil  # only launchers need it

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for pid in [proc.pid, *(d.pid for d in descendants)]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already, or not a group leader we may signal
    for d in descendants:
        try:
            d.kill()
        except psutil.NoSuchProcess:
            pass
    if reap:
        proc.wait()


#: Linux ``prctl`` option: orphaned descendants are re-parented to this process instead of init.
_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> bool:
    """Make this process the child subreaper of its descendants (Linux;
    False elsewhere or if refused): a descendant whose parent dies is
    re-parented here, not to init, so it stays findable through this
    process (:func:`end_descendants`). Call it before starting children."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def end_descendants() -> int:
    """SIGKILL every live descendant of this process and its process group,
    then reap this process's exited children; returns how many were alive.
    For a launcher whose workers are done: what is left is a leftover of a
    worker that died without cleanup (its children re-parented here by
    :func:`adopt_orphans`)."""
    import psutil

    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            continue  # exited since it was listed
    for p in left:
        for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), p.kill):
            try:
                kill()
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass  # not a group leader, or gone already
    while True:  # adopted children are ours to reap
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    return len(left)
