"""Every benchmark command in BENCHMARKS.md runs as written, at ``--quick`` sizes.

The command is taken from the document itself (``- Command: `...` ``), with
its optional ``[...]`` arguments given and ``--quick`` appended, so a renamed
script, a dropped flag or an API change in a benchmark fails here instead of
rotting until someone re-measures. Only exit code 0 and the shape of the
printed result are checked: quick numbers mean nothing.
"""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest

from tests.launcher import REPO, run

#: Lines each benchmark's output must contain (regular expressions, searched per line).
EXPECTED = {
    "packing_efficiency": [
        r"^samples 500 ",
        r"^method\s+efficiency\s+rows$",
        r"^packed \(best-fit\)\s+[\d.]+\s+\d+$",
        r"^pad to longest sample\s+[\d.]+\s+500$",
        r"^ratio [\d.]+x useful tokens per row",
    ],
    "control_overhead": [
        r"^micro-benchmark, 40 calls, 2 ranks gloo \(means per call\):",
        r"^  before: one exchange, \d+ x float64 .*: [\d.]+ us$",
        r"^  after: two exchanges, 25 \+ \d+ x float64 .*: [\d.]+ us$",
        r"^  ratio after / before: [\d.]+x$",
        r"^  boundary as the Trainer runs it .*: [\d.]+ us$",
        r"^  bare all-reduce of 1 x float32 .* ratio boundary / baseline: [\d.]+x$",
        r"^  stand-in step .* \+ before .* \+ after .* with a blocking exchange instead",
        r"^in situ, tiny GPT DP=2, 5 steps:",
        r"^  boundary [\d.]+ us .* -> [\d.]+% of a step",
    ],
    "dit_buckets": [
        r"^500 images; buckets \(HxW:tokens x batch\): ",
        *(rf"^dp={dp}, {4 * dp} packages/step, \d+ steps$" for dp in (2, 4, 8)),
        *(rf"^rank token imbalance \(max/mean, dp={dp}\)\s+max [\d.]+" for dp in (2, 4, 8)),
        r"^padding waste\s+[\d.]+%\s+[\d.]+% \(pad to largest\)",
    ],
    "checkpoint_async": [
        r"^checkpoint size: [\d.]+ GB; saves per run: 3$",
        r"^\| mode \| training blocked per save \(s\) \| save complete after \(s\) \|$",
        r"^\| sync \(baseline\) \| [\d.]+ \| [\d.]+ \|$",
        r"^\| async \| [\d.]+ \| [\d.]+ \|$",
        r"^ratio async blocking / sync save: [\d.]+",
        r"^\| save \| wait \| state_dict \| split \| host_copy \| plan \| blocked \|$",
        *(rf"^\| step {step} \|( [\d.]+ \|){{6}}$" for step in (1, 2, 3)),
    ],
    "pipeline_partition": [
        r"^config examples/llava/pp4_vit_heavy.yaml, PP=4, 1 measured steps",
        r"^mode\s+rank\s+layers\s+predicted\s+measured\s+diff\s+median step$",
        *(rf"^{mode}\s+{rank}\s+\d+\s+[\d.]+\s+[\d.]+\s+[+-][\d.]+%\s+[\d.]+$"
          for mode in ("uniform", "auto") for rank in range(4)),
        r"^mode\s+max/mean predicted\s+max/mean measured\s+step wall s$",
        r"^measured slowest stage: uniform / auto = [\d.]+x",
    ],
    "metrics_overhead": [
        r"^\| layout \| steps \| median step \| median metrics \| metrics / step \(median\) \| \(p90\) \|$",
        *(rf"^\| {layout} \| 7 \| [\d.]+ ms \| [\d.]+ ms \| [\d.]+% \| [\d.]+% \|$" for layout in ("DP2", "PP2")),
    ],
    "watchdog_overhead": [
        r"^training thread, stand-in PP2 step with 8 micro-batches, 200 steps x 15 rounds:$",
        r"^  phase clock alone \(baseline\): [\d.]+ us per step$",
        r"^  with the heartbeat listening: [\d.]+ us per step; ratio [\d.]+x$",
        r"^  added -?[\d.]+ us per step = -?[\d.]+% of the tiny GPT's PP2 step",
        *(rf"^  {n} watched peer\(s\): \d+ us per poll = [\d.]+% of one core at poll_s=5" for n in (1, 8)),
    ],
    "scheduler_sim": [
        *(rf"^trace {name}, noise 0:$" for name in ("two_jobs", "diurnal_vm")),
        *(rf"^\| {policy} \| [\d.]+ \| " for policy in ("elastic", "static", "greedy", "pollux")),
        r"^moves/hour ratio elastic / greedy at noise 0.2: [\d.]+ \(worst of 1 seeds\)$",
        r"^reclaim deadlines met \(elastic, noisy runs\): \d+/\d+$",
        r"^workload philly_20jobs_16gpus_seed1, noise \+-0.2:$",
        r"^mean over 1 workload seeds:$",
    ],
    "elastic_join": [
        r'^  "pinned_cpus": \{',  # --pin from the documented command
        r'^  "standby_join": \{',
        r"^latency: cold join [\d.]+ s, standby join [\d.]+ s, restart\+reload [\d.]+ s",
        r"^survivor lost step times at the join: cold -?[\d.]+, standby -?[\d.]+",
    ],
    "elastic_shard": [
        r"^model: GPT 4 layers, hidden 64; 2 replica groups x inner DP 2 \(TP1 PP1\), 4 steps; rank 0 of r0$",
        r"^\| whole on every rank \(baseline\) \| \d+ \| \d+ \| [\d.]+ ms \|$",
        r"^\| distributed \(sharded\) \| \d+ \| \d+ \| [\d.]+ ms \|$",
        r"^ratio sharded / whole: bytes 0\.5\d+, optimizer state 0\.5\d+ \(1/inner DP = 0\.5000\), step time [\d.]+$",
        r"^loss, sharded vs whole, max relative difference over \d+ steps: [\d.e+-]+$",
    ],
    "elastic_overhead": [
        r"^round  static ms \|    vote ms  quorum  x-repl  ratio \| overlap ms  quorum  x-repl  ratio \|"
        r"    lone ms  quorum  x-repl  ratio$",
        r"^    0 +[\d.]+" + r" \| +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+" * 3 + "$",
        *(rf"^elastic \({label}\) / non-elastic, median over 1 rounds: [\d.]+ \(min [\d.]+, max [\d.]+\)$"
          for label in ("quorum awaited, vote", "quorum overlapped, vote", "overlapped, lone commit")),
        r"^ +static +vote +overlap +lone$",
        *(rf"^ +{key} +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$" for key in ("step_s", "grad_sync_s", "cross_replica_s")),
    ],
    "heal_transport": [
        r"^state: 0\.008 GiB in 8 fp32 tensors \+ metadata; 1 round\(s\)",
        *(rf"^transfer {kind}: median [\d.]+ \(min [\d.]+, max [\d.]+\) GB/s$" for kind in ("http", "pg")),
        r"^ratio pg / http throughput \(baseline http\): median [\d.]+ ",
        *(rf"^join {kind}: median [\d.]+ \(min [\d.]+, max [\d.]+\) s; heal median " for kind in ("http", "pg")),
        r"^ratio pg / http join latency \(baseline http\): median [\d.]+ ",
    ],
    "loader_throughput": [
        r"^\(a\) loader alone: 6 steps of 8 packed rows, DP rank 0 of 1",
        r"^\| in-process \| \d+ \| \d+ \| 1\.00x \| [\d.]+ s \| [\d.]+ ms \|$",
        r"^\| 1 \| \d+ \| \d+ \| [\d.]+x \| [\d.]+ s \| [\d.]+ ms \|$",
        r"^\(b\) demo training, 2 processes \(DP2\), 5 steps",
        *(rf"^\| {workers} \| 2 \| [\d.]+ ms \| [\d.]+ ms \| [\d.]+% \|$" for workers in (0, 1)),
    ],
    "plan_startup": [
        r"^samples 500, seq_length 256, 16 tokens per image, 1 repeat\(s\), best of each$",
        r"^\| read every sample's JSON \(baseline\) \| 0 \| [\d.]+ \| [\d.]+ \| 1\.00x \|$",
        r"^\| index.json costs \| 500 \| [\d.]+ \| [\d.]+ \| [\d.]+x faster \|$",
        r"^plans identical: True",
    ],
    "gpu_mfu": [
        r"^model: LLaVA, [\d.]+ M parameters built$",
        r"^LM: 2 layers, hidden 64, 4 heads / 2 query groups, swiglu FFN 128, vocab 256, seq 256$",
        r"^ViT: 1 layers, hidden 32, .* = 16 tokens per image; projector mlp 32 -> 64 -> 64$",
        r"^run: global batch 8 rows, micro-batch 2, float32 on cpu, layer impl local",
        r"^device: cpu, peak unknown \(MFU n/a\)$",
        r"^\| 2 \| [\d.]+ \| [\d.]+ \| \d+ \| [\d.]+ \| [\d.e+-]+ \| [\d.e+-]+ \| n/a \|$",
    ],
    "moe_routing": [
        r"^dispatcher at EP2 \(2 processes, gloo\), 8 steps per run, median over steps 6\.\.8, "
        r"1 run\(s\) each in turn:$",
        r"^\| alltoall \| [\d.]+ \| [\d.]+ \| [\d.]+ \| 1\.000 \|$",
        r"^\| allgather \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$",
        r"^expert load max/mean \(mean over the 4 MoE layers\), 1 process, 6 steps of 8 x 32 tokens",
        *(rf"^\| {name} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$"
          for name in (r"softmax, no balancing \(baseline\)", "softmax, aux loss",
                       r"sigmoid, no balancing \(baseline\)", "sigmoid, aux-loss-free bias")),
    ],
    "attention_path": [
        r"^rounds 1 \(alternating order, after one warm-up step per path\), step = fwd \+ bwd, "
        r"median of process CPU time$",
        r"^\| workload \| segments \| per-segment \(old\) \| packed \(new\) \| new / old \| max logit diff \|$",
        *(rf"^\| {name} \| \d+ \| [\d.]+ ms \| [\d.]+ ms \| [\d.]+ \| [\d.e+-]+ \|$"
          for name in (r"packed GPT, 1 layers, 2 x 128 tokens", r"LLaVA, \d+ images, 2 x 128 tokens")),
    ],
    "context_parallel": [
        r"^model: GPT 2 layers, .* one sequence of 2048 tokens",
        r"^sanity, CP=1: loss plain THD path [\d.]+, ring of one rank [\d.]+, relative difference ",
        r"^\| CP \| tokens per rank \| activations per rank",
        *(rf"^\| {cp} \| {2048 // cp} \| [\d.]+ \| [\d.]+ \| {1 / cp:.3f} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| "
          rf"[\d.]+ \| [\d.e+-]+ \|$" for cp in (1, 2)),
        r"^activation ratio vs ideal: CP=1 [\d.]+x of 1/CP, CP=2 [\d.]+x of 1/CP$",
    ],
    "ingest_jpeg": [
        r"^images 40 JPEG quality 90 at 8 LLaVA sizes",
        r"^source [\d.]+ MB \(images \+ LLaVA JSON\), [\d.]+ kB per record$",
        r"^source bytes \(new\)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x$",
        r"^PNG re-encode \(old\)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x$",
        r"^shard overhead of source bytes: \d+ bytes per sample",
        r"^new / old: [\d.]+x images/s \(cpu\), [\d.]+x bytes on disk$",
    ],
    "video_decode": [
        r"^clips 2 x 30 frames at 48x64, 30 fps \(H.264 mkv / MPEG-4 mp4\), keeping 8 per clip, one process$",
        r"^stage\s+frames/s \(cpu\)\s+frames/s \(wall\)\s+unit$",
        r"^ingest \(count \+ take \+ JPEG\)\s+[\d.]+\s+[\d.]+\s+decoded frames/s$",
        r"^read stored JPEG frames\s+[\d.]+\s+[\d.]+\s+kept frames/s$",
        r"^read from the clip\s+[\d.]+\s+[\d.]+\s+kept frames/s$",
        r"^ingest: [\d.]+ clips/s \(cpu\); decoded 57 frames a clip$",  # 30 to count + 27 up to the last kept
        r"^read per sample: stored frames [\d.]+ ms, from the clip [\d.]+ ms \(cpu\); ratio [\d.]+x$",
        r"^bytes: clips [\d.]+ MB, shards [\d.]+ MB, shards / clips [\d.]+x$",
    ],
    "video_mix_plan": [
        r"^\| video \| budget / micro-batch \| packing efficiency \| rows \| deferred \|",
        r"^\| 0% \| off \| [\d.]+% \| \d+ \| 0 \| \d+ \| [\d.]+ \([\d.]+\) vs [\d.]+ \([\d.]+\) \|",
        r"^\| 20% \| 32 inputs \| [\d.]+% \| \d+ \| \d+ \| \d+ \|",
    ],
    "video_step_time": [
        r"^\| mix \| steps \| median step_s \| median compute_s \|",
        *(rf"^\| {mix} \| 5 \| [\d.]+ \| [\d.]+ \| \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$"
          for mix in ("image-only", "20% video")),
        r"^ratio 20% video / image-only: step_s [\d.]+, compute_s [\d.]+, tower inputs [\d.]+$",
    ],
}

