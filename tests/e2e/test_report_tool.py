"""tools/report.py: plots and summary of a run directory, from synthetic
records with every schema field, from today's field set, from a real short
run, and refusals of bad input (exit 2, one line)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megascale_omni.entry import run_cli
from megascale_omni.metrics.schema import STEP_FIELDS
from tests.launcher import Result, run, train_and_read

pytestmark = pytest.mark.timeout(240)

ALL_PLOTS = {"loss.png", "throughput.png", "step_time.png", "memory.png", "timeline.png"}
TODAY = ("step", "loss", "lr", "grad_norm", "skipped", "loss_tokens", "tokens", "samples", "tokens_per_s",
         "samples_per_s", "step_s", "data_s", "fwd_bwd_s", "optimizer_s", "microbatches")
STEPS = 40


def _report(run_dir: Path, *extra: str) -> Result:
    """tools/report.py's main under run_cli, in this process (exit code and
    both streams as from the command line; one subprocess case below proves
    the script itself)."""
    import importlib

    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.path.insert(0, "tools")  # report.py imports its helper modules beside it when it runs
    try:
        report_tool = importlib.import_module("report")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run_cli(lambda: report_tool.main([str(run_dir), *extra]))
            except SystemExit as e:
                code = int(e.code or 0)
    finally:
        sys.path.remove("tools")
    return Result(code, out.getvalue(), err.getvalue())


def _fmt(v: float) -> str:
    """The summary's number format (megascale_omni.report.run.fmt)."""
    return f"{v:.0f}" if abs(v) >= 1e4 else f"{v:.4g}"


def _step_record(step: int) -> dict:
    """A record with every schema field; the breakdown sums to step_s; 2 replica groups until step 25, then 1."""
    step_s = 0.5 + 0.01 * (step % 7)
    parts = {"data_s": 0.02, "compute_s": 0.3, "pipeline_wait_s": 0.05, "moe_dispatch_s": 0.01, "grad_sync_s": 0.04,
             "cross_replica_s": 0.03, "optimizer_s": 0.03, "checkpoint_s": 0.0, "control_s": 0.001}
    parts["other_s"] = step_s - sum(parts.values())
    rec = {key: 1.0 for key in STEP_FIELDS}  # any field added to the schema later still appears
    rec.update(parts, step=step, loss=5.0 / step + 1.0, lr=1e-3, grad_norm=1.5, skipped=step == 17,
               loss_tokens=1000, tokens=1024, samples=8, images=8, microbatches=4, step_s=step_s,
               fwd_bwd_s=0.42, bubble_analytic=0.2, tokens_per_s=1024 / step_s, samples_per_s=8 / step_s,
               images_per_s=8 / step_s, model_tflop=2.0, tflops_per_device=2.0 / step_s / 4,
               mfu=0.3 + 0.001 * step, mem_allocated_gib=10.0, mem_reserved_gib=12.0,
               mem_peak_gib=11.0 + 0.01 * step, mem_fragmentation=1 / 6, rss_gib=3.0,
               busy_s_median=step_s, busy_s_max=step_s * 1.1, slowest_rank=1,
               stragglers=[1] if step % 10 == 0 else [], participants=2 if step < 25 else 1,
               healed=step == 3, moe_expert_tokens=[[30, 10], [20, 20]], moe_load_max=[1.5, 1.0 + 0.01 * step],
               moe_tokens_dropped=[2, 0] if step % 4 == 0 else [0, 0], moe_aux_loss=1.1, moe_z_loss=0.5)
    return rec


def _write(run_dir: Path, records: list[dict], checkpoints: list[dict] | None = None, junk: tuple = ()) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + list(junk)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if checkpoints is not None:
        (run_dir / "checkpoints.jsonl").write_text("".join(json.dumps(c) + "\n" for c in checkpoints))


def _assert_pngs(report: Path, names: set[str]) -> None:
    assert {p.name for p in report.glob("*.png")} == names
    for name in names:
        path = report / name
        assert path.stat().st_size > 10_000, name
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size[0] >= 600 and im.size[1] >= 300, (name, im.size)
            im.verify()


