"""Heal transport: state transfer and join latency, HTTP vs process group.

    .venv/bin/python benchmarks/heal_transport.py [--gib 1] [--rounds 3] [--quick]

Both ``elastic.heal_transport`` values side by side, on the transports that
:func:`megascale_omni.elastic.heal.checkpoint_transport` builds
(torchft's ``HTTPTransport`` and ``PGTransport`` over a torchft
``ProcessGroupGloo``; CPU tensors). The state is ``--gib`` GiB of fp32
tensors (``--tensors`` of them) plus the small metadata a heal carries
(step, layout, replica config, optimizer hyper-parameters).

(a) transfer: two processes, sender and receiver, both transports built
    once. Time = the sender's ``send_checkpoint`` call (its state is ready)
    -> the receiver's ``recv_checkpoint`` returned (the state is in its
    memory; values checked). The receiver is already waiting, as a joiner
    is. Throughput = state bytes / time.
(b) join: a lighthouse and two replica groups of one rank each, each an
    :class:`~megascale_omni.elastic.membership.ReplicaQuorum` holding such a
    state. r0 steps (quorum, a one-element cross-replica sum, commit vote);
    r1's process is up (imports done, state allocated) and, after r0
    committed 3 steps, builds its ReplicaQuorum and joins. Join latency =
    r1's ReplicaQuorum construction (torchft manager, transport) -> r1's
    first committed step, with the peer state applied (values checked).
    ``heal`` is the part of it r1 waited in its first quorum (the quorum
    and the state fetch). The training program around it (model build,
    torchrun, imports) is not included: ``benchmarks/elastic_join.py``
    measures a whole joining job.

Each round runs (a) and (b) for both transports, the order alternating
between rounds; reported: per-round values, medians and ranges, and the
ratio pg / http (baseline http).

``--quick``: 8 MiB, 1 round.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _quick import add_quick_flag, apply_quick  # noqa: E402

from tests.dist.elastic_helpers import start_lighthouse  # noqa: E402
from tests.launcher import free_port, kill_group  # noqa: E402

QUICK = {"gib": 1 / 128, "rounds": 1}
TRANSPORTS = ("http", "pg")
TIMEOUT = timedelta(seconds=300)
#: r0's committed steps before r1 joins.
STEPS_BEFORE_JOIN = 3


def make_state(nbytes: int, tensors: int, fill: float) -> dict:
    """A heal-sized state: ``tensors`` fp32 tensors of ``nbytes`` in all,
    tensor ``i`` filled with ``fill + i``, plus heal metadata."""
    import torch

    numel = nbytes // 4 // tensors
    return {
        "weights": {f"layer{i}.weight": torch.full((numel,), fill + i) for i in range(tensors)},
        "step": 1000,
        "layout": {"tp": 1, "pp": 1, "cp": 1, "dp": 1, "vpp": None, "distributed_optimizer": False},
        "config": {f"model.field_{i}": i for i in range(100)},
        "optimizer": {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "step": 1000},
    }


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["weights"].values())


def check_state(state: dict, fill: float) -> None:
    """Raise unless every tensor of ``state`` holds ``make_state``'s values for ``fill``."""
    for i, (name, t) in enumerate(state["weights"].items()):
        if not bool((t == fill + i).all()):
            raise AssertionError(f"{name}: received values differ from the sender's")
    assert state["config"]["model.field_99"] == 99 and state["optimizer"]["betas"] == (0.9, 0.95)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _wait_key(store, key: str) -> None:
    store.wait([key], TIMEOUT)


