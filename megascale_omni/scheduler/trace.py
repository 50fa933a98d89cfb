"""Load and validate a scheduler trace (YAML or JSON; format in docs/scheduler.md).

Every problem raises :class:`megascale_omni.config.ConfigError` naming the
field (``jobs[1].replicas.max``), the value and the fix, before anything is
simulated; ``omni-sched`` turns it into one line and exit code 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from megascale_omni.errors import ConfigError
from megascale_omni.scheduler.model import (
    BARE_METAL,
    VM,
    CostModel,
    Costs,
    JobSpec,
    PoolSpec,
    Step,
    Straggler,
    ThroughputCurve,
    Timeline,
    Trace,
)

TOP_KEYS = frozenset({"version", "name", "tick_min", "horizon_min", "pools", "jobs", "costs", "cost_model",
                      "stragglers", "policy"})
POOL_KEYS = frozenset({"name", "kind", "gpus_per_node", "nodes", "availability", "period_min",
                       "reclaim_notice_min"})
JOB_KEYS = frozenset({"name", "arrive_min", "priority", "replica_gpus", "replicas", "work_samples", "throughput",
                      "demand", "standby"})


def load_trace(path: str | Path) -> Trace:
    """Read ``path`` (``.json``, else YAML) and validate it into a :class:`Trace`."""
    path = Path(path)
    text = read_utf8("--trace", path, "give an existing trace file")
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError("--trace", str(path), f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                          f"{first}") from None
    return parse_trace(raw, name=path.stem)


def read_utf8(flag: str, path: str | Path, fix: str) -> str:
    """The text of ``path``; a missing file or one that is not UTF-8 raises
    ConfigError naming ``flag`` (``fix`` says what to give instead)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(flag, str(path), f"cannot read it ({e.strerror}); {fix}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(flag, str(path), f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "save it as UTF-8") from None


def parse_trace(raw: Any, name: str = "trace") -> Trace:
    """Validate an already-parsed trace document."""
    _mapping("trace", raw, TOP_KEYS)
    version = raw.get("version", 1)
    if version != 1:
        raise ConfigError("version", version, "this omni-sched reads trace version 1")
    tick = _number("tick_min", raw.get("tick_min", 1.0), low=0.01)
    horizon = _number("horizon_min", raw.get("horizon_min", 10080.0), low=tick)
    pools = [_pool(i, p) for i, p in enumerate(_list("pools", raw.get("pools")))]
    _unique("pools", [p.name for p in pools])
    if not any(p.kind == BARE_METAL for p in pools):
        raise ConfigError("pools", [p.name for p in pools], "add a bare_metal pool: it holds every job's core")
    jobs = [_job(i, j, pools) for i, j in enumerate(_list("jobs", raw.get("jobs")))]
    _unique("jobs", [j.name for j in jobs])
    if raw.get("costs") is not None and raw.get("cost_model") is not None:
        raise ConfigError("cost_model", raw["cost_model"], "give either costs (latencies) or cost_model (state "
                          "size, bandwidths, start-up), not both")
    costs = _cost_model(raw["cost_model"]) if raw.get("cost_model") is not None else _costs(raw.get("costs") or {})
    stragglers_raw = raw.get("stragglers")
    if stragglers_raw is not None and not isinstance(stragglers_raw, list):
        raise ConfigError("stragglers", stragglers_raw, "must be a list of {job, at_min, until_min, slowdown} "
                          "mappings (or left out)")
    stragglers = [_straggler(i, s, jobs) for i, s in enumerate(stragglers_raw or [])]
    policy = raw.get("policy") or {}
    _mapping("policy", policy, None)
    return Trace(pools=pools, jobs=jobs, costs=costs, tick_min=tick, horizon_min=horizon, stragglers=stragglers,
                 policy=dict(policy), name=str(raw.get("name", name)))


def _pool(i: int, raw: Any) -> PoolSpec:
    where = f"pools[{i}]"
    _mapping(where, raw, POOL_KEYS)
    name = _name(f"{where}.name", raw.get("name"))
    kind = raw.get("kind")
    if kind not in (BARE_METAL, VM):
        raise ConfigError(f"{where}.kind", kind, f"use {BARE_METAL!r} or {VM!r}")
    gpn = _int(f"{where}.gpus_per_node", raw.get("gpus_per_node"), low=1)
    nodes = _int(f"{where}.nodes", raw.get("nodes"), low=0)
    notice = _number(f"{where}.reclaim_notice_min", raw.get("reclaim_notice_min", 10.0), low=0)
    availability = None
    if raw.get("availability") is not None:
        if kind != VM:
            raise ConfigError(f"{where}.availability", raw["availability"],
                              "only a vm pool has an availability timeline; remove it or set kind: vm")
        period = raw.get("period_min")
        availability = _timeline(f"{where}.availability", raw["availability"], "nodes", period, high=nodes)
    elif raw.get("period_min") is not None:
        raise ConfigError(f"{where}.period_min", raw["period_min"], "period_min needs an availability list")
    return PoolSpec(name=name, kind=kind, gpus_per_node=gpn, nodes=nodes, availability=availability,
                    reclaim_notice_min=notice)


def _job(i: int, raw: Any, pools: list[PoolSpec]) -> JobSpec:
    where = f"jobs[{i}]"
    _mapping(where, raw, JOB_KEYS)
    name = _name(f"{where}.name", raw.get("name"))
    rg = _int(f"{where}.replica_gpus", raw.get("replica_gpus"), low=1)
    for p in pools:
        if rg % p.gpus_per_node:
            raise ConfigError(f"{where}.replica_gpus", rg, f"a replica group takes whole nodes: use a multiple of "
                              f"pool {p.name!r}'s gpus_per_node ({p.gpus_per_node})")
    replicas = raw.get("replicas")
    _mapping(f"{where}.replicas", replicas, {"min", "max"})
    lo = _int(f"{where}.replicas.min", replicas.get("min"), low=1)
    hi = _int(f"{where}.replicas.max", replicas.get("max"), low=lo)
    bm_nodes = sum(p.nodes * p.gpus_per_node for p in pools if p.kind == BARE_METAL)
    if lo * rg > bm_nodes:
        raise ConfigError(f"{where}.replicas.min", lo, f"the core ({lo} x {rg} GPUs) must fit the bare_metal "
                          f"pools ({bm_nodes} GPUs); lower it or add bare-metal nodes")
    points = _list(f"{where}.throughput", raw.get("throughput"))
    curve = []
    for k, pt in enumerate(points):
        if not (isinstance(pt, (list, tuple)) and len(pt) == 2):
            raise ConfigError(f"{where}.throughput[{k}]", pt, "write each point as [replicas, samples_per_s]")
        x = _number(f"{where}.throughput[{k}][0]", pt[0], low=1e-9)
        y = _number(f"{where}.throughput[{k}][1]", pt[1], low=0)
        if curve and x <= curve[-1][0]:
            raise ConfigError(f"{where}.throughput[{k}][0]", x, "replica counts must ascend")
        curve.append((x, y))
    demand = raw.get("demand")
    _mapping(f"{where}.demand", demand, {"phases", "period_min"})
    timeline = _timeline(f"{where}.demand.phases", demand.get("phases"), "gpus", demand.get("period_min"))
    return JobSpec(
        name=name, arrive_min=_number(f"{where}.arrive_min", raw.get("arrive_min", 0.0), low=0),
        priority=_number(f"{where}.priority", raw.get("priority", 1.0), low=1e-9), replica_gpus=rg,
        min_replicas=lo, max_replicas=hi,
        work_samples=_number(f"{where}.work_samples", raw.get("work_samples"), low=1e-9),
        curve=ThroughputCurve(tuple(curve)), demand=timeline,
        standby=_int(f"{where}.standby", raw.get("standby", 0), low=0),
    )


def _timeline(where: str, raw: Any, key: str, period: Any, high: float | None = None) -> Timeline:
    steps = []
    for k, item in enumerate(_list(where, raw)):
        _mapping(f"{where}[{k}]", item, {"at_min", key})
        at = _number(f"{where}[{k}].at_min", item.get("at_min"), low=0)
        if k == 0 and at != 0:
            raise ConfigError(f"{where}[0].at_min", at, "the first entry must be at_min: 0")
        if steps and at <= steps[-1].at_min:
            raise ConfigError(f"{where}[{k}].at_min", at, "at_min must ascend")
        value = _number(f"{where}[{k}].{key}", item.get(key), low=0, high=high)
        steps.append(Step(at, value))
    if period is not None:
        period = _number(where.rsplit(".", 1)[0] + ".period_min", period, low=1e-9)
        if steps[-1].at_min >= period:
            raise ConfigError(where.rsplit(".", 1)[0] + ".period_min", period,
                              f"must exceed the last at_min ({steps[-1].at_min})")
    return Timeline(tuple(steps), period)


def _costs(raw: Any) -> Costs:
    known = set(Costs.__dataclass_fields__)
    _mapping("costs", raw, known)
    return Costs(**{k: _number(f"costs.{k}", v, low=0) for k, v in raw.items()})


def _cost_model(raw: Any) -> Costs:
    known = set(CostModel.__dataclass_fields__)
    _mapping("cost_model", raw, known)
    positive = {"heal_gb_per_s", "checkpoint_gb_per_s"}
    return CostModel(**{k: _number(f"cost_model.{k}", v, low=1e-9 if k in positive else 0)
                        for k, v in raw.items()}).costs()


def _straggler(i: int, raw: Any, jobs: list[JobSpec]) -> Straggler:
    where = f"stragglers[{i}]"
    _mapping(where, raw, {"job", "at_min", "until_min", "slowdown"})
    if raw.get("job") not in {j.name for j in jobs}:
        raise ConfigError(f"{where}.job", raw.get("job"), f"name one of the jobs: {sorted(j.name for j in jobs)}")
    at = _number(f"{where}.at_min", raw.get("at_min"), low=0)
    until = _number(f"{where}.until_min", raw.get("until_min"), low=at)
    slow = _number(f"{where}.slowdown", raw.get("slowdown"), low=1e-3, high=1.0)
    return Straggler(raw["job"], at, until, slow)


# ---------------------------------------------------------------- primitives
def _mapping(where: str, raw: Any, keys: frozenset[str] | set[str] | None) -> None:
    if not isinstance(raw, dict):
        raise ConfigError(where, raw, "must be a mapping (key: value)")
    odd = [k for k in raw if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"{where}.{odd[0]!r}", raw[odd[0]], f"keys must be text; {type(odd[0]).__name__} key "
                          f"{odd[0]!r}: quote it or use a name")
    if keys is not None:
        unknown = sorted(set(raw) - keys)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", raw[unknown[0]], f"unknown key; known: {sorted(keys)}")


def _list(where: str, raw: Any) -> list:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(where, raw, "must be a non-empty list")
    return raw


def _name(where: str, raw: Any) -> str:
    if not isinstance(raw, str) or not raw or any(c.isspace() or c == "," for c in raw):
        raise ConfigError(where, raw, "give a non-empty name without spaces or commas")
    return raw


def _unique(where: str, names: list[str]) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(where, dup[0], "names must be unique")


def _number(where: str, raw: Any, low: float | None = None, high: float | None = None) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or raw != raw:
        hint = "must be a number" + (f" >= {low:g}" if low is not None else "")
        if isinstance(raw, str) and _float_text(raw):
            hint += f" (YAML reads {raw} as text: write the exponent with a sign, e.g. 1.5e+8)"
        raise ConfigError(where, raw, hint)
    if not math.isfinite(raw):
        raise ConfigError(where, raw, "must be a finite number" + (f" >= {low:g}" if low is not None else ""))
    if (low is not None and raw < low) or (high is not None and raw > high):
        bound = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
        raise ConfigError(where, raw, f"must be {bound}")
    return float(raw)


def _float_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _int(where: str, raw: Any, low: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(where, raw, f"must be a whole number >= {low}")
    if raw < low:
        raise ConfigError(where, raw, f"must be >= {low}")
    return raw