def test_every_schema_field(tmp_path):
    """All plots, and the summary's numbers equal the ones computed here."""
    records = [_step_record(s) for s in range(1, STEPS + 1)]
    evals = [{"step": s, "eval/loss": 5.0 / s + 1.2} for s in (20, 40)]
    ckpts = [{"step": s, "reason": "interval", "blocking_s": b, "total_s": 2 * b, "bytes": 1000}
             for s, b in ((10, 0.1), (20, 0.2), (30, 0.3), (40, 0.4))]
    _write(tmp_path, records[:20] + evals[:1] + records[20:] + evals[1:], ckpts)
    res = _report(tmp_path, "--smooth", "5")
    assert res.returncode == 0, res.stderr[-3000:]
    report = tmp_path / "report"
    _assert_pngs(report, ALL_PLOTS)
    summary = (report / "summary.md").read_text()
    step_s = np.array([r["step_s"] for r in records])
    assert f"| median step time | {_fmt(float(np.median(step_s)))} s |" in summary
    assert f"| p90 step time | {_fmt(float(np.percentile(step_s, 90)))} s |" in summary
    assert f"| first loss | {_fmt(6.0)} (step 1) |" in summary
    assert f"| min loss | {_fmt(5.0 / STEPS + 1.0)} (step {STEPS}) |" in summary
    assert f"| median tokens/s | {_fmt(float(np.median(1024 / step_s)))} |" in summary
    assert f"| median MFU | {_fmt(float(np.median([r['mfu'] for r in records])))} |" in summary
    assert f"| max mem_peak_gib | {_fmt(11.0 + 0.01 * STEPS)} GiB (step {STEPS}) |" in summary
    assert "| checkpoints | 4 (steps 10, 20, 30, 40; 4 interval) |" in summary
    assert "| median checkpoint blocking time | 0.25 s |" in summary
    assert "| membership changes | 1 (step 25: 2 -> 1 participants) |" in summary
    assert "| skipped steps | 1 (steps 17) |" in summary
    assert "| steps with stragglers flagged | 4; most often slowest: rank 1 |" in summary
    assert f"| last evaluation (step 40) | eval/loss {_fmt(5.0 / 40 + 1.2)} |" in summary
    loads = [(1.5 + 1.0 + 0.01 * s) / 2 for s in range(1, STEPS + 1)]
    assert (f"| MoE expert load max/mean (mean over MoE layers) | first {_fmt(loads[0])} (step 1), median "
            f"{_fmt(float(np.median(loads)))}, last {_fmt(loads[-1])} (step {STEPS}; busiest layer 0: 1.5) |"
            ) in summary
    dropped = f"{2 * (STEPS // 4)} over {STEPS} steps ({STEPS // 4} steps with drops)"
    assert f"| MoE routing choices dropped (capacity) | {dropped} |" in summary
    assert "| median moe_aux_loss | 1.1 |" in summary and "| median moe_z_loss | 0.5 |" in summary
    assert "| moe_dispatch_s | " in summary
    compute_share = float(np.median(0.3 / step_s))
    assert f"| compute_s | {100 * compute_share:.1f}% |" in summary
    assert "fwd_bwd_s |" not in summary  # the fine split replaces the coarse one
    for name in ALL_PLOTS:
        assert f"[{name}]({name})" in summary
    assert "memory.png: " not in summary and "no MFU axis" not in summary


