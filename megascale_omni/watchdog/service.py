"""The watchdog thread: publish this rank's heartbeat, judge, and tear the group down.

Where heartbeats live: the replica group's c10d store (the TCPStore that
torchrun's agent serves to its workers), under ``omni-watchdog/<restart>/``.
Every rank of the group reaches it by construction, across nodes, with no
shared file system; it is served by the agent, not a worker, so a stopped
worker does not take it down; and a key per restart attempt
(``TORCHELASTIC_RESTART_COUNT``) keeps a restarted group from reading the
last attempt's verdict. A file in the run directory would need a file
system shared by all nodes of the group. The watchdog opens its own client
connection, so its store calls never queue behind the training thread's.

Each rank watches the ranks of its node and the first rank of the next
node (a bounded number of store reads per poll, whatever the group size):
a rank that does not run is named by a peer on its own host, which can
kill it, and a whole node that stops is named by the node before it.

On a verdict (this rank's, or one a peer published first):

- the verdict's line is logged (ERROR) by the rank that reached it;
- a live culprit dumps all its threads' stacks to its log
  (``faulthandler.dump_traceback``); the reporter waits for that (at most
  two polls) before it exits;
- a silent culprit on this host is killed (SIGKILL, after checking the pid
  is still that process): torchrun would otherwise wait its 30 s grace for
  a stopped process that ignores SIGTERM;
- a fixed (non-elastic) job saves nothing: a save is collective
  (megatron's dist checkpointing on every rank) and the stuck rank cannot
  take part; a restart resumes from the newest committed checkpoint;
- every rank that sees the verdict exits with ``EXIT_HUNG`` (43); torchrun
  stops the group's other workers and ``omni-run`` exits 43; a requeue (or
  ``torchrun --max-restarts``) restarts a fixed job; an elastic job's other replica groups carry on
  (torchft abandons the step, the next quorum leaves the group out) and the
  scheduler starts a replacement group.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from typing import Callable, Optional, Protocol

from megascale_omni.config import WatchdogConfig
from megascale_omni.errors import EXIT_HUNG
from megascale_omni.watchdog.heartbeat import Beat, Heartbeat
from megascale_omni.watchdog.judge import PeerTracker, Verdict, judge

logger = logging.getLogger(__name__)

VERDICT_KEY = "verdict"
ACK_KEY = "verdict-ack"


class Store(Protocol):
    """What the watchdog needs of a c10d store (``torch.distributed.Store``)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected: str, desired: bytes) -> bytes: ...


