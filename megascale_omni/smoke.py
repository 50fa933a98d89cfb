"""GPT smoke trainer: ``python -m megascale_omni.smoke [--config F] [k=v ...]``.

Runs under plain ``python`` (one rank) and ``torchrun --nproc-per-node N``.
Writes ``<logging.output_dir>/metrics.jsonl`` with one record per step.
"""

from megascale_omni.config import parse_job_config, run_cli


def main() -> None:
    cfg = parse_job_config(description=__doc__)
    # Imported after parsing so a config error exits before megatron loads.
    from megascale_omni.tasks.gpt_smoke import GptSmokeTask
    from megascale_omni.training.trainer import run_training

    run_training(cfg, GptSmokeTask)


def cli() -> None:
    """Console-script entry (``omni-smoke``)."""
    run_cli(main)


if __name__ == "__main__":
    cli()