# ------------------------------------------------------------ (a) transfer
def transfer_worker(rank: int, port: int, nbytes: int, tensors: int, trials: list[tuple[int, str]]) -> None:
    """Rank 0 sends, rank 1 receives, one transfer per ``(round, transport)``
    of ``trials``; times go to the coordination store on ``port``."""
    import torch
    import torch.distributed as dist

    from megascale_omni.elastic.adapter import process_group_for
    from megascale_omni.elastic.heal import checkpoint_transport

    store = dist.TCPStore("localhost", port, is_master=False, timeout=TIMEOUT)
    cpu = torch.device("cpu")
    pg = process_group_for(cpu, TIMEOUT)
    pg.configure(f"localhost:{port}/transfer_pg", "0", rank, 2)
    transports = {kind: checkpoint_transport(kind, pg, cpu, TIMEOUT) for kind in TRANSPORTS}
    if rank == 0:
        for kind, t in transports.items():
            store.set(f"meta/{kind}", t.metadata())
        state = make_state(nbytes, tensors, fill=1.0)
    for k, (rnd, kind) in enumerate(trials):
        transport, step = transports[kind], k + 1
        store.add(f"ready/{k}", 1)
        while store.add(f"ready/{k}", 0) < 2:
            time.sleep(0.005)
        if rank == 1:
            meta = store.get(f"meta/{kind}").decode()
            got = transport.recv_checkpoint(src_rank=0, metadata=meta, step=step, timeout=TIMEOUT)
            t1 = time.monotonic()
            check_state(got, fill=1.0)
            del got
            store.set(f"t1/{k}", repr(t1))
        else:
            time.sleep(0.3)  # the receiver is waiting, as a joiner is
            t0 = time.monotonic()
            transport.send_checkpoint(dst_ranks=[1], step=step, state_dict=state, timeout=TIMEOUT)
            store.set(f"t0/{k}", repr(t0))
            _wait_key(store, f"t1/{k}")
            transport.disallow_checkpoint()  # as the Manager does at the commit vote
    store.set(f"rss/{rank}", repr(_peak_rss_gib()))
    for t in transports.values():
        t.shutdown(wait=False)


# ---------------------------------------------------------------- (b) join
def replica_worker(rid: str, port: int, lighthouse: str, kind: str, nbytes: int, tensors: int) -> None:
    """One replica group of one rank (its own store, as torchrun gives it).
    r0 steps until r1 has its peer state; r1 waits for ``go``, then joins."""
    import torch
    import torch.distributed as dist

    from megascale_omni.config import ElasticConfig
    from megascale_omni.elastic.cross_replica import CrossReplicaSums
    from megascale_omni.elastic.membership import ReplicaQuorum

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    coord = dist.TCPStore("localhost", port, is_master=False, timeout=TIMEOUT)
    fill = 1.0 if rid == "r0" else -1.0
    state = make_state(nbytes, tensors, fill)

    def load(peer: dict) -> None:  # in place, as a trainer's load_state_dict
        for name, t in state["weights"].items():
            t.copy_(peer["weights"][name])

    cfg = ElasticConfig(enabled=True, lighthouse=lighthouse, replica_id=rid, heal_transport=kind,
                        timeout_s=TIMEOUT.total_seconds(), quorum_timeout_s=TIMEOUT.total_seconds())
    if rid == "r1":
        coord.set("r1/up", "1")
        _wait_key(coord, "go")
    t0 = time.monotonic()
    replica = ReplicaQuorum(cfg, lambda: state, load, device=torch.device("cpu"))
    sums = CrossReplicaSums(replica, torch.device("cpu"))
    steps = 0
    while True:
        part = replica.begin_step()
        if rid == "r1":
            heal_s = replica.quorum_wait_s
            assert not part.participating, "r1 should heal in its first quorum"
            coord.set("r1/state", "1")  # before its commit vote: r0 stops after this step
        sums.reduce_sum(torch.ones(1) if part.participating else torch.zeros(1))
        committed = replica.should_commit()
        steps += committed
        if rid == "r0":
            if steps == STEPS_BEFORE_JOIN:
                coord.set("r0/ready", "1")
            if coord.check(["r1/state"]):
                break
        elif committed:
            t1 = time.monotonic()
            check_state(state, fill=1.0)
            coord.set("join", json.dumps([t1 - t0, heal_s]))
            break
    coord.set(f"rss/{rid}", repr(_peak_rss_gib()))
    replica.leave()
    dist.destroy_process_group()