#: Hard limit per run (the whole process tree is killed), generous for a
#: loaded 2-core host: a quick run takes a fraction of it.
TIMEOUT_S = {
    "packing_efficiency": 240,
    "dit_buckets": 240,
    "checkpoint_async": 420,
    "control_overhead": 420,
    "pipeline_partition": 600,
    "metrics_overhead": 300,
    "scheduler_sim": 240,
    "elastic_join": 1200,
    "elastic_shard": 900,
    "elastic_overhead": 600,
    "heal_transport": 300,
    "loader_throughput": 600,
    "context_parallel": 300,
    "attention_path": 300,
    "plan_startup": 240,
    "gpu_mfu": 300,
    "ingest_jpeg": 240,
    "video_decode": 240,
    "moe_routing": 900,
    "video_mix_plan": 240,
    "video_step_time": 600,
    "watchdog_overhead": 240,
}
#: Benchmarks that start several torchrun jobs.
DIST = {"control_overhead", "pipeline_partition", "metrics_overhead", "elastic_join", "loader_throughput",
        "context_parallel", "elastic_shard", "elastic_overhead", "heal_transport", "moe_routing", "video_step_time"}
#: Too long for `make test` even at quick sizes (several torchrun launches
#: each: elastic_join 7 plus a lighthouse; checkpoint_async saves a model
#: several times, 35 s; context_parallel starts 2 processes that each
#: import megatron, over 20 s; elastic_shard 4 torchrun jobs and 2
#: lighthouses; heal_transport 6 processes and 2 lighthouses, about 30 s;
#: gpu_mfu builds and trains a LLaVA, 30-80 s; moe_routing 2 torchrun jobs and 4
#: training runs, minutes on a loaded host; watchdog_overhead, in one process,
#: leaves the hang detection's make-test time to its SIGSTOP test; video_step_time
#: 2 torchrun LLaVA trainings);
#: `make test-all` runs them.
#: The other single-process benchmarks stay in `make test`.
SLOW = {"elastic_join", "control_overhead", "pipeline_partition", "metrics_overhead", "loader_throughput",
        "checkpoint_async", "context_parallel", "elastic_shard", "elastic_overhead", "heal_transport", "gpu_mfu",
        "moe_routing", "watchdog_overhead", "video_step_time"}


