"""Killing a launched job: its process group and every descendant's."""

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
