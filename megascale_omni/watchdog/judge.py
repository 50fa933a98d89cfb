"""Who is stuck: pure decisions over heartbeats (no threads, no store, no clock of its own).

Each rank's watchdog judges itself and the peers it watches, from their
published :class:`~megascale_omni.watchdog.heartbeat.Beat` and how long
each peer has been silent (its ``seq`` unchanged, timed on the judge's own
clock by :class:`PeerTracker`). The rules, first match wins:

1. **A silent peer** (its watchdog thread has not published for longer
   than its phase's limit, at most ``collective_timeout_s`` and at most
   ``heartbeat_timeout_s``) does not run: SIGSTOP, a machine that froze, a
   C call holding the GIL. Every other rank waits for it at its next
   collective, so it is named by the peers, without waiting out the
   collective limit.
2. **This rank over its phase's limit** (``data_wait_timeout_s`` in
   ``data-wait``, ``collective_timeout_s`` in a collective) or over
   ``step_timeout_s`` since a step last ended. A rank waiting in a
   collective while a watched peer is silent for over two polls, or not in
   a collective (computing, reading data, saving), is held up by that peer:
   the peer is named, with the wait. When
   every watched rank waits in a collective, the collective itself (or a
   rank nobody here watches) is stuck, and this rank names itself; in an
   elastic job such a group waits on another replica group, which
   torchft's timeouts settle (the step is abandoned and retried without
   it), so only ``step_timeout_s`` applies.

A live culprit is judged by the same limits by itself, so several ranks may
reach the same verdict; the first one published in the store is the one
acted on (see :mod:`.service`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional, Sequence

from megascale_omni.config import WatchdogConfig
from megascale_omni.watchdog.heartbeat import PHASE_LIMIT, UNLIMITED, WAITING, Beat


@dataclass(frozen=True)
class Verdict:
    """A stuck rank, as named by ``reporter``."""

    culprit: Beat
    #: Seconds counted against the limit: the culprit's time in its phase,
    #: since its last step, since it was last heard from (silent), or the
    #: reporter's wait on it.
    stuck_s: float
    limit_s: float
    #: The setting that set the limit, e.g. ``watchdog.collective_timeout_s``.
    setting: str
    #: Its process does not run (its heartbeat stopped).
    silent: bool
    #: Rank that reached the verdict.
    reporter: int
    #: What was seen, e.g. ``rank 0 waits on it in grad-sync``.
    detail: str = ""

    def line(self) -> str:
        """The one log line: ``watchdog: rank 3 (replica group r1, host h) stuck in
        phase cross-replica-allreduce at step 17 for 12.0 s (limit 10 s;
        watchdog.collective_timeout_s)`` and what was seen."""
        c = self.culprit
        text = (f"watchdog: {c.who()} stuck in phase {c.phase} at step {c.step} for {self.stuck_s:.1f} s "
                f"(limit {self.limit_s:g} s; {self.setting})")
        return f"{text}: {self.detail}" if self.detail else text

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Verdict":
        fields = json.loads(data)
        return cls(**{**fields, "culprit": Beat(**fields["culprit"])})


class PeerTracker:
    """How long each watched peer has been silent, on this rank's clock
    (seconds since its ``seq`` last changed, as first observed here)."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        #: rank -> (last beat, local time its seq changed).
        self._seen: dict[int, tuple[Beat, float]] = {}

    def update(self, beats: Iterable[Beat]) -> None:
        now = self._clock()
        for beat in beats:
            old = self._seen.get(beat.rank)
            if old is None or old[0].seq != beat.seq:
                self._seen[beat.rank] = (beat, now)

    def views(self) -> list[tuple[Beat, float]]:
        """``(last beat, seconds silent)`` of every peer heard from so far, by rank."""
        now = self._clock()
        return [(beat, now - changed) for _, (beat, changed) in sorted(self._seen.items())]


def limit_of(phase: str, cfg: WatchdogConfig) -> tuple[float, str]:
    """``(seconds, setting name)`` a rank may stay in ``phase`` (``inf`` if unlimited)."""
    if phase in UNLIMITED:
        return math.inf, ""
    name = PHASE_LIMIT.get(phase, "step_timeout_s")
    return getattr(cfg, name), f"watchdog.{name}"


def judge(me: Beat, peers: Sequence[tuple[Beat, float]], cfg: WatchdogConfig,
          elastic: bool = False) -> Optional[Verdict]:
    """The stuck rank among this rank (``me``, just read) and its watched
    ``peers`` (``(beat, seconds silent)``), or None (see the module docstring).
    ``elastic``: replica groups on torchft, whose waits on each other torchft bounds."""
    for beat, silent_s in peers:
        if beat.phase == "exited":
            continue
        limit, setting = min(limit_of(beat.phase, cfg), (cfg.collective_timeout_s, "watchdog.collective_timeout_s"),
                             (cfg.heartbeat_timeout_s, "watchdog.heartbeat_timeout_s"))
        if silent_s > limit:
            return Verdict(beat, silent_s, limit, setting, silent=True, reporter=me.rank,
                           detail=f"its heartbeat stopped {silent_s:.1f} s ago: the process does not run "
                                  f"(stopped, or a call holding the interpreter); rank {me.rank} reports it")
    over = _over_limit(me, cfg)
    if over is None:
        return None
    stuck_s, limit, setting = over
    if me.phase in WAITING:
        # A peer silent for over two polls holds this rank up whatever its
        # last phase (its silence is seen up to a poll late, this wait is not).
        silent = [b for b, silent_s in peers if b.phase != "exited" and silent_s > 2 * cfg.poll_s]
        if silent:
            return Verdict(silent[0], stuck_s, limit, setting, silent=True, reporter=me.rank,
                           detail=f"rank {me.rank} waits on it in {me.phase}; its heartbeat stopped: the process "
                                  "does not run (stopped, or a call holding the interpreter)")
        holders = [b for b, _ in peers if b.phase not in WAITING and b.phase not in UNLIMITED]
        if holders:
            holder = min(holders, key=lambda b: (b.step, b.rank))
            return Verdict(holder, stuck_s, limit, setting, silent=False, reporter=me.rank,
                           detail=f"rank {me.rank} waits on it in {me.phase}")
        if elastic and setting == "watchdog.collective_timeout_s":
            # The whole group waits on another replica group (the cross-replica
            # sums, one wait per bucket); torchft abandons that step itself.
            if me.since_step_s <= cfg.step_timeout_s:
                return None
            stuck_s, limit, setting = me.since_step_s, cfg.step_timeout_s, "watchdog.step_timeout_s"
        return Verdict(me, stuck_s, limit, setting, silent=False, reporter=me.rank,
                       detail="every watched rank waits in a collective (a stuck collective, or a rank "
                              "outside this watch holds it)")
    return Verdict(me, stuck_s, limit, setting, silent=False, reporter=me.rank)


def _over_limit(me: Beat, cfg: WatchdogConfig) -> Optional[tuple[float, float, str]]:
    """``(seconds, limit, setting)`` of the first limit ``me`` is over, else None."""
    limit, setting = limit_of(me.phase, cfg)
    if me.in_phase_s > limit:
        return me.in_phase_s, limit, setting
    if me.phase not in UNLIMITED and me.since_step_s > cfg.step_timeout_s:
        return me.since_step_s, cfg.step_timeout_s, "watchdog.step_timeout_s"
    return None