def test_todays_fields_only(tmp_path):
    """No breakdown/memory/MFU fields and no checkpoints.jsonl: the plots that can be
    made are, and the summary lists what is missing."""
    records = [{k: v for k, v in _step_record(s).items() if k in TODAY} for s in range(1, 13)]
    _write(tmp_path, records)
    res = _report(tmp_path, "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_pngs(tmp_path / "out", ALL_PLOTS - {"memory.png"})
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "memory.png: no memory fields" in summary
    assert "MFU: no mfu" in summary and "no MFU axis" in summary
    assert "membership: no participants" in summary
    assert "| checkpoints | 0 (no checkpoints.jsonl) |" in summary
    assert "| fwd_bwd_s |" in summary and "| other (step_s - the rest) |" in summary
    step_s = np.array([r["step_s"] for r in records])
    assert f"| median step time | {_fmt(float(np.median(step_s)))} s |" in summary
    # a second report replaces the first one
    res = _report(tmp_path, "--out", str(tmp_path / "out"), "--smooth", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "moving average over 3 steps" in (tmp_path / "out" / "summary.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "out"]  # no temporary left


def test_job_directory_reports_every_group_and_the_job(tmp_path):
    """An elastic job's directory (one run directory per replica group): a report
    per group, job.png, and job.md naming the slow and straggling group."""
    job = tmp_path / "job"
    groups = {"r0": [], "r1": []}
    for step in range(1, STEPS + 1):
        for name in groups:
            rec = _step_record(step)
            # From step 11 r1 works 0.25 s longer before the cross-replica wait; r0 waits for it.
            slow = name == "r1" and step > 10
            rec["cross_replica_s"] = 0.02 if slow else (0.27 if step > 10 else 0.03)
            groups[name].append(rec)
    groups["r1"] = groups["r1"][:30]  # r1 leaves after step 30
    for name, records in groups.items():
        _write(job / name, records)
    res = _report(job)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 replica groups, 40 job steps" in res.stdout
    report = job / "report"
    _assert_pngs(report, {"job.png"})
    for name in groups:
        _assert_pngs(report / name, ALL_PLOTS)
        assert (report / name / "summary.md").is_file()
    md = (report / "job.md").read_text()
    assert "| replica-group changes | step 31: 2 -> 1 |" in md
    # r1 busy 0.25 s more than r0 (at most 0.57 s vs 0.32 s: not 2x): slowest, never flagged.
    assert "| r1 | 30 |" in md and "| 20 steps | 0 steps |" in md
    assert "| steps with a straggling replica group | 0 |" in md
    # A second report may replace this one: it holds only report files and directories of them.
    sys.path.insert(0, "tools")
    try:
        import report as report_tool
    finally:
        sys.path.remove("tools")
    report_tool.check_out(report)
    (report / "r0" / "notes.txt").write_text("mine")
    with pytest.raises(report_tool.ConfigError):
        report_tool.check_out(report)


def test_real_short_run(tmp_path):
    """A 12-step tiny GPT run with evaluation and checkpoints, then its report."""
    out = tmp_path / "run"
    train_and_read("megascale_omni.smoke", 1,
                   ["--config", "examples/gpt/tiny.yaml", "train.steps=12", "train.eval_interval=6",
                    f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=5", "logging.progress_bar=false"],
                   out, steps=12, timeout=200)
    res = _report(out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "report: 12 steps, 5 plots, 0 malformed line(s) skipped" in res.stdout
    _assert_pngs(out / "report", ALL_PLOTS)  # memory: the process RSS
    summary = (out / "report" / "summary.md").read_text()
    assert "| steps recorded | 12 (1 to 12) |" in summary
    assert "| checkpoints | 3 (steps 5, 10, 12; 1 end, 2 interval) |" in summary
    assert "| last evaluation (step 12) | eval/loss " in summary


@pytest.mark.parametrize("case", ["no-dir", "no-metrics", "empty", "only-junk", "eval-only", "bad-smooth",
                                  "out-not-a-report"])
def test_bad_input_exits_2_with_one_line(tmp_path, case):
    run_dir = tmp_path / "run"
    extra: list[str] = []
    if case != "no-dir":
        run_dir.mkdir()
    if case == "empty":
        (run_dir / "metrics.jsonl").write_text("")
    if case == "only-junk":
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": \n[1, 2]\nnot json\n')
    if case == "eval-only":
        _write(run_dir, [{"step": 6, "eval/loss": 4.5}])
    if case in ("bad-smooth", "out-not-a-report"):
        _write(run_dir, [_step_record(1)])
    if case == "bad-smooth":
        extra = ["--smooth", "0"]
    if case == "out-not-a-report":
        extra = ["--out", str(run_dir)]  # holds metrics.jsonl: never replaced
    res = _report(run_dir, *extra)
    assert res.returncode == 2, (res.returncode, res.output[-3000:])
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), res.stderr
    if case == "only-junk":
        assert "3 malformed line(s) skipped" in lines[0]
    assert not (run_dir / "report").exists()
    if case == "out-not-a-report":
        assert (run_dir / "metrics.jsonl").exists()


def test_malformed_lines_and_resumed_steps(tmp_path):
    """Malformed lines are skipped and counted; steps recorded again after a resume
    (metrics.jsonl is appended to) count once, the later record winning."""
    records = [{k: v for k, v in _step_record(s).items() if k in TODAY} for s in (1, 2, 3, 4, 5, 4, 5)]
    records[-1]["loss"] = 0.5
    _write(tmp_path, records, junk=('{"step": 6, "loss": 1.', "[]", "\x00\x01garbage"))
    res = _report(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "report: 5 steps, 4 plots, 3 malformed line(s) skipped" in res.stdout
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "3 malformed line(s) skipped" in summary
    assert "| steps recorded | 5 (1 to 5); 2 earlier record(s) of re-run steps replaced by the later ones " \
           "(1 resume(s)) |" in summary
    assert "| last loss | 0.5 (step 5) |" in summary


def test_the_script_from_the_command_line(tmp_path):
    """The script itself (the cases above call its main in-process): a run
    directory without metrics.jsonl exits 2 with one line, no traceback."""
    res = run([sys.executable, "tools/report.py", str(tmp_path)], timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.output
    assert res.stderr.strip().splitlines() == [f"config error: RUN_DIR={str(tmp_path)!r}: has no metrics.jsonl "
                                               "(logging.output_dir of a training run)"]
