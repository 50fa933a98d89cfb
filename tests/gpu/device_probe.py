"""Run a training entry point and check, at every optimizer step, where the
model and its inputs live.

    python -m tests.gpu.device_probe --device cuda --dtype bfloat16 --report DIR TARGET [args ...]

``TARGET`` is a script (``pretrain_llava.py``) or a module
(``megascale_omni.smoke``). At every step each rank checks that every
parameter of its model chunks is on a ``--device`` device with dtype
``--dtype``, and that every tensor of every micro-batch the model is given
(what megatron's schedule hands ``forward_step``) is on a ``--device``
device; a mismatch raises (the run fails). Each rank writes what it saw to
``DIR/rank<R>.json`` after every step. Test-only: production code carries no
probes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tests.fault_injection import run_target


def _tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def install(device: str, dtype: str, report: Path) -> None:
    from megascale_omni.training import trainer

    seen = {"rank": int(os.environ.get("RANK", "0")), "steps": 0, "parameters": 0, "param_devices": [],
            "param_dtypes": [], "batches": 0, "batch_tensors": 0, "batch_devices": []}
    original = trainer.train_step

    def checked_batches(iterator):
        for batch in iterator:
            devices = {str(t.device) for t in _tensors(batch)}
            wrong = sorted(d for d in devices if not d.startswith(device))
            assert not wrong, f"a micro-batch reached the model on {wrong}, not {device}"
            seen["batches"] += 1
            seen["batch_tensors"] += sum(1 for _ in _tensors(batch))
            seen["batch_devices"] = sorted(set(seen["batch_devices"]) | devices)
            yield batch

    def probed_train_step(chunks, optimizer, scheduler, forward_step_func, *args, **kwargs):
        params = [p for c in chunks for p in c.parameters()]
        devices = {str(p.device) for p in params}
        dtypes = {str(p.dtype).removeprefix("torch.") for p in params}
        assert all(d.startswith(device) for d in devices), f"parameters on {sorted(devices)}, not {device}"
        assert dtypes == {dtype}, f"parameter dtypes {sorted(dtypes)}, not {dtype}"

        def forward_step(data_iterator, model):
            if isinstance(data_iterator, list):  # interleaved schedule: one iterator per chunk
                return forward_step_func([checked_batches(it) for it in data_iterator], model)
            return forward_step_func(checked_batches(data_iterator), model)

        stats = original(chunks, optimizer, scheduler, forward_step, *args, **kwargs)
        seen["steps"] += 1
        seen["parameters"] = len(params)
        seen["param_devices"], seen["param_dtypes"] = sorted(devices), sorted(dtypes)
        report.mkdir(parents=True, exist_ok=True)
        (report / f"rank{seen['rank']}.json").write_text(json.dumps(seen))
        return stats

    trainer.train_step = probed_train_step


def main(install_probe=install, description: str = __doc__.splitlines()[0]) -> None:
    """The command line; ``install_probe(device, dtype, report)`` is this
    probe's :func:`install` or one that extends it (tests/dtype_probe.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", required=True, help="cuda or cpu")
    parser.add_argument("--dtype", required=True, help="torch dtype name of every parameter, e.g. bfloat16")
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("target")
    args, rest = parser.parse_known_args()
    install_probe(args.device, args.dtype, args.report)
    run_target(args.target, rest)


if __name__ == "__main__":
    main()
