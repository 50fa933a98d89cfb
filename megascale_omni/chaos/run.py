"""A chaos run: an elastic LLaVA job under a seeded fault plan, a fault-free
reference run of the same seed beside it, and the proofs at the end
(:mod:`megascale_omni.chaos.checks`). Entry: ``tools/chaos.py``."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import time
from types import SimpleNamespace
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from megascale_omni.chaos import capabilities, checks, report
from megascale_omni.chaos.faults import INJECTORS, Context, Injector
from megascale_omni.chaos.observe import Progress
from megascale_omni.chaos.plan import FAULT_CLASSES, Fault, make_plan
from megascale_omni.chaos.supervisor import GroupCommand, Supervisor, free_port, processes_of_run
from megascale_omni.elastic.ledger import read_ledger
from megascale_omni.utils.processes import kill_process_tree

log = logging.getLogger(__name__)

#: The job: tiny LLaVA, replica groups of PP2 with the distributed optimizer
#: and async checkpoints; constant LR 1e-5 (see RTOL).
JOB_CONFIG = "examples/llava/tiny_cpu.yaml"
JOB_OVERRIDES = (
    "parallel.pp=2", "parallel.use_distributed_optimizer=true", "model.num_layers=2", "vision.num_layers=1",
    "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_interval=0",
    "train.lr_decay_style=constant", "train.lr=1e-5", "train.min_lr=1e-5", "train.lr_warmup_steps=0",
    "logging.tensorboard=false", "logging.progress_bar=false", "logging.log_interval=100",
)
#: Relative loss tolerance at every committed step against the reference.
#: What separates the runs is fp32 summation order: a step summed over 2
#: groups adds the same per-sample gradients in another order than one group
#: does (1e-7 relative per step), and Adam carries that forward, growing
#: with the steps and the LR. Measured on this job at LR 1e-4: 1.6e-5 worst
#: over 235 steps with one membership change, but 1e-4 by step 250 and 1e-3
#: by step 310 of a run with 7 faults; hence LR 1e-5 (the proof is about
#: which samples and which sums each step used, not about learning). A lost,
#: repeated or foreign sample changes that step's loss by 1e-2 or more (one
#: of ~40 samples of the global batch), two orders above RTOL. The
#: exactly-once ledger check does not depend on this tolerance.
RTOL = 1e-4


@dataclass
class ChaosConfig:
    """One chaos run. ``duration_s``: seconds of faults after the job's
    first step with every group; ``faults``: how many (None: one per
    available class); ``kinds``: classes to fire (None: every available);
    ``overrides``: extra ``section.field=value`` for every group and the
    reference (e.g. ``watchdog.*``)."""

    run_dir: Path
    data_dir: Path
    duration_s: float = 120.0
    seed: int = 0
    slots: int = 2
    nproc: int = 2
    faults: Optional[int] = None
    kinds: Optional[list[str]] = None
    overrides: list[str] = field(default_factory=list)
    rtol: float = RTOL
    #: gloo collective timeout (MEGASCALE_DIST_TIMEOUT_S): how long a group's
    #: healthy ranks wait for a stopped peer before they fail.
    dist_timeout_s: int = 30
    #: elastic.timeout_s: a cross-replica collective or heal. A killed peer
    #: resets its connections at once, so this only bounds a silent one; at
    #: 10 s an overloaded host (load average 45 on 2 cores) failed healthy
    #: groups with "Timed out waiting 10000ms for recv".
    elastic_timeout_s: float = 20.0
    #: elastic.quorum_timeout_s: how long a group's quorum request waits for a
    #: killed lighthouse to be back (its manager server asks again about every
    #: second, membership.quorum_retries); longer, its group exits and the
    #: replacement resumes from the checkpoint.
    quorum_timeout_s: float = 30.0
    heartbeat_timeout_ms: int = 3000
    checkpoint_interval: int = 25
    #: Size of the checkpoint tmpfs (MiB): room for keep_last checkpoints and a save in flight.
    checkpoint_fs_mb: int = 64
    #: data.num_workers of every group and the reference: one data-loader
    #: worker per rank, so ``hang_data_worker`` has a process to stop (0 skips that class).
    data_workers: int = 1
    #: Warm standby groups the supervisor keeps ready to replace a lost group.
    spares: int = 1
    #: Stop firing at ``duration_s`` even if planned faults are left (a
    #: soak on a loaded host); otherwise every planned fault fires.
    cut_off: bool = False
    #: Seconds a straggler or a flood lasts.
    stall_s: float = 10.0
    #: A fault not recovered from after this long counts as unrecovered.
    fault_deadline_s: float = 240.0
    startup_timeout_s: float = 400.0
    python: str = sys.executable


def job_overrides(cfg: ChaosConfig, ckpt_dir: Path, ledger: Path) -> list[str]:
    return [*JOB_OVERRIDES, f"data.path={cfg.data_dir}", "train.steps=10000000", f"elastic.ledger_dir={ledger}",
            f"elastic.quorum_timeout_s={cfg.quorum_timeout_s:g}", f"elastic.timeout_s={cfg.elastic_timeout_s:g}",
            f"checkpoint.dir={ckpt_dir}", f"checkpoint.interval={cfg.checkpoint_interval}",
            "checkpoint.async_save=true", "checkpoint.save_at_end=false", "checkpoint.resume=auto",
            f"data.num_workers={cfg.data_workers}",
            *capabilities.watchdog_overrides(cfg.dist_timeout_s / 2, cfg.elastic_timeout_s + 5, cfg.elastic_timeout_s),
            *cfg.overrides]


def _mount_tmpfs(path: Path, mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


class ChaosRun:
    """Runs :class:`ChaosConfig` once (:meth:`execute`); holds every process until :meth:`close`."""

    def __init__(self, cfg: ChaosConfig):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.ledger = self.run_dir / "ledger"
        skipped = capabilities.unavailable(cfg.data_workers)
        self.mounted = "ckpt_enospc" not in skipped and _mount_tmpfs(self.ckpt_dir, cfg.checkpoint_fs_mb)
        if "ckpt_enospc" not in skipped and not self.mounted:
            skipped["ckpt_enospc"] = capabilities.NEEDS_ROOT_MOUNT
        if cfg.kinds is None:  # the default plan leaves out what this checkout cannot detect
            skipped.update({k: v for k, v in capabilities.undetected().items() if k not in skipped})
        wanted = cfg.kinds if cfg.kinds is not None else list(FAULT_CLASSES)
        self.skipped = {k: v for k, v in skipped.items() if k in wanted}
        self.kinds = [k for k in wanted if k not in skipped]
        overrides = job_overrides(cfg, self.ckpt_dir, self.ledger)
        self.sup = Supervisor(self.run_dir / "groups", GroupCommand(JOB_CONFIG, overrides, nproc=cfg.nproc,
                                                                    python=cfg.python),
                              slots=cfg.slots, env={"MEGASCALE_DIST_TIMEOUT_S": str(cfg.dist_timeout_s)},
                              heartbeat_timeout_ms=cfg.heartbeat_timeout_ms, spares=cfg.spares)
        self.reference_overrides = [o for o in overrides if not o.startswith(("checkpoint.", "elastic."))]
        self.progress = Progress()
        self.reference: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------------ run
    def _poll(self) -> None:
        self.sup.poll()
        self.progress.scan(self.sup.history)

    def _wait(self, until: float) -> None:
        while time.monotonic() < until:
            self._poll()
            time.sleep(0.2)

    def start_reference(self) -> None:
        """The fault-free run: one group of the same layout, not elastic,
        same seed and data, its own ledger; stopped once past the chaos run's last step."""
        out = self.run_dir / "reference"
        out.mkdir(parents=True, exist_ok=True)
        argv = [self.cfg.python, "-m", "torch.distributed.run", f"--nproc-per-node={self.cfg.nproc}",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", "pretrain_llava.py", "--config",
                JOB_CONFIG, *self.reference_overrides, f"logging.output_dir={out}",
                f"elastic.ledger_dir={self.run_dir / 'reference-ledger'}"]
        self.reference = self.sup.spawn(argv, self.run_dir / "reference.log")

    def execute(self) -> dict:
        cfg = self.cfg
        t_launch = time.monotonic()
        self.sup.start()
        self.start_reference()
        deadline = t_launch + cfg.startup_timeout_s
        while not any(c.participants == cfg.slots for c in self.progress.seen):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no step with all {cfg.slots} groups within {cfg.startup_timeout_s:g}s; "
                                   f"see {self.sup.run_dir}")
            self._wait(time.monotonic() + 0.5)
        t0 = time.monotonic()
        startup_s = t0 - t_launch
        plan = make_plan(cfg.seed, cfg.duration_s, self.kinds, cfg.slots, cfg.faults,
                         first_s=min(5.0, cfg.duration_s / 10)) if self.kinds else []
        ctx = Context(self.sup, self.progress, cfg.data_dir, self.ckpt_dir, cfg.slots, random.Random(cfg.seed),
                      stall_s=cfg.stall_s)
        # Faults are fired one at a time, each once the job has recovered from
        # the previous one; with cut_off, those still due when duration_s is up are not fired.
        results = [self._run_fault(ctx, fault, t0) for fault in plan
                   if not cfg.cut_off or time.monotonic() < t0 + cfg.duration_s]
        self._wait(t0 + cfg.duration_s)
        t_end = time.monotonic()
        return self._finish(plan, results, startup_s, t_end - t0)

    def _ready_for(self, fault: Fault) -> bool:
        """Every slot trains (a step committed with all of them since the
        target's group started) and the target's ranks are up."""
        inc = self.sup.current.get(fault.slot)
        return (inc is not None and inc.exit_code is None and len(self.sup.ranks(fault.slot)) == self.cfg.nproc
                and any(c.participants == self.cfg.slots for c in self.progress.commits_after(inc.started)))

    def _run_fault(self, ctx: Context, fault: Fault, t0: float) -> dict:
        self._wait(t0 + fault.at_s)
        deadline = time.monotonic() + self.cfg.fault_deadline_s
        while not self._ready_for(fault) and time.monotonic() < deadline:
            self._wait(time.monotonic() + 0.5)
        inj: Injector = INJECTORS[fault.kind](fault)
        row = {**fault.to_json(), "fired_s": None, "detected_s": None, "recovered_s": None, "target": "",
               "note": "", "step_fired": self.progress.last_step(), "step_recovered": None}
        try:
            inj.fire(ctx)
            row["fired_s"] = round(inj.fired - t0, 2)
            self.sup.actions.append({"t": inj.fired, "action": "fault", "kind": fault.kind, "target": inj.target})
            log.warning("fault %d %s at %.1fs: %s", fault.index, fault.kind, inj.fired - t0, inj.target)
            deadline = inj.fired + self.cfg.fault_deadline_s
            while time.monotonic() < deadline:
                self._poll()
                inj.tick(ctx)
                if inj.recovered(ctx):
                    row["recovered_s"] = round(time.monotonic() - inj.fired, 2)
                    break
                time.sleep(0.2)
        except Exception as exc:  # reported in the result; the run goes on with the next fault
            row["note"] = f"injection failed: {type(exc).__name__}: {exc}"
        finally:
            inj.cleanup(ctx)
        det = inj.detected(ctx)
        row["detected_s"] = None if det is None else round(det - inj.fired, 2)
        row["target"], row["note"] = inj.target, row["note"] or inj.note
        row["step_recovered"] = self.progress.last_step() if row["recovered_s"] is not None else None
        self.sup.actions.append({"t": time.monotonic(), "action": "fault over", "kind": fault.kind,
                                 "recovered": row["recovered_s"] is not None})
        log.warning("fault %d %s: detected %s s, recovered %s s %s", fault.index, fault.kind, row["detected_s"],
                    row["recovered_s"], row["note"])
        return row

    # -------------------------------------------------------------- proofs
    def _stop_reference(self, last: int) -> dict[int, float]:
        """Wait until the reference run has passed ``last``; stop it; its step -> loss."""
        ref = SimpleNamespace(replica_id="reference", output_dir=str(self.run_dir / "reference"))
        probe = Progress()
        deadline = time.monotonic() + 900
        while probe.last_step() < last and time.monotonic() < deadline:
            if self.reference.poll() is not None:
                break
            probe.scan([ref])
            time.sleep(0.5)
        probe.scan([ref])
        kill_process_tree(self.reference)
        return {r["step"]: r["loss"] for r in probe.records.get("reference", [])}

    def _epochs(self) -> dict[str, int]:
        """Replica id -> the lighthouse incarnation it trained under: the one
        running when it first committed a step (when it started, if never)."""
        first = {}
        for c in self.progress.seen:
            first.setdefault(c.replica_id, c.t)
        return {inc.replica_id: self.sup.epoch_at(first.get(inc.replica_id, inc.started)) for inc in self.sup.history}

    def _finish(self, plan: list[Fault], results: list[dict], startup_s: float, chaos_s: float) -> dict:
        self.sup.actions.append({"t": time.monotonic(), "action": "stop"})
        self.sup.drain_all()
        self.sup.stop()
        self.progress.scan(self.sup.history)
        epoch = self._epochs()
        starts = self.sup.lighthouse_wall_starts  # per line where it carries quorum_t, else per group
        records = [checks.with_epochs([{**r, "epoch": epoch.get(rid, 0)} for r in recs], starts)
                   for rid, recs in self.progress.records.items()]
        merged, record_problems = checks.merge_step_records(records)
        last = max(merged, default=0)
        reference = self._stop_reference(last)
        loss_problems = checks.loss_mismatches(merged, reference, self.cfg.rtol)
        ledger = checks.with_epochs([{**r, "epoch": epoch.get(r["replica"], 0)} for r in read_ledger(self.ledger)],
                                    starts)
        ledger_problems = checks.ledger_problems(ledger, read_ledger(self.run_dir / "reference-ledger"), last)
        n_ckpt, ckpt_problems = checks.checkpoint_problems(self.ckpt_dir)
        self.close()
        leftovers = processes_of_run(self.sup.token)
        lost = report.uncommitted_attempts(ledger)
        for row in results:
            row["steps_lost"] = report.steps_lost(row, lost)
        # ETTR over the chaos window: from the first step with every group to the last commit seen.
        first = min((c.t for c in self.progress.seen if c.participants == self.cfg.slots), default=0.0)
        wall = max(c.t for c in self.progress.commits.values()) - first if merged else 0.0
        times = [merged[s]["step_s"] for s in merged if self.progress.commits[s].t >= first]
        ratio, typical = report.ettr(times, wall)
        rows = report.class_table(results, self.skipped)
        unrecovered = [f"fault {r['index']} {r['kind']}: not recovered within {self.cfg.fault_deadline_s:g}s "
                       f"({r['note']})" for r in results if r["recovered_s"] is None]
        result = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.cfg).items()},
            "startup_s": round(startup_s, 1), "chaos_s": round(chaos_s, 1), "last_step": last,
            "committed_steps_in_window": len(times), "typical_step_s": typical, "ettr": ratio,
            "rtol": self.cfg.rtol, "worst_loss_rel_diff": checks.worst_loss_difference(merged, reference),
            "loss_rel_diff_profile": checks.loss_difference_profile(merged, reference),
            "checkpoints_verified": n_ckpt, "uncommitted_attempts": sum(lost.values()),
            "rolled_back_steps": checks.rolled_back_steps(r for recs in records for r in recs),
            "faults_planned": len(plan), "faults_not_fired": len(plan) - len(results),
            "faults": results, "classes": rows, "skipped": self.skipped,
            "problems": {
                "records": record_problems, "loss": loss_problems[:50], "ledger": ledger_problems[:50],
                "checkpoints": ckpt_problems, "leftover_processes": leftovers,
                "interventions": checks.intervention_problems(self.sup.actions), "unrecovered": unrecovered,
            },
        }
        result["ok"] = not any(result["problems"].values())
        (self.run_dir / "chaos-result.json").write_text(json.dumps(result, indent=1))
        self.sup.write_actions(self.run_dir / "actions.jsonl")
        return result

    def close(self) -> None:
        """Every process of the run killed and reaped; the checkpoint tmpfs stays mounted until :meth:`unmount`."""
        self.sup.stop()
        if self.reference is not None:
            kill_process_tree(self.reference)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.ckpt_dir)], capture_output=True)
            self.mounted = False


