"""Pre-started processes that write a save's files, so no process forks a multi-threaded trainer.

megatron-core 0.16.1 writes an async save's files in
``FileSystemWriterAsync.write_preloaded_data_multiproc``: it forks one
process per write bucket. Run on our writer thread, that forks a process
with several threads (training, writer, control server, data workers),
which Python 3.12 warns about (``DeprecationWarning: This process is
multi-threaded, use of fork() may lead to deadlocks in the child``) and
which is unsafe in general: a lock another thread held at the fork stays
held in the child forever.

Instead the Checkpointer starts :data:`START_METHOD` ("spawn": fork + exec
of a fresh interpreter, which copies no thread's state and warns on no
Python version) writer processes once, on the training thread before its
first async save, and every save hands each of them one write bucket. The
bucket's tensors are the host staging buffers in shared memory
(:mod:`megascale_omni.checkpoint.staging`); pickled through the pipe by
torch's multiprocessing reductions they travel as a file descriptor of the
same pages, so the hand-over copies nothing, as the fork did. The worker runs megatron's own per-bucket writer
(``FileSystemWriterAsync.write_preloaded_data``, unchanged); what megatron's
multiproc wrapper did around it (start the children, collect their results
into the request's results queue) is :meth:`WriteWorkers.write`, rewritten
here because that wrapper forks.

Tensors that are not in shared memory cannot be handed over without a
copy: a synchronous save's live tensors, pinned staging buffers (CUDA:
page-locked, which torch cannot place in shared memory) and private ones
(``/dev/shm`` too small). Those buckets are written in this process, by the
writer thread (one thread per bucket, megatron's same per-bucket writer):
nothing forks either way. In-process writes share the GIL with training
while they serialise; the hand-over to the processes is the path without
that cost, used whenever the buffers allow it. On CUDA hosts the staging
buffers are pinned, so async saves take the in-process path there; making
them shared and pinned (``cudaHostRegister`` on shared pages) would give
GPU jobs the hand-over too (not done: no GPU to test it on).

Every process a save starts dies with its rank. megatron-core 0.16.1 also
keeps its write results in ``filesystem_async._results_queue``, a
``multiprocessing.Manager().Queue()``: a *spawned manager server process*
per rank, started at the first save, which watches nothing. A SIGKILLed
rank (the chaos run's ``kill_rank``, a hung rank its peer's watchdog kills)
left that process under init, and with it multiprocessing's resource
tracker, whose pipe it holds open: torchrun signals only the process groups
of workers still alive. Results here are put by this process's writer
thread and read by its training thread, so :func:`use_in_process_results_queue`
gives megatron a ``queue.Queue`` instead, and no manager process exists.
The writer processes end with their rank (:func:`_die_with`), and the
resource tracker ends once they and the rank are gone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch.multiprocessing as torch_mp
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies import filesystem_async as _fs_async
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

logger = logging.getLogger(__name__)

#: How the writer processes start: never a fork of the (multi-threaded) trainer.
START_METHOD = "spawn"
#: Linux ``prctl`` option: the signal the kernel sends this process when its parent dies.
_PR_SET_PDEATHSIG = 1
#: Linux ``prctl`` option: the process's name (``/proc/PID/comm``, what ps and psutil show).
_PR_SET_NAME = 15
#: The writer processes' name, so a process listing tells them from other spawned helpers (data workers).
PROCESS_NAME = b"ckpt-write"
#: Seconds between checks of the parent in the watch thread (where prctl is unavailable).
PARENT_POLL_S = 0.5
#: megatron's multiproc writer, the ``async_fn`` this module replaces.
_MULTIPROC = FileSystemWriterAsync.write_preloaded_data_multiproc


def use_in_process_results_queue() -> None:
    """Make megatron's async-save results queue an in-process ``queue.Queue``
    (idempotent; every rank that saves asynchronously, before its first
    save). Why: see the module docstring. Safe because every ``put`` (from
    :meth:`WriteWorkers.write`) and ``get`` (megatron's
    ``retrieve_write_results`` in the finalisers) happens in this process;
    megatron's own cross-process user of the queue,
    ``write_preloaded_data_multiproc``, is the function this module replaces."""
    if not isinstance(_fs_async._results_queue, queue.Queue):
        _fs_async._results_queue = queue.Queue()


def _write_bucket(transform_list: list, index: int, bucket: Any, use_msc: bool) -> tuple[int, Any]:
    """megatron's writer for one bucket (fsync on); returns (index, write results or the exception)."""
    # It reports through two queues; in-process ones suffice (no thread, no child).
    results: queue.Queue = queue.Queue()
    count: queue.Queue = queue.Queue()
    count.put(index)
    FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, results, count, True,
                                               **({"use_msc": True} if use_msc else {}))
    return results.get()