def documented_commands() -> dict[str, list[str]]:
    """Benchmark name -> argv of its ``- Command:`` in BENCHMARKS.md, optional
    ``[...]`` arguments included, run by this interpreter."""
    commands = {}
    for text in re.findall(r"^- Command: `([^`]+)`", (REPO / "BENCHMARKS.md").read_text(), re.MULTILINE):
        argv = shlex.split(text.replace("[", " ").replace("]", " "))
        assert argv[0] == ".venv/bin/python" and argv[1].startswith("benchmarks/"), text
        assert (REPO / argv[1]).is_file(), f"BENCHMARKS.md runs a missing script: {text}"
        name = argv[1].removeprefix("benchmarks/").removesuffix(".py")
        assert name not in commands, f"two commands for {name}"
        commands[name] = [sys.executable, *argv[1:]]
    return commands


def test_every_benchmark_has_one_documented_command():
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert set(documented_commands()) == scripts == set(EXPECTED)


def _case(name: str):
    marks = [pytest.mark.timeout(TIMEOUT_S[name] + 60)]
    marks += [pytest.mark.dist] if name in DIST else []
    marks += [pytest.mark.slow] if name in SLOW else []
    return pytest.param(name, marks=marks, id=name)


#: Benchmarks whose quick run is a test of its own below (checking a number too).
OWN_TEST = {"ingest_jpeg"}


