"""Launch real multi-process jobs for tests: free ports, hard timeouts, and
cleanup of the whole process group (no stray ranks survive a failed test)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from megascale_omni.utils.processes import kill_process_tree as kill_group  # the tests' name for it

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def spawn(cmd: Sequence[str], timeout: float, env: dict | None = None, cwd: Path = REPO) -> subprocess.Popen:
    """Start ``cmd`` in its own session (signal it with ``os.killpg``); pair with :func:`finish`."""
    # Launched jobs run on this host's loopback: the variables of a Slurm allocation the tests may run
    # in (omni-run would derive a multi-node launch from them) and torchrun's PET_* defaults stay out.
    # A test that simulates Slurm passes its own in ``env``.
    inherited = {name: value for name, value in os.environ.items() if not name.startswith(("SLURM_", "PET_"))}
    full_env = {**inherited, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    # Collectives must fail fast if a peer dies rather than outlive the test.
    full_env.setdefault("MEGASCALE_DIST_TIMEOUT_S", str(int(max(timeout - 10, 10))))
    # Output goes to temporary files, not pipes: a long run that nobody reads
    # while it runs must not block on a full pipe.
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=full_env, stdout=out, stderr=err, start_new_session=True)
    proc._megascale_logs = (out, err)  # type: ignore[attr-defined]
    return proc


def run(cmd: Sequence[str], timeout: float, env: dict | None = None, cwd: Path = REPO) -> Result:
    """Run ``cmd`` in its own session; on timeout kill the whole group and fail loudly."""
    return finish(spawn(cmd, timeout, env, cwd), timeout)


def finish(proc: subprocess.Popen, timeout: float) -> Result:
    """Wait for a :func:`spawn`-ed process; kill its whole group on timeout (and always after)."""
    cmd = proc.args if isinstance(proc.args, list) else [str(proc.args)]
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stderr tail ---\n{_read(proc)[1][-4000:]}")
    finally:
        kill_group(proc)
    out, err = _read(proc)
    return Result(proc.returncode, out, err)


def _read(proc: subprocess.Popen) -> tuple[str, str]:
    texts = []
    for f in proc._megascale_logs:  # type: ignore[attr-defined]
        f.seek(0)
        texts.append(f.read())
    return texts[0], texts[1]


def torchrun_cmd(nproc: int, target: str, args: Sequence[str], fail_at_step: int | None = None,
                 inject: Sequence[str] = ()) -> list[str]:
    """``torchrun --nproc-per-node nproc <target> args`` on a free loopback port.

    ``target`` is a script path (``pretrain_llava.py``) or a module name
    (``megascale_omni.smoke``, run with ``-m``). ``fail_at_step``: step N
    raises on every rank; ``inject``: other tests/fault_injection.py flags
    (e.g. a slow rank).
    """
    entry = [target] if target.endswith(".py") else ["-m", target]
    flags = ([f"--fail-at-step={fail_at_step}"] if fail_at_step is not None else []) + list(inject)
    if flags:
        entry = ["-m", "tests.fault_injection", *flags, target]
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        *entry, *args,
    ]


def run_tool_in_process(script: str | Path, *args) -> Result:
    """Run a tool script (``tools/hf_import.py``) the way its command line
    does, ``run_cli(main)`` (one-line errors, exit codes 2/3/4), but in this
    process, without a new interpreter's torch/transformers import (5-15 s per
    run here). For cases about what a tool answers, not about process
    behaviour; each tool keeps at least one real command-line run elsewhere.

    Returns the exit status (``SystemExit``, else ``main``'s int return value, else 0) and what
    was written to ``sys.stdout``/``sys.stderr``, log records of level WARNING
    and above included (as an unconfigured subprocess prints them). Any other
    exception escapes: where a subprocess would print a traceback, the test
    fails. Environment variables the tool sets (a one-process tool's
    rendezvous: RANK, MASTER_PORT, ...) are undone afterwards.
    """
    import importlib.util
    import io
    import logging

    from megascale_omni.entry import run_cli

    path = REPO / script
    spec = importlib.util.spec_from_file_location(f"tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    code = 0
    saved_env = dict(os.environ)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            returned = []
            run_cli(lambda: returned.append(module.main([str(a) for a in args])))
        # A tool whose ``__main__`` is ``sys.exit(main())`` reports through the return value.
        code = returned[0] if returned and isinstance(returned[0], int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):  # sys.exit("message"): the interpreter prints it
            err.write(f"{e.code}\n")
    finally:
        logging.getLogger().removeHandler(handler)
        os.environ.clear()
        os.environ.update(saved_env)
    return Result(code, out.getvalue(), err.getvalue())


def launch_cmd(nproc: int, target: str, args: Sequence[str], fail_at_step: int | None = None) -> list[str]:
    """:func:`torchrun_cmd`, except that one process runs under plain ``python``:
    the entry points then start the same one-rank gloo group themselves
    (``init_distributed``: RANK 0, WORLD_SIZE 1, a free loopback port), so the
    same code runs without the torchrun agent's own interpreter and torch
    import (~4 s per launch on the 2-core CI machine)."""
    if nproc != 1:
        return torchrun_cmd(nproc, target, args, fail_at_step)
    entry = [target] if target.endswith(".py") else ["-m", target]
    if fail_at_step is not None:
        entry = ["-m", "tests.fault_injection", f"--fail-at-step={fail_at_step}", target]
    return [sys.executable, *entry, *args]


def torchrun(
    nproc: int, target: str, args: Sequence[str], timeout: float, env: dict | None = None,
    fail_at_step: int | None = None,
) -> Result:
    """Run :func:`launch_cmd` to completion (``torchrun`` for ``nproc > 1``,
    plain ``python`` for one process)."""
    return run(launch_cmd(nproc, target, args, fail_at_step), timeout=timeout, env=env)


@contextlib.contextmanager
def spawn_torchrun(
    nproc: int, target: str, args: Sequence[str], timeout: float, env: dict | None = None
) -> Iterator[subprocess.Popen]:
    """Start :func:`torchrun_cmd` in the background for tests that talk to the
    job while it runs (wait on it yourself; read its log with :func:`output_of`).
    The whole process group is killed on exit, whatever happened."""
    proc = spawn(torchrun_cmd(nproc, target, args), timeout, env)
    try:
        yield proc
    finally:
        kill_group(proc)
        proc.wait()


def output_of(proc: subprocess.Popen) -> str:
    """stdout + stderr of a :func:`spawn`-ed process so far."""
    out, err = _read(proc)
    return out + err


def read_metrics(output_dir: str | Path) -> list[dict]:
    """Per-step training records (records with a ``loss`` key) from metrics.jsonl."""
    path = Path(output_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def wait_for_record(output_dir: str | Path, step: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Block until ``output_dir/metrics.jsonl`` has a record of ``step`` or later;
    fail if ``proc`` exits first or the deadline passes."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"training exited before step {step}:\n{output_of(proc)[-3000:]}"
        try:
            if any(r["step"] >= step for r in read_metrics(output_dir)):
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass  # not written yet, or a line half-written
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def train_and_read(
    target: str, nproc: int, args: Sequence[str], output_dir: str | Path, steps: int, timeout: float
) -> list[dict]:
    """Run a training entry point under :func:`torchrun` (plain ``python`` for
    one process) and return its per-step records, asserting a clean exit and
    exactly ``steps`` consecutive steps."""
    return read_training(start_training(target, nproc, args, output_dir, timeout), output_dir, steps, timeout)


def start_training(
    target: str, nproc: int, args: Sequence[str], output_dir: str | Path, timeout: float
) -> subprocess.Popen:
    """:func:`train_and_read`'s run, started in the background (pair with
    :func:`read_training`): independent one-process runs can then share the
    2 cores of the CI host."""
    proc = spawn(launch_cmd(nproc, target, [*args, f"logging.output_dir={output_dir}", "logging.tensorboard=false"]),
                 timeout)
    proc._megascale_what = f"{target} x{nproc} {' '.join(args)}"  # type: ignore[attr-defined]
    return proc


def read_training(proc: subprocess.Popen, output_dir: str | Path, steps: int, timeout: float) -> list[dict]:
    """Wait for a :func:`start_training` run; its per-step records, asserting a
    clean exit and exactly ``steps`` consecutive steps."""
    res = finish(proc, timeout)
    assert res.returncode == 0, f"{proc._megascale_what} failed:\n{res.stderr[-5000:]}"  # type: ignore[attr-defined]
    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return records


def relative_differences(baseline: list[dict], records: list[dict], key: str) -> list[float]:
    """Per-step ``|got - ref| / |ref|`` of ``key`` (0.0 where both are 0)."""
    return [abs(g[key] - r[key]) / abs(r[key]) if r[key] else abs(g[key]) for r, g in zip(baseline, records)]


def assert_same_training(
    baseline: list[dict], records: list[dict], name: str, rtol: float, grad_rtol: float,
    counters: Sequence[str] = (), lr_rtol: float | None = None,
) -> tuple[float, float]:
    """Every per-step loss within ``rtol`` and grad norm within ``grad_rtol``
    (relative) of ``baseline``, lr within ``lr_rtol`` if given, equal
    ``counters`` per step. Prints and returns the worst relative loss and
    grad-norm differences (the measured numbers quoted in docs/testing.md)."""
    assert [r["step"] for r in records] == [r["step"] for r in baseline]
    loss = relative_differences(baseline, records, "loss")
    grad = relative_differences(baseline, records, "grad_norm")
    print(f"\n{name}: worst relative difference over {len(records)} steps: loss {max(loss):.2e}, "
          f"grad norm {max(grad):.2e}")
    per_step = [(r["step"], f"{lo:.1e}", f"{gr:.1e}") for r, lo, gr in zip(records, loss, grad)]
    assert max(loss) <= rtol, f"{name}: loss differs by more than {rtol:.0e} relative; (step, loss, grad): {per_step}"
    assert max(grad) <= grad_rtol, f"{name}: grad norm differs by more than {grad_rtol:.0e}; {per_step}"
    if lr_rtol is not None:
        assert max(relative_differences(baseline, records, "lr")) <= lr_rtol, name
    for key in counters:
        assert [r[key] for r in records] == [r[key] for r in baseline], key
    return max(loss), max(grad)


def gloo_rank(rank: int, port: int, world: int, out_dir: str, body: Callable[[], dict]) -> None:
    """The body of a :func:`run_spawned_ranks` worker on a CPU platform:
    joins the ``world``-rank gloo group on ``port`` (60 s timeout), runs
    ``body()`` and writes its result, or ``{"error": traceback}``, to
    ``rank{rank}.json``. ``body`` tears down what it sets up."""
    import datetime
    import traceback

    import torch.distributed as dist

    from megascale_omni.platform import init_platform

    try:
        init_platform("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = body()
    except Exception:  # reported to the test, which fails with it
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_spawned_ranks(worker, world: int, out_dir: Path, timeout: float) -> list[dict]:
    """Run ``worker(rank, port, out_dir)`` in ``world`` spawned processes (a
    free port for their rendezvous); each writes ``rank{r}.json`` with its
    result, or ``{"error": traceback}``. Kills stragglers after ``timeout``
    and fails with the first missing or failed rank; returns the results."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, str(out_dir)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = []
    for r in range(world):
        path = Path(out_dir) / f"rank{r}.json"
        assert path.is_file(), f"rank {r} wrote no result (exit code {procs[r].exitcode})"
        data = json.loads(path.read_text())
        assert "error" not in data, f"rank {r} failed:\n{data['error']}"
        results.append(data)
    return results
