"""The live scheduler's config file and its availability signal
(formats in docs/scheduler.md, "Running live").

:func:`load_live_config` validates ``omni-sched run --config FILE`` before
anything starts: every problem raises
:class:`~megascale_omni.config.ConfigError` naming the field, the value and
the fix (``omni-sched`` prints one line and exits 2).

:func:`read_availability` reads the availability file every tick. It is
written by an operator or a cloud hook while the scheduler runs, so a bad
or half-written file is reported as a value and the last good reading is
kept: it never stops the loop.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megascale_omni.errors import ConfigError
from megascale_omni.scheduler.model import BARE_METAL, PoolSpec
from megascale_omni.scheduler.trace import _int, _list, _mapping, _name, _number, _pool, _unique, read_utf8

TOP_KEYS = frozenset({"version", "tick_s", "out", "availability", "launcher", "dry_run", "control", "pools", "jobs",
                      "policy", "slurm", "kubernetes"})
JOB_KEYS = frozenset({"name", "config", "entry", "overrides", "nproc_per_node", "replica_gpus", "replicas",
                      "priority", "standby", "demand_gpus", "lighthouse", "ledger", "vision_token_cost"})
CONTROL_KEYS = frozenset({"attempts", "backoff_s", "timeout_s", "drain_timeout_s"})
LAUNCHERS = ("local", "slurm", "kubernetes")
#: Largest ``vision_token_cost`` accepted: a tower token 100x an LM token is
#: beyond any published pairing (ViT-L beside a 7B LM: ~0.05), so more is a typo.
MAX_VISION_TOKEN_COST = 100.0


@dataclass(frozen=True)
class LiveJob:
    """One job the live scheduler runs. ``standby`` maps pool -> warm
    standbys to keep; ``demand_gpus`` the GPUs it can use when its data
    wait is low (default: all ``max_replicas``); ``lighthouse`` ``auto``
    (local launcher: start one) or ``http://host:port``;
    ``vision_token_cost``: weight of a vision-tower token against an LM token
    in the job's per-step work, or None (``auto``): the one its step records
    report (its model's FLOPs ratio), else
    :data:`~megascale_omni.scheduler.live_demand.VISION_TOKEN_COST`."""

    name: str
    config: str
    replica_gpus: int
    min_replicas: int
    max_replicas: int
    priority: float = 1.0
    entry: str = "megascale_omni.smoke"
    overrides: tuple[str, ...] = ()
    nproc_per_node: int = 1
    standby: dict[str, int] = field(default_factory=dict)
    demand_gpus: Optional[float] = None
    lighthouse: str = "auto"
    ledger: bool = True
    vision_token_cost: Optional[float] = None


@dataclass(frozen=True)
class LiveConfig:
    """``omni-sched run``'s settings. Times in seconds; ``out`` holds
    ``decisions.log``, ``state.json`` and each job's ``<job>/<replica>`` run
    directories and ``<job>/ledger``."""

    pools: list[PoolSpec]
    jobs: list[LiveJob]
    out: str
    availability: str
    tick_s: float = 5.0
    launcher: str = "local"
    dry_run: bool = False
    attempts: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 60.0
    drain_timeout_s: float = 300.0
    policy: dict = field(default_factory=dict)
    slurm: dict = field(default_factory=dict)
    kubernetes: dict = field(default_factory=dict)


def load_live_config(path: str) -> LiveConfig:
    """Read and validate ``path`` (YAML or JSON). Relative paths inside are taken from the working directory."""
    text = read_utf8("--config", path, "give the live config file")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("--config", path, f"not valid YAML: {str(e).splitlines()[0]}") from None
    return parse_live_config(raw)


def parse_live_config(raw: Any) -> LiveConfig:
    _mapping("config", raw, TOP_KEYS)
    if raw.get("version", 1) != 1:
        raise ConfigError("version", raw.get("version"), "this omni-sched reads live config version 1")
    out = raw.get("out")
    if not isinstance(out, str) or not out:
        raise ConfigError("out", out, "give the directory for decisions.log, state.json and the run directories")
    availability = raw.get("availability", os.path.join(out, "availability.yaml"))
    if not isinstance(availability, str) or not availability:
        raise ConfigError("availability", availability, "give the path of the availability file")
    launcher = raw.get("launcher", "local")
    if launcher not in LAUNCHERS:
        raise ConfigError("launcher", launcher, f"use one of {list(LAUNCHERS)}")
    dry_run = raw.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise ConfigError("dry_run", dry_run, "must be true or false")
    if dry_run and launcher == "local":
        raise ConfigError("dry_run", dry_run, "the local launcher has no dry run; use launcher: slurm or kubernetes")
    for section in ("slurm", "kubernetes", "policy"):
        _mapping(section, raw.get(section) or {}, None)
    control = raw.get("control") or {}
    _mapping("control", control, CONTROL_KEYS)
    pools = [_pool(i, p) for i, p in enumerate(_list("pools", raw.get("pools")))]
    for i, p in enumerate(pools):
        if p.availability is not None:
            raise ConfigError(f"pools[{i}].availability", "...", "live, availability comes from the availability "
                              "file; remove it")
    _unique("pools", [p.name for p in pools])
    if not any(p.kind == BARE_METAL for p in pools):
        raise ConfigError("pools", [p.name for p in pools], "add a bare_metal pool: it holds every job's core")
    jobs = [_job(i, j, pools) for i, j in enumerate(_list("jobs", raw.get("jobs")))]
    _unique("jobs", [j.name for j in jobs])
    return LiveConfig(
        pools=pools, jobs=jobs, out=out, availability=availability,
        tick_s=_number("tick_s", raw.get("tick_s", 5.0), low=0.05), launcher=launcher, dry_run=dry_run,
        attempts=_int("control.attempts", control.get("attempts", 4), low=1),
        backoff_s=_number("control.backoff_s", control.get("backoff_s", 0.5), low=0),
        timeout_s=_number("control.timeout_s", control.get("timeout_s", 60.0), low=0.1),
        drain_timeout_s=_number("control.drain_timeout_s", control.get("drain_timeout_s", 300.0), low=1),
        policy=dict(raw.get("policy") or {}), slurm=dict(raw.get("slurm") or {}),
        kubernetes=dict(raw.get("kubernetes") or {}))


def _job(i: int, raw: Any, pools: list[PoolSpec]) -> LiveJob:
    where = f"jobs[{i}]"
    _mapping(where, raw, JOB_KEYS)
    name = _name(f"{where}.name", raw.get("name"))
    config = raw.get("config")
    if not isinstance(config, str) or not Path(config).is_file():
        raise ConfigError(f"{where}.config", config, "give the job's training config file (e.g. "
                          "examples/elastic/gpt_pp2.yaml)")
    rg = _int(f"{where}.replica_gpus", raw.get("replica_gpus"), low=1)
    for p in pools:
        if rg % p.gpus_per_node:
            raise ConfigError(f"{where}.replica_gpus", rg, f"a replica group takes whole nodes: use a multiple of "
                              f"pool {p.name!r}'s gpus_per_node ({p.gpus_per_node})")
    replicas = raw.get("replicas")
    _mapping(f"{where}.replicas", replicas, {"min", "max"})
    lo = _int(f"{where}.replicas.min", replicas.get("min"), low=1)
    hi = _int(f"{where}.replicas.max", replicas.get("max"), low=lo)
    overrides = raw.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise ConfigError(f"{where}.overrides", overrides, "give a list of section.field=value strings")
    standby = raw.get("standby") or {}
    _mapping(f"{where}.standby", standby, {p.name for p in pools})
    standby = {p: _int(f"{where}.standby.{p}", n, low=0) for p, n in standby.items()}
    demand = raw.get("demand_gpus")
    if demand is not None:
        demand = _number(f"{where}.demand_gpus", demand, low=0)
    lighthouse = raw.get("lighthouse", "auto")
    if not isinstance(lighthouse, str) or not (lighthouse == "auto" or lighthouse.startswith("http")):
        raise ConfigError(f"{where}.lighthouse", lighthouse, "write auto (local launcher) or http://host:port")
    ledger = raw.get("ledger", True)
    if not isinstance(ledger, bool):
        raise ConfigError(f"{where}.ledger", ledger, "must be true or false")
    tower = raw.get("vision_token_cost", "auto")
    if tower != "auto":
        if isinstance(tower, bool) or not isinstance(tower, (int, float)) or not 0 <= tower <= MAX_VISION_TOKEN_COST:
            raise ConfigError(f"{where}.vision_token_cost", tower,
                              f"must be auto (the job's own, from its model's FLOPs) or a number in "
                              f"[0, {MAX_VISION_TOKEN_COST:g}]: a tower token's cost against an LM token's")
        tower = float(tower)
    return LiveJob(name=name, config=config, replica_gpus=rg, min_replicas=lo, max_replicas=hi,
                   priority=_number(f"{where}.priority", raw.get("priority", 1.0), low=1e-9),
                   entry=str(raw.get("entry", "megascale_omni.smoke")), overrides=tuple(overrides),
                   nproc_per_node=_int(f"{where}.nproc_per_node", raw.get("nproc_per_node", 1), low=1),
                   standby=standby, demand_gpus=demand, lighthouse=lighthouse, ledger=ledger,
                   vision_token_cost=None if tower == "auto" else tower)


@dataclass(frozen=True)
class PoolState:
    """A pool as the availability file says now: ``nodes`` available; ``reclaim_nodes`` of them announced to
    leave at ``deadline`` (Unix seconds)."""

    nodes: int
    reclaim_nodes: int = 0
    deadline: Optional[float] = None


def read_availability(path: str, pools: list[PoolSpec]) -> tuple[Optional[dict[str, PoolState]], str]:
    """``(pool -> PoolState for the pools the file names, "")`` or ``(None, error)``.

    A missing file means no change (``{}``). The file is a mapping of pool
    name to ``{nodes: N, reclaim: {nodes: K, deadline: UNIX_S}}`` (reclaim
    optional); ``nodes`` may not exceed the pool's inventory."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f.read()) if not path.endswith(".json") else json.load(f)
    except FileNotFoundError:
        return {}, ""
    except (OSError, yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"{path}: cannot read it: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    try:
        _mapping(path, raw if raw is not None else {}, {p.name for p in pools})
        out = {}
        for name, entry in (raw or {}).items():
            inventory = next(p.nodes for p in pools if p.name == name)
            _mapping(f"{name}", entry, {"nodes", "reclaim"})
            nodes = _int(f"{name}.nodes", entry.get("nodes"), low=0)
            if nodes > inventory:
                raise ConfigError(f"{name}.nodes", nodes, f"at most the pool's inventory ({inventory})")
            reclaim = entry.get("reclaim")
            if reclaim is None:
                out[name] = PoolState(nodes)
                continue
            _mapping(f"{name}.reclaim", reclaim, {"nodes", "deadline"})
            out[name] = PoolState(nodes, _int(f"{name}.reclaim.nodes", reclaim.get("nodes"), low=1),
                                  _number(f"{name}.reclaim.deadline", reclaim.get("deadline"), low=0))
            if out[name].reclaim_nodes > nodes:
                raise ConfigError(f"{name}.reclaim.nodes", out[name].reclaim_nodes, f"at most nodes ({nodes})")
        return out, ""
    except ConfigError as e:
        return None, f"{path}: {e}"
