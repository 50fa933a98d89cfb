"""Slurm allocation -> torchrun's multi-node arguments, for ``omni-run``.

Inside an allocation (``SLURM_JOB_ID`` set), ``srun --ntasks-per-node=1
omni-run ...`` starts one torchrun agent per node; :func:`apply_slurm` fills
the arguments the user left out, and explicit flags (or torchrun's own
``PET_*`` variables) always win:

    --nnodes          the step's node count     SLURM_STEP_NUM_NODES, SLURM_NNODES, SLURM_JOB_NUM_NODES
    --node-rank       this node's index         SLURM_NODEID (``--rdzv-backend static`` only)
    --nproc-per-node  one worker per GPU        SLURM_GPUS_ON_NODE, else SLURM_NTASKS_PER_NODE
    --rdzv-backend    c10d
    --rdzv-id         the job id                SLURM_JOB_ID
    --rdzv-endpoint   first node : port         SLURM_STEP_NODELIST, SLURM_NODELIST, SLURM_JOB_NODELIST

The endpoint's host is the first node of the nodelist (the one with
``SLURM_NODEID`` 0), whose agent then hosts the c10d store, or
``--master-addr`` when given; its port is ``--master-port`` when given, else
``29500 + SLURM_JOB_ID % 1000`` (two jobs that share their first node then
rarely pick the same port). c10d numbers the nodes in the order their agents
join, so global rank 0 may run on any node; ``--rdzv-backend static`` keeps
``SLURM_NODEID`` order instead.
``srun`` sets the step's variables (``SLURM_STEP_*``, and ``SLURM_NNODES``,
``SLURM_NODELIST``, ``SLURM_NODEID`` relative to the step), which is why
they come before the job's.

Contradictions raise :class:`ConfigError` naming the flag or variable: an
``--nnodes`` (or range) that does not admit the step's node count, a
nodelist that cannot be parsed or whose length is not the node count, a
``SLURM_NODEID`` outside ``[0, nodes)``, an srun step of more than one task
per node (``SLURM_STEP_NUM_TASKS``). ``--standalone`` asks for one
single-node job per node (e.g. one elastic replica group per node); then
only ``--nproc-per-node`` is derived.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from megascale_omni.config import ConfigError

#: torchrun's ``--master-port`` default; the derived port is this plus ``SLURM_JOB_ID % 1000``.
BASE_PORT = 29500
#: torchrun argument ``dest`` -> its flag, for the explicit-flag check and messages.
FLAGS = {
    "nnodes": "--nnodes", "node_rank": "--node-rank", "nproc_per_node": "--nproc-per-node",
    "rdzv_backend": "--rdzv-backend", "rdzv_id": "--rdzv-id", "rdzv_endpoint": "--rdzv-endpoint",
    "master_addr": "--master-addr", "master_port": "--master-port",
}
_UNSET = object()
# One hostlist expression: a name, possibly with bracketed id lists (``rack[1-2]-n[01,05]``).
_EXPRESSION = re.compile(r"[^\[\],\s]*(?:\[[^\[\]]*\][^\[\],\s]*)*")
_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_ID_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_nodelist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Host names of a Slurm compact nodelist, in order: ``node[01-03,07],gpu5``
    -> ``node01 node02 node03 node07 gpu5``.

    Slurm's hostlist grammar: comma-separated expressions; an expression is
    a prefix, then any number of ``[ids]`` groups each followed by text (the
    product of the groups, the last varying fastest); ids are numbers or
    ``lo-hi`` ranges, zero-padded to the width of ``lo``. ``scontrol show
    hostnames`` is the authority and :func:`nodelist_hosts` prefers it; this
    parser is for hosts without the Slurm client (a login container, the
    tests). We keep it here rather than adding python-hostlist, a GPL
    dependency, for this much grammar. Raises ConfigError naming ``variable``.
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(variable, nodelist, f"{why}; expected Slurm's compact form such as node[01-03,07],gpu5 "
                                               "(check the value, or install scontrol on this host)")

    hosts: list[str] = []
    pos, text = 0, nodelist.strip()
    if not text:
        raise bad("empty nodelist")
    while pos < len(text):
        match = _EXPRESSION.match(text, pos)
        expression = match.group(0)
        if not expression:
            raise bad(f"empty or malformed host name at character {pos}")
        hosts.extend(_expand_expression(expression, bad))
        pos = match.end()
        if pos < len(text):
            if text[pos] != ",":
                raise bad(f"unexpected {text[pos]!r} at character {pos}")
            pos += 1
            if pos == len(text):
                raise bad("trailing comma")
    return hosts


def _expand_expression(expression: str, bad) -> list[str]:
    names = [""]
    pos = 0
    for group in _BRACKET.finditer(expression):
        names = [n + expression[pos:group.start()] for n in names]
        ids = _expand_ids(group.group(1), bad)
        names = [n + i for n in names for i in ids]
        pos = group.end()
    return [n + expression[pos:] for n in names]


def _expand_ids(idlist: str, bad) -> list[str]:
    ids: list[str] = []
    for item in idlist.split(","):
        m = _ID_RANGE.fullmatch(item.strip())
        if m is None:
            raise bad(f"[{idlist}] holds {item!r}, not a number or a lo-hi range")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise bad(f"range {item} runs backwards")
        ids.extend(f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1))
    return ids


def nodelist_hosts(nodelist: str, variable: str) -> list[str]:
    """Expand ``nodelist`` with ``scontrol show hostnames`` when the Slurm client
    is installed, else with :func:`expand_nodelist`. A client that cannot run
    (installed on a host that is not configured for a cluster: "Could not
    establish a configuration source") falls back to :func:`expand_nodelist`
    too. Raises ConfigError naming ``variable`` when both reject it."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return expand_nodelist(nodelist, variable)
    done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    hosts = done.stdout.split()
    if done.returncode == 0 and hosts:
        return hosts
    why = (done.stderr.strip().splitlines() or ["no host names"])[-1]
    try:
        return expand_nodelist(nodelist, variable)
    except ConfigError:
        raise ConfigError(variable, nodelist, f"scontrol show hostnames rejected it ({why}), and so does Slurm's "
                                              "hostlist grammar; check the value") from None


@dataclass(frozen=True)
class SlurmNodes:
    """What the Slurm environment says about this torchrun agent's place."""

    job_id: int
    #: Nodes of the step (of the job outside ``srun``) and where the count came from.
    num_nodes: int
    nodes_variable: str
    #: This node's index in the step, ``SLURM_NODEID``.
    node_id: int
    #: Host of node 0, which hosts the rendezvous store.
    first_node: str
    #: Workers per node Slurm suggests (GPUs, else tasks per node) and from which variable; None if neither.
    nproc: Optional[int]
    nproc_variable: str
    #: omni-run tasks srun started in this step (``SLURM_STEP_NUM_TASKS``); None outside srun.
    step_tasks: Optional[int] = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["SlurmNodes"]:
        """None outside a Slurm allocation (no ``SLURM_JOB_ID``); raises
        ConfigError for values that are malformed or contradict each other."""
        if not env.get("SLURM_JOB_ID"):
            return None
        job_id = _integer(env, "SLURM_JOB_ID", 0)
        nodes_variable = _first_set(env, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
        list_variable = _first_set(env, ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"))
        if nodes_variable is None or list_variable is None or "SLURM_NODEID" not in env:
            raise ConfigError("SLURM_JOB_ID", env["SLURM_JOB_ID"],
                              "is set but SLURM_NNODES, SLURM_JOB_NODELIST or SLURM_NODEID is not; start omni-run "
                              "through srun inside the allocation, or unset SLURM_JOB_ID")
        num_nodes = _integer(env, nodes_variable, 1)
        node_id = _integer(env, "SLURM_NODEID", 0)
        if node_id >= num_nodes:
            raise ConfigError("SLURM_NODEID", node_id, f"must be below {nodes_variable}={num_nodes}; start omni-run "
                                                       "through srun so each node gets its own id")
        hosts = nodelist_hosts(env[list_variable], list_variable)
        if len(hosts) != num_nodes:
            raise ConfigError(list_variable, env[list_variable],
                              f"names {len(hosts)} host(s) but {nodes_variable}={num_nodes}; they must agree")
        # A node without GPUs may report SLURM_GPUS_ON_NODE=0: then tasks per node decide.
        nproc_variable = next((n for n in ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE")
                               if env.get(n, "").strip() not in ("", "0")), "")
        nproc = _integer(env, nproc_variable, 1) if nproc_variable else None
        step_tasks = _integer(env, "SLURM_STEP_NUM_TASKS", 1) if env.get("SLURM_STEP_NUM_TASKS") else None
        return cls(job_id, num_nodes, nodes_variable, node_id, hosts[0], nproc, nproc_variable, step_tasks)


def _first_set(env: Mapping[str, str], names: Sequence[str]) -> Optional[str]:
    return next((n for n in names if env.get(n, "").strip()), None)


def _integer(env: Mapping[str, str], name: str, minimum: int) -> int:
    try:
        value = int(env[name])
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(name, env[name], f"must be an integer >= {minimum}, as Slurm sets it; unset or fix it")
    return value


def explicit_args(argv: Sequence[str]) -> set[str]:
    """The :data:`FLAGS` ``dest`` names the user set: on the command line (before
    the training script) or through torchrun's ``PET_<NAME>`` variables (which
    torchrun's parser reads from ``os.environ``, so we do too)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.set_defaults(**{dest: _UNSET for dest in FLAGS})
    given = vars(parser.parse_args(list(argv)))
    return {dest for dest in FLAGS if given[dest] is not _UNSET or f"PET_{dest.upper()}" in os.environ}


def apply_slurm(args, argv: Sequence[str], env: Mapping[str, str]) -> Optional[str]:
    """Fill ``args`` (torchrun's namespace parsed from ``argv``) from the Slurm
    variables in ``env``, in place, and return the one log line saying what
    was derived; None outside Slurm, where ``args`` is left alone. Raises
    ConfigError (see the module docstring)."""
    slurm = SlurmNodes.from_env(env)
    if slurm is None:
        return None
    given = explicit_args(argv)
    derived: dict[str, object] = {}
    if "nproc_per_node" not in given and slurm.nproc is not None:
        derived["nproc_per_node"] = str(slurm.nproc)
    where = f"Slurm job {slurm.job_id}, node {slurm.node_id} of {slurm.num_nodes}"
    if args.standalone:
        _set(args, derived)
        return f"{where}: --standalone, one single-node job per node; derived {_describe(derived)}"
    # srun inherits the allocation's tasks per node (#SBATCH --ntasks-per-node=8 is common): eight agents
    # per node would each start the node's workers and wait for a rendezvous that never fills.
    if slurm.step_tasks is not None and slurm.step_tasks != slurm.num_nodes:
        raise ConfigError("SLURM_STEP_NUM_TASKS", slurm.step_tasks,
                          f"srun started {slurm.step_tasks} omni-run tasks on {slurm.num_nodes} node(s); start one "
                          "per node: srun --ntasks-per-node=1 omni-run ...")
    if "nnodes" in given:
        _check_nnodes(args.nnodes, slurm)
    else:
        derived["nnodes"] = str(slurm.num_nodes)
    if "rdzv_backend" not in given:
        derived["rdzv_backend"] = "c10d"
    backend = derived.get("rdzv_backend", args.rdzv_backend)
    # c10d numbers the nodes in the order they join; only static reads a node rank.
    if "node_rank" not in given and backend == "static":
        derived["node_rank"] = slurm.node_id
    if "rdzv_id" not in given:
        derived["rdzv_id"] = str(slurm.job_id)
    if "rdzv_endpoint" not in given and backend in ("c10d", "static"):
        host = args.master_addr if "master_addr" in given else slurm.first_node
        port = args.master_port if "master_port" in given else BASE_PORT + slurm.job_id % 1000
        derived["rdzv_endpoint"] = f"{host}:{port}"
    _set(args, derived)
    kept = " ".join(FLAGS[d] for d in FLAGS if d in given)
    return f"{where}: derived {_describe(derived)}" + (f"; given {kept}" if kept else "")


def _check_nnodes(nnodes: str, slurm: SlurmNodes) -> None:
    low, _, high = str(nnodes).partition(":")
    try:
        admits = int(low) <= slurm.num_nodes <= int(high or low)
    except ValueError:
        return  # torchrun's own check names a malformed value
    if not admits:
        raise ConfigError("--nnodes", nnodes, f"this Slurm step has {slurm.nodes_variable}={slurm.num_nodes} nodes "
                                              f"with one omni-run each; leave --nnodes out (or give "
                                              f"{slurm.num_nodes}), or use --standalone for one job per node")


def _set(args, derived: dict) -> None:
    for dest, value in derived.items():
        setattr(args, dest, value)


def _describe(derived: dict) -> str:
    return " ".join(f"{FLAGS[d]} {v}" for d, v in derived.items()) or "nothing"
