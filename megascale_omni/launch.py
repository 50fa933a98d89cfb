"""``omni-run``: torchrun that checks the job config before any worker starts.

    omni-run --nproc-per-node 2 pretrain_llava.py --config examples/llava/tiny_cpu.yaml train.steps=50
    omni-run --nnodes 2 --nproc-per-node 8 --rdzv-endpoint host:29500 pretrain_dit.py --config ...
    omni-run --standalone --nproc-per-node 2 -m megascale_omni.smoke --config examples/gpt/tiny.yaml

Takes exactly torchrun's arguments (``torch.distributed.run``). Under plain
torchrun a config error that every worker detects ends as exit 1 and the
launcher's ``ChildFailedError`` traceback; here the entry point's config is
parsed and validated for the launched world size (``nnodes * nproc_per_node``)
first, so a bad config exits 2 with the same one line as a one-process run
and nothing starts. Then torchrun's own launcher runs the workers, and a
worker failure is summed up in one line with the worker's exit code passed on
(2 config, 3 data, 4 checkpoint, 44 failed pre-flight check, 43 a rank hung:
docs/hang-detection.md; 1 otherwise) instead of a traceback; the
workers' own messages stay above it.

Scripts it knows (``pretrain_llava.py``, ``pretrain_dit.py``,
``-m megascale_omni.smoke``) are validated for their model family;
``-m megascale_omni.preflight`` (docs/preflight.md) has its config parsed and
range-checked; any other script is launched unchecked.

Inside a Slurm allocation, run once per node (``srun --ntasks-per-node=1
omni-run ...``): the node count, workers per node and a c10d rendezvous
on the first node come from Slurm's environment unless given
(``megascale_omni/slurm.py``; one line says what was derived). Outside
Slurm nothing is derived. SIGUSR1 to ``omni-run`` reaches its workers (a
checkpoint, training continues). See docs/multi-node.md. ``omni-run`` adopts
what a dead worker leaves behind (its checkpoint writers, data workers) and
ends it when torchrun returns (:func:`end_leftovers`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional, Sequence

from megascale_omni.config import ConfigError
from megascale_omni.errors import EXIT_HUNG, EXIT_PREFLIGHT_FAILED
from megascale_omni.utils.processes import adopt_orphans, end_descendants

logger = logging.getLogger(__name__)

#: Entry script (file name, or module with -m) -> the model family it trains.
FAMILY_OF_ENTRY = {"pretrain_llava.py": "llava", "pretrain_dit.py": "dit", "megascale_omni.smoke": "gpt"}
#: Entry modules that read a job config but train no family (docs/preflight.md): their
#: config is parsed and range-checked before launch, without a family's validation.
CONFIG_ONLY_ENTRIES = ("megascale_omni.preflight",)
#: Worker exit codes that mean "the user can fix this" (see megascale_omni.entry.run_cli).
USER_ERROR_CODES = (2, 3, 4, EXIT_PREFLIGHT_FAILED)
#: Worker exit codes passed on as they are: the user errors and a hang torn down by the watchdog.
PASSED_ON_CODES = (*USER_ERROR_CODES, EXIT_HUNG)


def _entry_of(args) -> str:
    return args.training_script if args.module else os.path.basename(args.training_script)


def _family_of(args) -> Optional[str]:
    return FAMILY_OF_ENTRY.get(_entry_of(args))


def _world_size(args) -> Optional[int]:
    """Processes torchrun will start, or None for an elastic node range (MIN:MAX)."""
    from torch.distributed.run import determine_local_world_size

    if ":" in str(args.nnodes):
        low, high = str(args.nnodes).split(":", 1)
        if low != high:
            return None
        args.nnodes = low
    try:
        nodes = int(args.nnodes)
        per_node = determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        raise ConfigError("--nnodes/--nproc-per-node", f"{args.nnodes}/{args.nproc_per_node}",
                          f"{e}; give positive integers") from None
    if nodes < 1 or per_node < 1:
        raise ConfigError("--nnodes/--nproc-per-node", f"{nodes}/{per_node}", "must both be >= 1")
    return nodes * per_node


def check_job(args) -> None:
    """Parse and validate the entry point's config for the launched world size
    (raises ConfigError; does nothing for a script we do not know)."""
    from megascale_omni.entry import parse_for_family
    from megascale_omni.platform.device import check_device
    from megascale_omni.tasks.registry import get_family

    family = _family_of(args)
    if family is None and _entry_of(args) in CONFIG_ONLY_ENTRIES:
        from megascale_omni.config import load_job_config

        load_job_config(args.training_script_args)
        return
    if family is None:
        logger.warning("omni-run: %s is not a megascale-omni entry point; launching it unchecked",
                       args.training_script)
        return
    world = _world_size(args)
    if world is None:  # elastic node range: per-section checks and the family only
        from megascale_omni.config import load_job_config

        cfg = load_job_config(args.training_script_args)
        get_family(family).validate(cfg, cfg.parallel.model_parallel_size)
        return
    cfg, _ = parse_for_family(family, args.training_script_args, world_size=world)
    check_device(cfg.platform.device)
    # The pipeline plan and its memory check (parallel.pipeline_memory_gib):
    # each worker repeats it, but only after megatron's import; refuse here first.
    import torch

    cuda = cfg.platform.device != "cpu" and torch.cuda.is_available()
    get_family(family).plan_pipeline(cfg, cuda=cuda, world_size=world)


def prepare(args, argv: Sequence[str]) -> None:
    """Fill ``args`` from a Slurm allocation (if inside one), then :func:`check_job`
    for the world size that results (raises ConfigError)."""
    from megascale_omni.slurm import apply_slurm

    derived = apply_slurm(args, argv, os.environ)
    if derived is not None:  # one line like the failure summary's: it is part of the launcher's answer
        sys.stderr.write(f"omni-run: {derived}\n")
    check_job(args)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``omni-run``: validate, then launch through torchrun (exit code as described above)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from megascale_omni.entry import run_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run_cli(lambda: prepare(args, argv))
    forward_sigusr1_to_workers()
    adopt_orphans()
    try:
        run(args)
    except ChildFailedError as e:
        rank, code = first_failure(e.failures)
        sys.stderr.write(f"omni-run: {len(e.failures)} worker(s) failed; first: rank {rank} exited with code "
                         f"{code} (its message is above)\n")
        sys.exit(code if code in PASSED_ON_CODES else 1)
    finally:
        end_leftovers()


def end_leftovers() -> None:
    """End what torchrun's workers left behind (every node's omni-run, once
    torchrun returned). torchrun signals the process group of each worker
    still alive when the job ends, not that of a worker that died: the
    children of a SIGKILLed worker (a rank killed by the hang watchdog or an
    OOM killer) would live on under init. :func:`adopt_orphans` (at start)
    re-parents them to this process instead; here they are killed."""
    left = end_descendants()
    if left:
        sys.stderr.write(f"omni-run: ended {left} process(es) that dead workers left behind\n")


def forward_sigusr1_to_workers() -> None:
    """From now on SIGUSR1 to this process is sent on to its child processes,
    torchrun's workers, each of which then saves a checkpoint at the next step
    boundary (docs/checkpoints.md), and the agent keeps running.

    Schedulers signal the launcher (Slurm's ``--signal=USR1@T``, ``scancel
    --signal=USR1``), but torchrun starts each worker in a session of its
    own, and its agent does not handle SIGUSR1: it would die at once and
    the workers would never hear of it. torchrun's ``--signals-to-handle``
    is no way out: it treats every signal it handles as the end of the job
    and stops the workers. Where the scheduler signals the workers as well,
    a worker gets it twice within microseconds: one flag, one save, unless a
    step boundary's vote falls between the two (docs/checkpoints.md,
    "SIGUSR1 bursts").
    """
    import signal

    import psutil

    def forward(signum, frame) -> None:
        for child in psutil.Process().children():
            try:
                child.send_signal(signal.SIGUSR1)
            except psutil.NoSuchProcess:
                pass  # exited since it was listed

    signal.signal(signal.SIGUSR1, forward)


def first_failure(failures: dict) -> tuple[int, int]:
    """``(rank, exit code)`` of the worker whose failure caused the others':
    the earliest one that exited on its own (code > 0); torchrun then
    terminates the rest (negative codes: killed by a signal). Falls back to
    the earliest failure of all."""
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    own = [(rank, f) for rank, f in ordered if f.exitcode > 0]
    rank, failure = (own or ordered)[0]
    return rank, failure.exitcode


if __name__ == "__main__":
    main()
