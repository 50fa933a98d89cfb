"""GPT smoke trainer: ``python -m megascale_omni.smoke [--config F] [k=v ...]``.

Runs under plain ``python`` (one rank) and ``torchrun --nproc-per-node N``.
Writes ``<logging.output_dir>/metrics.jsonl`` with one record per step.
"""

from megascale_omni.entry import run_cli, train_family


def cli() -> None:
    """Console-script entry (``omni-smoke``)."""
    run_cli(lambda: train_family("gpt", __doc__))


if __name__ == "__main__":
    cli()