def _die_with(parent: int) -> None:
    """Make this writer process end when ``parent`` (the rank that started it) dies.

    A SIGKILLed rank runs no cleanup: its writer is re-parented to init
    and can live on (the chaos soak found such writers, see
    docs/operations.md), holding its shared-memory buffers and, through its
    fd, multiprocessing's resource tracker, which ends once the writer does. On Linux the kernel kills us
    with the parent (``PR_SET_PDEATHSIG``, immediate even inside a write);
    the parent may already have died before the call, hence the check
    right after it. Elsewhere a daemon thread polls the parent pid.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(PROCESS_NAME), 0, 0, 0)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # died between our start and the prctl
                os._exit(0)
            return

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="ckpt-write-parent-watch", daemon=True).start()


def _serve(conn: Connection, parent: int) -> None:
    """A writer process's loop: one bucket in, its write results (or the exception) out.
    Ends with ``parent`` (see :func:`_die_with`)."""
    _die_with(parent)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the trainer is gone (killed): nothing left to write for
            return
        if job is None:
            return
        output = _write_bucket(*job)
        del job  # drop this process's references to the shared buffers before reporting
        conn.send(output)


class WriteWorkers:
    """Writes megatron's write buckets without forking: ``count`` writer
    processes, once :meth:`start`-ed (the training thread, before the first
    async save), take buckets whose tensors are in shared memory; other
    buckets are written in this process. :meth:`write` is called from the
    writer thread, one request at a time."""

    def __init__(self, count: int):
        use_in_process_results_queue()
        self.count = count
        self.start_method = START_METHOD
        self._workers: list[tuple[Any, Connection]] = []
        #: Requests written by the processes and in this process (for logs and tests).
        self.handed_over = self.in_process = 0

    def start(self) -> None:
        """Start the processes (idempotent). Not at construction: a run that
        never saves asynchronously pays for no interpreter start. Call it
        from a thread that lives as long as the processes (the training
        thread): Linux delivers the parent-death signal when the starting
        thread ends."""
        if self._workers or not self.count:
            return
        ctx = torch_mp.get_context(START_METHOD)
        for i in range(self.count):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, os.getpid()), name=f"ckpt-write-{i}", daemon=True)
            proc.start()
            theirs.close()
            self._workers.append((proc, ours))

    @staticmethod
    def handles(request: AsyncRequest) -> bool:
        """Whether ``request`` writes through megatron's multiproc writer (the one replaced here)."""
        return getattr(request.async_fn, "func", None) is _MULTIPROC

    def why_in_process(self, request: AsyncRequest) -> Optional[str]:
        """None when the processes can take ``request``'s buckets; otherwise why they cannot."""
        _, buckets, _ = request.async_fn_args
        if not self._workers:
            return "no writer process was started"
        if len(buckets) > len(self._workers):
            return f"{len(buckets)} write buckets for {len(self._workers)} writer processes"
        for _, _, (_, tensors) in buckets:
            for _, tensor in tensors:
                if not tensor.is_shared():
                    return f"its tensors are {'pinned' if tensor.is_pinned() else 'private'} memory, not shared"
        return None

    def write(self, request: AsyncRequest) -> Optional[BaseException]:
        """Write ``request``'s buckets and put the results where megatron's
        finalisation reads them (its results queue), as
        ``write_preloaded_data_multiproc`` does. Blocks until every bucket is
        written; returns the error of a bucket that failed (e.g. an
        ``OSError`` ENOSPC), or None."""
        transform_list, use_msc = request.async_fn.args
        _, buckets, results_queue = request.async_fn_args
        jobs = [(transform_list, index, bucket, use_msc) for index, bucket in enumerate(buckets)]
        reason = self.why_in_process(request)
        if reason is None:
            self.handed_over += 1
            for (_, conn), job in zip(self._workers, jobs):
                conn.send(job)
            outputs = [conn.recv() for _, conn in self._workers[:len(jobs)]]
        else:
            self.in_process += 1
            logger.debug("checkpoint: writing in this process: %s", reason)
            with ThreadPoolExecutor(max_workers=max(1, len(jobs)), thread_name_prefix="ckpt-bucket") as pool:
                outputs = list(pool.map(lambda job: _write_bucket(*job), jobs))
        outcome: Any = {}
        for index, result in outputs:
            if isinstance(result, Exception):
                logger.error("checkpoint: writing bucket %d failed: %s", index, result)
                outcome = result
            elif not isinstance(outcome, Exception):
                outcome[index] = result
        results_queue.put(outcome)
        return outcome if isinstance(outcome, BaseException) else None

    @staticmethod
    def discard_results(request: AsyncRequest) -> None:
        """Empty the results queue of a written ``request`` whose save is
        abandoned: megatron reuses it (its writer is cached with the save
        plan), so the next save's finalisation would read this one's outcome."""
        _, _, results_queue = request.async_fn_args
        while True:
            try:
                results_queue.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        """Stop the processes (after the last write)."""
        for proc, conn in self._workers:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass  # already gone
            conn.close()
        for proc, _ in self._workers:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._workers = []