def group_store(timeout_s: float) -> Store:
    """A new client of the default process group's TCPStore, under this
    restart attempt's watchdog prefix (every rank; after init_process_group)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    client = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"omni-watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def watched_ranks(rank: int, world_size: int, local_rank: int, local_world_size: int) -> list[int]:
    """The ranks ``rank`` watches: its node's ranks and the first rank of the
    next node (torchrun numbers a node's ranks contiguously), without itself."""
    first = rank - local_rank
    ranks = {r for r in range(first, min(first + local_world_size, world_size))}
    ranks.add((first + local_world_size) % world_size)
    ranks.discard(rank)
    return sorted(ranks)


def _process_start(pid: int) -> float:
    import psutil

    return psutil.Process(pid).create_time()


def kill_if_here(beat: Beat) -> bool:
    """SIGKILL the culprit's process if it runs on this host and is still the
    process that published ``beat``; True if killed."""
    import psutil

    if beat.host != socket.gethostname():
        return False
    try:
        proc = psutil.Process(beat.pid)
        if abs(proc.create_time() - beat.pid_start) > 1e-3:
            return False
        proc.kill()
    except psutil.Error:
        return False
    return True


def _exit_hung() -> None:
    """Flush the logs, end this rank's own child processes (checkpoint
    writers, multiprocessing's resource tracker, data workers: ``os._exit``
    runs no cleanup, and the chaos run found such children living on under
    init), then exit with :data:`EXIT_HUNG`."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    import psutil

    try:
        for child in psutil.Process().children(recursive=True):
            child.kill()
    except psutil.Error:
        pass  # gone already, or not ours to end: exiting matters more
    os._exit(EXIT_HUNG)


class Watchdog:
    """This rank's heartbeat and watchdog thread (every rank; a service the loop calls).

    The loop reports its phases through :attr:`heartbeat` (``enter``,
    ``step_ended``; the phase clock through ``PHASES.listen``), calls
    :meth:`start` when it begins stepping and :meth:`close` when it ends.
    Disabled (``watchdog.enabled=false``): no thread, nothing published.
    ``held``: the job is held on purpose (``omni-ctl pause``), no limit runs.
    ``dist_timeout_s``: the process groups' collective timeout (a warning at
    start when ``collective_timeout_s`` is not below it: a blocked collective
    would raise before the watchdog names the rank).
    ``store``, ``clock``, ``exit``, ``kill``: the real ones unless a test
    passes its own.
    """

    def __init__(self, cfg: WatchdogConfig, rank: int, world_size: int, group: str, elastic: bool,
                 local_rank: int = 0, local_world_size: int = 1, held: Callable[[], bool] = lambda: False,
                 dist_timeout_s: Optional[float] = None,
                 store: Optional[Callable[[], Store]] = None, clock: Callable[[], float] = time.monotonic,
                 exit: Callable[[], None] = _exit_hung, kill: Callable[[Beat], bool] = kill_if_here):
        self.cfg = cfg
        self.enabled = cfg.enabled
        self.rank, self.group, self.elastic = rank, group, elastic
        self.heartbeat = Heartbeat(clock)
        self.peers = watched_ranks(rank, world_size, local_rank, local_world_size) if world_size > 1 else []
        self.tracker = PeerTracker(clock)
        self.held = held
        self.dist_timeout_s = dist_timeout_s
        self._store_factory = store if store is not None else (lambda: group_store(max(cfg.poll_s, 1.0)))
        self._store: Optional[Store] = None
        self._clock, self._exit, self._kill = clock, exit, kill
        self._seq = 0
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._pid_start = _process_start(self._pid)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store_warned = False
        #: Where a stuck rank's stack goes (its log: stderr).
        self.stack_file = sys.stderr

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start watching (every rank, as the loop begins stepping)."""
        if not self.enabled or self._thread is not None:
            return
        self.heartbeat.step_ended(self.heartbeat.read()[0])  # the clocks start now, not at build time
        self._thread = threading.Thread(target=self._run, name="omni-watchdog", daemon=True)
        self._thread.start()
        logger.info("watchdog: watching ranks %s every %g s (limits: step %g s, collective %g s, data %g s, "
                    "heartbeat %g s)", self.peers, self.cfg.poll_s, self.cfg.step_timeout_s,
                    self.cfg.collective_timeout_s, self.cfg.data_wait_timeout_s, self.cfg.heartbeat_timeout_s)
        if self.dist_timeout_s is not None and self.cfg.collective_timeout_s >= self.dist_timeout_s:
            logger.warning("watchdog: watchdog.collective_timeout_s=%g is not below the process groups' timeout "
                           "(%g s, MEGASCALE_DIST_TIMEOUT_S): a blocked collective raises before a stuck rank is "
                           "named; lower it", self.cfg.collective_timeout_s, self.dist_timeout_s)

    def close(self) -> None:
        """Stop watching; tell the peers this rank left the loop (every rank; idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.heartbeat.enter("exited")
        self._publish(self._beat())

    def _run(self) -> None:
        # Published at once: a rank stopped before its first poll is still known to its peers.
        self._publish(self._beat())
        while not self._stop.wait(self.cfg.poll_s):
            verdict = self.check()
            if verdict is not None:
                self.act(verdict)
                return

    # ---------------------------------------------------------------- check
    def _beat(self) -> Beat:
        step, phase, in_phase, since_step = self.heartbeat.read()
        self._seq += 1
        return Beat(self.rank, self.group, self._host, self._pid, self._pid_start, step,
                    "paused" if phase != "exited" and self.held() else phase, in_phase, since_step, self._seq)

    def check(self) -> Optional[Verdict]:
        """One poll (the watchdog thread): publish, read the peers, judge.
        Returns the verdict to act on: a peer's already published one, else this rank's."""
        if self.held():
            self.heartbeat.refresh()
        me = self._beat()
        store = self._publish(me)
        if store is None:
            return judge(me, [], self.cfg)
        try:
            published = self._read(store, VERDICT_KEY)
            if published is not None:
                return Verdict.decode(published)
            self.tracker.update(Beat.decode(b) for b in map(lambda r: self._read(store, f"beat/{r}"), self.peers)
                                if b is not None)
            verdict = judge(me, self.tracker.views(), self.cfg, self.elastic)
            if verdict is None:
                return None
            # The first verdict published is the one everybody acts on.
            return Verdict.decode(store.compare_set(VERDICT_KEY, "", verdict.encode()))
        except Exception as e:  # a store that stopped answering: judge this rank alone
            self._store_failed(e)
            return judge(me, [], self.cfg)

    def _publish(self, beat: Beat) -> Optional[Store]:
        try:
            if self._store is None:
                self._store = self._store_factory()
            self._store.set(f"beat/{self.rank}", beat.encode())
            return self._store
        except Exception as e:
            self._store_failed(e)
            return None

    def _store_failed(self, e: Exception) -> None:
        if not self._store_warned:
            logger.warning("watchdog: the group's store does not answer (%s); judging this rank alone", e)
            self._store_warned = True

    @staticmethod
    def _read(store: Store, key: str) -> Optional[bytes]:
        return store.get(key) if store.check([key]) else None

    # ------------------------------------------------------------------ act
    def act(self, verdict: Verdict) -> None:
        """Log, dump the stack, kill or wait as described in the module docstring, then exit 43."""
        culprit = verdict.culprit
        if verdict.reporter == self.rank:
            logger.error(verdict.line())
        if culprit.rank == self.rank:
            logger.error("watchdog: stack of rank %d (stuck in phase %s at step %d), all threads:",
                         self.rank, culprit.phase, culprit.step)
            for handler in logging.getLogger().handlers:
                handler.flush()
            self.stack_file.flush()
            faulthandler.dump_traceback(file=self.stack_file, all_threads=True)
            self._set(ACK_KEY, b"1")
        elif verdict.silent:
            if self._kill(culprit):
                logger.error("watchdog: killed rank %d (pid %d on this host): it cannot run, and torchrun would "
                             "wait for it", culprit.rank, culprit.pid)
        elif verdict.reporter == self.rank:
            self._wait_for_ack()
        if verdict.reporter == self.rank and not self.elastic:
            logger.error("watchdog: no checkpoint saved: a save needs every rank and rank %d cannot take part; "
                         "a restart resumes from the newest committed checkpoint", culprit.rank)
        logger.error("watchdog: rank %d exits with code %d (replica group %s torn down)", self.rank, EXIT_HUNG,
                     self.group)
        self._exit()

    def _set(self, key: str, value: bytes) -> None:
        try:
            if self._store is not None:
                self._store.set(key, value)
        except Exception as e:
            self._store_failed(e)

    def _wait_for_ack(self) -> None:
        """Give a live culprit two polls to read the verdict and dump its stack."""
        deadline = time.monotonic() + 2 * self.cfg.poll_s + 1.0
        while time.monotonic() < deadline:
            try:
                if self._store is None or self._store.check([ACK_KEY]):
                    return
            except Exception as e:
                self._store_failed(e)
                return
            time.sleep(min(0.1, self.cfg.poll_s))
