"""A replica group rides out a restart of the torchft lighthouse in one
process (docs/elastic.md, "Lighthouse restarts"); the same on real processes
with two groups, a heal and the loss and ledger checks:
tests/dist/test_elastic_lighthouse.py."""

from __future__ import annotations

import threading
import time

from megascale_omni.config import ElasticConfig
from megascale_omni.elastic.membership import LIGHTHOUSE_RETRY_S, ReplicaQuorum, quorum_retries
from tests.dist.elastic_helpers import start_lighthouse
from tests.launcher import kill_group
from tests.unit.replica_group import one_rank_group


def test_quorum_retries_ask_about_every_second_for_the_quorum_timeout():
    # torchft 0.2.0 sleeps timeout / (retries + 1) between requests to an unreachable lighthouse.
    for timeout_s in (1.0, 30.0, 1200.0):
        retries = quorum_retries(timeout_s)
        assert retries >= 1 and timeout_s / (retries + 1) <= LIGHTHOUSE_RETRY_S


def test_a_replica_group_rides_out_a_lighthouse_restart_on_the_same_port():
    """The lighthouse process is SIGKILLed between two steps and restarted
    on its port 2 s later: the next quorum request waits (torchft's manager
    server asks again about every second, ``membership.quorum_retries``) and
    is answered by the new lighthouse, whose quorum ids start over; nothing
    raises, the step commits."""
    with one_rank_group():
        first, address = start_lighthouse(timeout=120)
        cfg = ElasticConfig(enabled=True, lighthouse=address, replica_id="r0", timeout_s=20, quorum_timeout_s=30)
        quorum = ReplicaQuorum(cfg, state_dict=lambda: {"w": 7}, load_state_dict=lambda state: None)
        second = []
        try:
            for _ in range(3):
                quorum.begin_step()
                assert quorum.should_commit()
            kill_group(first)
            first.wait()
            killed = time.monotonic(), time.time()
            port = int(address.rsplit(":", 1)[1])
            restart = threading.Timer(2.0, lambda: second.append(start_lighthouse(timeout=120, port=port)[0]))
            restart.start()
            part = quorum.begin_step()
            assert part.participating and part.size == 1
            assert part.quorum_t >= killed[1] + 2.0  # answered by the restarted lighthouse
            assert part.quorum_id == 1  # numbered from the start again: readers need the epoch
            assert quorum.should_commit() and quorum.current_step() == 4
            print(f"quorum after the kill in {time.monotonic() - killed[0]:.1f} s (lighthouse down 2 s)")
        finally:
            quorum.leave()
            restart.join()
            for proc in [first, *second]:
                kill_group(proc)
