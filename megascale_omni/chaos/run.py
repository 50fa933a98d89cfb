"""A chaos run: an elastic LLaVA job under a seeded fault plan, a fault-free
reference run of the same seed beside it, and the proofs at the end
(:mod:`megascale_omni.chaos.checks`). Entry: ``tools/chaos.py``."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from megascale_omni.chaos import capabilities, checks, report
from megascale_omni.chaos.faults import INJECTORS, Context, Injector
from megascale_omni.chaos.observe import Progress
from megascale_omni.chaos.plan import FAULT_CLASSES, Fault, make_plan
from megascale_omni.chaos.reference import ReferenceRuns, Segment
from megascale_omni.chaos.scheduled import SchedulerProcess, live_config
from megascale_omni.chaos.supervisor import GroupCommand, Supervisor, free_port, processes_of_run
from megascale_omni.elastic.ledger import read_ledger

log = logging.getLogger(__name__)

#: The job: tiny LLaVA, replica groups of PP2 with the distributed optimizer
#: and async checkpoints; constant LR 1e-6 (see RTOL).
JOB_CONFIG = "examples/llava/tiny_cpu.yaml"
JOB_OVERRIDES = (
    "parallel.pp=2", "parallel.use_distributed_optimizer=true", "model.num_layers=2", "vision.num_layers=1",
    "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_interval=0",
    "train.lr_decay_style=constant", "train.lr=1e-6", "train.min_lr=1e-6", "train.lr_warmup_steps=0",
    "logging.tensorboard=false", "logging.progress_bar=false", "logging.log_interval=100",
)
#: Relative loss tolerance at every committed step against the reference.
#: What separates the runs is fp32 summation order: a step summed over 2
#: groups adds the same per-sample gradients in another order than one group
#: does (1e-7 relative per step), and Adam carries that forward, growing
#: with the steps and the LR. Measured on this job at LR 1e-5: 1.6e-7 over
#: 533 steps, but past 1e-4 at step 651 of a 6489-step soak against one
#: uninterrupted reference, and, re-anchored at step 500, 1.3e-7 up to step
#: 729 and then an exponential climb to 2e-3 by step 855 (an e-fold every
#: ~13 steps: a stretch of the trajectory where Adam's normalised update
#: amplifies any perturbation). Two levers bound it: LR 1e-6 (Adam's update,
#: and so the amplification per step, scales with the LR; the proof is about
#: which samples and which sums each step used, not about learning) and the
#: re-anchored reference (:mod:`megascale_omni.chaos.reference`), which
#: restarts from a copy of the job's own checkpoint every ``anchor_every``
#: steps, so no comparison spans more than ``anchor_every`` plus one
#: checkpoint interval of steps (525 by default) whatever the run's length.
#: A lost, repeated or foreign sample changes that step's loss by 1e-2 or
#: more (one of ~40 samples of the global batch; independent of the LR), two
#: orders above RTOL. The exactly-once ledger check does not depend on this
#: tolerance.
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
    #: watchdog.heartbeat_timeout_s: a SIGSTOPped rank is named by its peers
    #: this long after its last heartbeat (the watchdog polls every second),
    #: instead of after the collective limit; the other group waits on the
    #: stuck one about this long.
    watchdog_heartbeat_s: float = 5.0
    #: watchdog.data_wait_timeout_s: a rank whose data-loader worker is
    #: stopped names it after this long (a micro-batch of this job takes
    #: milliseconds; its first ones, with the workers' start-up, are judged
    #: by the step limit instead).
    watchdog_data_wait_s: float = 8.0
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
    stall_s: float = 5.0
    #: Groups of ``slots`` that the live scheduler (omni-sched run) keeps
    #: when ``kill_scheduler`` is planned (:mod:`megascale_omni.chaos.scheduled`);
    #: the harness's supervisor keeps the others.
    scheduler_groups: int = 1
    #: Steps between the job's checkpoints the reference re-anchors on (see RTOL).
    anchor_every: int = 500
    #: Niceness of the reference segments: they take the CPU the job leaves idle.
    reference_nice: int = 19
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
            *capabilities.watchdog_overrides(cfg.watchdog_data_wait_s, cfg.elastic_timeout_s + 5, cfg.elastic_timeout_s,
                                             cfg.watchdog_heartbeat_s),
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
        scheduled = cfg.scheduler_groups if "kill_scheduler" in self.kinds else 0
        if not 1 <= cfg.slots - scheduled:
            raise ValueError(f"slots={cfg.slots}: with {scheduled} group(s) kept by the live scheduler the harness "
                             "needs one more of its own")
        overrides = job_overrides(cfg, self.ckpt_dir, self.ledger)
        self.sup = Supervisor(self.run_dir / "groups", GroupCommand(JOB_CONFIG, overrides, nproc=cfg.nproc,
                                                                    python=cfg.python),
                              slots=cfg.slots - scheduled, env={"MEGASCALE_DIST_TIMEOUT_S": str(cfg.dist_timeout_s)},
                              heartbeat_timeout_ms=cfg.heartbeat_timeout_ms, spares=cfg.spares)
        self.scheduler: Optional[SchedulerProcess] = None
        if scheduled:
            live = live_config(self.run_dir / "scheduler", JOB_CONFIG, overrides, self.sup.lighthouse_addr,
                               scheduled, cfg.nproc)
            self.scheduler = SchedulerProcess(self.run_dir / "scheduler", live, self.sup.spawn, self.sup.actions,
                                              cfg.python)
        # The reference is fault-free: it reads a copy of the data set taken before any fault, so a segment
        # started while a shard_corrupt fault holds a shard bad does not refuse it (the 2026-12-03 soak lost
        # two segments so). Same bytes, so the same data digests as the job's checkpoints. Hard links where
        # the file system allows (no disk for a large --data set): shard_corrupt puts a new file at the
        # shard's path (os.replace), so the link keeps the original bytes.
        reference_data = self.run_dir / "reference-data"
        shutil.rmtree(reference_data, ignore_errors=True)
        try:
            shutil.copytree(cfg.data_dir, reference_data, copy_function=os.link)
        except OSError:  # another file system (EXDEV) or no links there: a real copy
            shutil.rmtree(reference_data, ignore_errors=True)
            shutil.copytree(cfg.data_dir, reference_data)
        self.reference_overrides = [o for o in overrides if not o.startswith(("checkpoint.", "elastic.", "data.path="))]
        self.reference_overrides.append(f"data.path={reference_data}")
        self.progress = Progress()
        self.references = ReferenceRuns(self.run_dir, self._reference_argv, self.sup.spawn, cfg.anchor_every)

    # ------------------------------------------------------------------ run
    def _groups(self) -> list:
        """Every group incarnation of the job: the supervisor's and the scheduler's."""
        return [*self.sup.history, *(self.scheduler.groups.values() if self.scheduler else ())]

    def _poll(self) -> None:
        self.sup.poll()
        if self.scheduler is not None:
            self.scheduler.poll()
        self.progress.scan(self._groups())
        self._watch_faults()
        self.references.tick(self.ckpt_dir)

    def _wait(self, until: float) -> None:
        while time.monotonic() < until:
            self._poll()
            time.sleep(0.2)

    def _reference_argv(self, seg: Segment, out: Path, anchor: Optional[Path]) -> list[str]:
        """A reference segment: one fixed group of the same layout, not elastic, same seed and data, its own
        ledger, at ``reference_nice``; resumed from ``anchor`` (a copy of the job's checkpoint) unless None."""
        resume = ([f"checkpoint.dir={out / 'checkpoints'}", "checkpoint.interval=0", "checkpoint.save_at_end=false",
                   f"checkpoint.resume={anchor}"] if anchor is not None else [])
        return ["nice", "-n", str(self.cfg.reference_nice), self.cfg.python, "-m", "torch.distributed.run",
                f"--nproc-per-node={self.cfg.nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                "pretrain_llava.py", "--config", JOB_CONFIG, *self.reference_overrides, *resume,
                f"logging.output_dir={out}", f"elastic.ledger_dir={out / 'ledger'}"]

    def execute(self) -> dict:
        cfg = self.cfg
        t_launch = time.monotonic()
        self.sup.start()
        # Imported here, while the groups start, not at the first fault that needs them: the checkpoint
        # package imports torch and megatron (seconds; 18-30 s at load average 30-100), which delayed the
        # first data-worker hang's firing by that long.
        from megascale_omni.checkpoint import layout, write_workers  # noqa: F401
        if self.scheduler is not None:
            self.scheduler.start()
        deadline = t_launch + cfg.startup_timeout_s
        while not any(c.participants == cfg.slots for c in self.progress.seen):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no step with all {cfg.slots} groups within {cfg.startup_timeout_s:g}s; "
                                   f"see {self.sup.run_dir}")
            self._wait(time.monotonic() + 0.5)
        t0 = self.t0 = time.monotonic()
        startup_s = t0 - t_launch
        plan = make_plan(cfg.seed, cfg.duration_s, self.kinds, self.sup.slots, cfg.faults,
                         first_s=min(5.0, cfg.duration_s / 10)) if self.kinds else []
        ctx = Context(self.sup, self.progress, cfg.data_dir, self.ckpt_dir, cfg.slots, random.Random(cfg.seed),
                      stall_s=cfg.stall_s, checkpoint_interval=cfg.checkpoint_interval, scheduler=self.scheduler)
        # Faults are fired one at a time, each once the job has recovered from the previous one, except
        # that a background fault (one that only starts a group that must be refused) runs beside the next
        # ones; with cut_off, those still due when duration_s is up are not fired.
        self.ctx, self.active, results = ctx, [], []
        for fault in plan:
            if cfg.cut_off and time.monotonic() >= t0 + cfg.duration_s:
                break
            results.append(self._run_fault(ctx, fault, t0))
        while self.active:
            self._wait(time.monotonic() + 0.5)
        self._wait(t0 + cfg.duration_s)
        t_end = time.monotonic()
        return self._finish(plan, results, startup_s, t_end - t0)

    def _not_ready(self, fault: Fault) -> str:
        """Why the job is not ready for ``fault`` ("" when it is): every slot trains (a step committed with all
        of them since the target's group started), the target's ranks are up, and no active background fault
        conflicts with it."""
        inc = self.sup.current.get(fault.slot)
        if inc is None or inc.exit_code is not None:
            return f"slot {fault.slot} has no running group"
        if len(self.sup.ranks(fault.slot)) != self.cfg.nproc:
            return f"{inc.replica_id}: not all {self.cfg.nproc} ranks up"
        if not any(c.participants == self.cfg.slots for c in self.progress.commits_after(inc.started)):
            return f"no step with all {self.cfg.slots} groups since {inc.replica_id} started"
        busy = [inj.fault.kind for inj, _ in self.active if inj.conflicts(fault.kind)]
        return f"{busy[0]} still active" if busy else ""

    def _run_fault(self, ctx: Context, fault: Fault, t0: float) -> dict:
        """Fire ``fault`` once the job is ready for it (and no background fault it conflicts with is active);
        wait for its recovery unless it is a background fault. Returns its row (completed when it settles)."""
        self._wait(t0 + fault.at_s)
        deadline = time.monotonic() + self.cfg.fault_deadline_s
        waited, why = time.monotonic(), ""
        while time.monotonic() < deadline and (reason := self._not_ready(fault)):
            why = reason
            self._wait(time.monotonic() + 0.5)
        inj: Injector = INJECTORS[fault.kind](fault)
        row = {**fault.to_json(), "fired_s": None, "detected_s": None, "recovered_s": None, "target": "",
               "note": "", "step_fired": self.progress.last_step(), "step_recovered": None,
               "waited_s": round(time.monotonic() - waited, 1), "waited_for": why}
        try:
            inj.fire(ctx)
        except Exception as exc:  # reported in the result; the run goes on with the next fault
            row["note"] = f"injection failed: {type(exc).__name__}: {exc}"
            self._settle(inj, row)
            return row
        row["fired_s"] = round(inj.fired - t0, 2)
        self.sup.actions.append({"t": inj.fired, "action": "fault", "kind": fault.kind, "target": inj.target})
        log.warning("fault %d %s at %.1fs: %s", fault.index, fault.kind, inj.fired - t0, inj.target)
        self.active.append((inj, row))
        while any(i is inj for i, _ in self.active) and not inj.background:
            self._wait(time.monotonic() + 0.2)
        return row

    def _watch_faults(self) -> None:
        """Tick every active fault; settle those recovered or past the per-fault deadline."""
        for inj, row in list(getattr(self, "active", ())):
            try:
                inj.tick(self.ctx)
                if inj.recovered(self.ctx):
                    row["recovered_s"] = round(time.monotonic() - inj.fired, 2)
                elif time.monotonic() < inj.fired + self.cfg.fault_deadline_s:
                    continue
            except Exception as exc:  # reported in the result; the run goes on
                row["note"] = f"injection failed: {type(exc).__name__}: {exc}"
            self.active.remove((inj, row))
            self._settle(inj, row)

    def _settle(self, inj: Injector, row: dict) -> None:
        """A fault is over (recovered, failed or past its deadline): undo what is left of it, complete its row."""
        inj.cleanup(self.ctx)
        det = inj.detected(self.ctx)
        row["detected_s"] = None if det is None else round(det - inj.fired, 2)
        row["target"], row["note"] = inj.target, row["note"] or inj.note
        row["step_recovered"] = self.progress.last_step() if row["recovered_s"] is not None else None
        self.sup.actions.append({"t": time.monotonic(), "action": "fault over", "kind": inj.fault.kind,
                                 "recovered": row["recovered_s"] is not None})
        log.warning("fault %d %s: detected %s s, recovered %s s %s", inj.fault.index, inj.fault.kind,
                    row["detected_s"], row["recovered_s"], row["note"])

    # -------------------------------------------------------------- proofs
    def _epochs(self) -> dict[str, int]:
        """Replica id -> the lighthouse incarnation it trained under: the one
        running when it first committed a step (when it started, if never)."""
        first = {}
        for c in self.progress.seen:
            first.setdefault(c.replica_id, c.t)
        return {inc.replica_id: self.sup.epoch_at(first.get(inc.replica_id, inc.started)) for inc in self._groups()}

    def _finish(self, plan: list[Fault], results: list[dict], startup_s: float, chaos_s: float) -> dict:
        self.sup.actions.append({"t": time.monotonic(), "action": "stop"})
        if self.scheduler is not None:
            self.scheduler.terminate()  # omni-sched drains its groups as it stops
        self.sup.drain_all()
        if self.scheduler is not None:
            self.scheduler.stop()
        self.sup.stop()
        self.progress.scan(self._groups())
        epoch = self._epochs()
        starts = self.sup.lighthouse_wall_starts  # per line where it carries quorum_t, else per group
        records = [checks.with_epochs([{**r, "epoch": epoch.get(rid, 0)} for r in recs], starts)
                   for rid, recs in self.progress.records.items()]
        merged, record_problems = checks.merge_step_records(records)
        last = max(merged, default=0)
        reference, reference_ledger = self.references.finish(last)
        loss_problems = self.references.problems + checks.loss_mismatches(merged, reference, self.cfg.rtol)
        ledger = checks.with_epochs([{**r, "epoch": epoch.get(r["replica"], 0)} for r in read_ledger(self.ledger)],
                                    starts)
        ledger_problems = checks.ledger_problems(ledger, reference_ledger, last)
        n_ckpt, ckpt_problems = checks.checkpoint_problems(self.ckpt_dir)
        self.close()
        leftovers = self._leftovers()
        lost = report.uncommitted_attempts(ledger)
        for row in results:
            row["steps_lost"] = report.steps_lost(row, lost)
        # ETTR over the chaos window: from the first step with every group to the last commit seen.
        first = min((c.t for c in self.progress.seen if c.participants == self.cfg.slots), default=0.0)
        wall = max(c.t for c in self.progress.commits.values()) - first if merged else 0.0
        times = [merged[s]["step_s"] for s in merged if self.progress.commits[s].t >= first]
        ratio, typical = report.ettr(times, wall)
        stalled, unclaimed = report.stalls(
            sorted(c.t for c in self.progress.commits.values() if c.t >= first), typical,
            [(r["index"], self.t0 + r["fired_s"],
              self.t0 + r["fired_s"] + (r["recovered_s"] if r["recovered_s"] is not None else self.cfg.fault_deadline_s))
             for r in results if r["fired_s"] is not None])
        for row in results:
            row["stalled_s"] = round(stalled.get(row["index"], 0.0), 2)
        stalled_s = sum(stalled.values()) + unclaimed
        rows = report.class_table(results, self.skipped)
        unrecovered = [f"fault {r['index']} {r['kind']}: not recovered within {self.cfg.fault_deadline_s:g}s "
                       f"({r['note']})" for r in results if r["recovered_s"] is None]
        result = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.cfg).items()},
            "startup_s": round(startup_s, 1), "chaos_s": round(chaos_s, 1), "last_step": last,
            "committed_steps_in_window": len(times), "typical_step_s": typical, "ettr": ratio,
            # The window's wall time = committed steps at the typical pace (ETTR) + stalls + the rest, steps
            # slower than typical (on this shared host mostly CPU taken by processes starting beside them).
            "stalled_s": round(stalled_s, 1), "stalled_no_fault_s": round(unclaimed, 1),
            "slower_steps_s": round(max(wall + typical - len(times) * typical - stalled_s, 0.0), 1),
            "rtol": self.cfg.rtol, "worst_loss_rel_diff": checks.worst_loss_difference(merged, reference),
            "anchors": sorted(self.references.anchors),
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

    def _leftovers(self, grace_s: float = 10.0) -> list[int]:
        """Processes of the run still alive ``grace_s`` after every launcher was killed: a data-loader worker
        polls its parent's liveness every 5 s (torch's MP_STATUS_CHECK_INTERVAL) and ends by itself within it."""
        deadline = time.monotonic() + grace_s
        while (left := processes_of_run(self.sup.token)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def close(self) -> None:
        """Every process of the run killed and reaped; the checkpoint tmpfs stays mounted until :meth:`unmount`."""
        if self.scheduler is not None:
            self.scheduler.close()
        self.sup.stop()
        self.references.close()

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
             f"ETTR {result['ettr']:.3f} (typical step {result['typical_step_s']:.3f} s); the rest of the window: "
             f"stalls {result['stalled_s']:.0f} s ({result['stalled_no_fault_s']:.0f} s with no fault active), "
             f"steps slower than typical {result['slower_steps_s']:.0f} s",
             f"loss vs fault-free reference ({len(result['anchors'])} anchors): worst relative difference {result['worst_loss_rel_diff']:.1e} "
             f"(tolerance {result['rtol']:.0e}): {loss}",
             "worst relative loss difference per 250 steps: " + ", ".join(
                 f"{a}-{b} {d:.1e}" for a, b, d in result.get("loss_rel_diff_profile", [])),
             f"sample ledger exactly-once: {'OK' if not p['ledger'] else p['ledger'][:3]}",
             f"checkpoints verified: {result['checkpoints_verified']}, broken: {len(p['checkpoints'])}",
             f"leftover processes: {len(p['leftover_processes'])}; interventions: {len(p['interventions'])}; "
             f"unrecovered faults: {len(p['unrecovered'])}",
             f"RESULT: {'OK' if result['ok'] else 'FAILED'}"]
    return "\n".join(lines)