# ------------------------------------------------------------------ parent
def _run(targets: list[tuple], timeout: float) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=f, args=a, daemon=True) for f, a in targets]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            if p.exitcode != 0:
                raise RuntimeError(f"{p.name} ({targets[procs.index(p)][0].__name__}) exited {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def measure_transfer(nbytes: int, tensors: int, trials: list[tuple[int, str]]) -> tuple[list[float], float]:
    """Seconds of each trial's transfer, and the larger peak RSS (GiB) of the two processes."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("localhost", port, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    _run([(transfer_worker, (rank, port, nbytes, tensors, trials)) for rank in (0, 1)], timeout=1800)
    times = [float(store.get(f"t1/{k}")) - float(store.get(f"t0/{k}")) for k in range(len(trials))]
    return times, max(float(store.get(f"rss/{r}")) for r in (0, 1))


def measure_join(kind: str, nbytes: int, tensors: int) -> tuple[float, float, float]:
    """(join latency s, heal s, larger peak RSS GiB of r0 and r1) of one join."""
    import torch.distributed as dist

    port = free_port()
    coord = dist.TCPStore("localhost", port, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    lighthouse, addr = start_lighthouse(timeout=1800)
    ctx = mp.get_context("spawn")
    procs = {rid: ctx.Process(target=replica_worker, args=(rid, port, addr, kind, nbytes, tensors), daemon=True)
             for rid in ("r1", "r0")}
    try:
        # r1 first: its start-up (imports, state) is over before r0 reaches its steps.
        procs["r1"].start()
        coord.wait(["r1/up"], TIMEOUT)
        procs["r0"].start()
        coord.wait(["r0/ready"], TIMEOUT)
        coord.set("go", "1")
        for rid, p in procs.items():
            p.join(TIMEOUT.total_seconds())
            if p.exitcode != 0:
                raise RuntimeError(f"replica {rid} exited {p.exitcode}")
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        kill_group(lighthouse)
    join_s, heal_s = json.loads(coord.get("join"))
    return join_s, heal_s, max(float(coord.get(f"rss/{r}")) for r in ("r0", "r1"))


def _spread(values: list[float], fmt: str) -> str:
    return f"median {statistics.median(values):{fmt}} (min {min(values):{fmt}}, max {max(values):{fmt}})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (fp32 tensors)")
    p.add_argument("--tensors", type=int, default=8, help="number of tensors the state is split into")
    p.add_argument("--rounds", type=int, default=3)
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(argv), QUICK)
    nbytes = int(args.gib * 2**30) // (4 * args.tensors) * 4 * args.tensors
    orders = [TRANSPORTS if k % 2 == 0 else TRANSPORTS[::-1] for k in range(args.rounds)]
    trials = [(k, kind) for k in range(args.rounds) for kind in orders[k]]
    print(f"state: {nbytes / 2**30:.3f} GiB in {args.tensors} fp32 tensors + metadata; {args.rounds} round(s), "
          f"order alternating; CPU, gloo; load average {os.getloadavg()[0]:.1f} at start")

    times, rss = measure_transfer(nbytes, args.tensors, trials)
    gbps = {kind: [] for kind in TRANSPORTS}
    for (k, kind), t in zip(trials, times):
        gbps[kind].append(nbytes / t / 1e9)
    print("(a) transfer, sender's state ready -> receiver has it (GB/s = 1e9 bytes/s)")
    print("round | " + " | ".join(f"{kind} s  {kind} GB/s" for kind in TRANSPORTS))
    for k in range(args.rounds):
        cells = [f"{nbytes / 1e9 / gbps[kind][k]:.3f}  {gbps[kind][k]:.3f}" for kind in TRANSPORTS]
        print(f"{k:>5} | " + " | ".join(cells))
    for kind in TRANSPORTS:
        print(f"transfer {kind}: {_spread(gbps[kind], '.3f')} GB/s")
    ratios = [pg / http for pg, http in zip(gbps["pg"], gbps["http"])]
    print(f"ratio pg / http throughput (baseline http): {_spread(ratios, '.2f')}; peak RSS per process {rss:.2f} GiB")

    joins = {kind: [] for kind in TRANSPORTS}
    heals = {kind: [] for kind in TRANSPORTS}
    print("(b) join: r1's ReplicaQuorum built -> its first committed step, peer state applied")
    print("round | " + " | ".join(f"{kind} join s  heal s" for kind in TRANSPORTS))
    peak = 0.0
    for k in range(args.rounds):
        for kind in orders[k]:
            join_s, heal_s, rss = measure_join(kind, nbytes, args.tensors)
            joins[kind].append(join_s)
            heals[kind].append(heal_s)
            peak = max(peak, rss)
        print(f"{k:>5} | " + " | ".join(f"{joins[kind][k]:.3f}  {heals[kind][k]:.3f}" for kind in TRANSPORTS))
    for kind in TRANSPORTS:
        print(f"join {kind}: {_spread(joins[kind], '.3f')} s; heal {_spread(heals[kind], '.3f')} s")
    ratios = [pg / http for pg, http in zip(joins["pg"], joins["http"])]
    print(f"ratio pg / http join latency (baseline http): {_spread(ratios, '.2f')}; peak RSS per process "
          f"{peak:.2f} GiB; load average {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