@pytest.mark.parametrize("name", [_case(name) for name in EXPECTED if name not in OWN_TEST])
def test_documented_command_runs_quick(name):
    _run_quick(name)


def _run_quick(name: str, *extra) -> None:
    """Run ``name``'s documented command with ``--quick`` and ``extra``; check its exit code and lines."""
    cmd = [*documented_commands()[name], "--quick", *map(str, extra)]
    res = run(cmd, timeout=TIMEOUT_S[name])
    shown = " ".join(cmd[1:])
    assert res.returncode == 0, f"{shown} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    lines = res.stdout.splitlines()
    missing = [pattern for pattern in EXPECTED[name] if not any(re.search(pattern, line) for line in lines)]
    assert not missing, f"{shown}: no line matches {missing}\n--- stdout ---\n{res.stdout[-5000:]}"


@pytest.mark.timeout(TIMEOUT_S["ingest_jpeg"] + 60)
def test_ingest_jpeg_quick_stores_the_source_size(tmp_path):
    """Source bytes take at most 1.02x the source set on disk (a size, not a
    timing); the PNG re-encode, measured in the same run, several times it."""
    _run_quick("ingest_jpeg", "--json", tmp_path / "r.json")
    paths = json.loads((tmp_path / "r.json").read_text())["paths"]
    assert 1.0 < paths["source bytes (new)"]["stored_over_source"] <= 1.02
    assert paths["PNG re-encode (old)"]["stored_over_source"] > 2