def run_chaos(cfg: ChaosConfig) -> dict:
    """Run ``cfg``; every process is gone and the checkpoint tmpfs unmounted on return, whatever happened."""
    run = ChaosRun(cfg)
    try:
        return run.execute()
    finally:
        run.close()
        run.unmount()


def summary(result: dict) -> str:
    """The printed outcome: the per-class table, ETTR, the proofs."""
    p = result["problems"]
    loss = "OK" if not p["loss"] else f"{len(p['loss'])} steps over, e.g. {p['loss'][0]}"
    lines = [report.format_table(result["classes"]), "",
             f"steps committed: {result['last_step']} ({result['committed_steps_in_window']} in the "
             f"{result['chaos_s']:.0f} s fault window; start-up {result['startup_s']:.0f} s); "
             f"faults fired {len(result['faults'])} of {result['faults_planned']} planned; "
             f"steps redone after a fall-back to a checkpoint {result['rolled_back_steps']}; "
             f"ETTR {result['ettr']:.3f} (typical step {result['typical_step_s']:.3f} s)",
             f"loss vs fault-free reference: worst relative difference {result['worst_loss_rel_diff']:.1e} "
             f"(tolerance {result['rtol']:.0e}): {loss}",
             "worst relative loss difference per 250 steps: " + ", ".join(
                 f"{a}-{b} {d:.1e}" for a, b, d in result.get("loss_rel_diff_profile", [])),
             f"sample ledger exactly-once: {'OK' if not p['ledger'] else p['ledger'][:3]}",
             f"checkpoints verified: {result['checkpoints_verified']}, broken: {len(p['checkpoints'])}",
             f"leftover processes: {len(p['leftover_processes'])}; interventions: {len(p['interventions'])}; "
             f"unrecovered faults: {len(p['unrecovered'])}",
             f"RESULT: {'OK' if result['ok'] else 'FAILED'}"]
    return "\n".join(lines)
