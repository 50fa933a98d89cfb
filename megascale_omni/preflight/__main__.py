"""``python -m megascale_omni.preflight``: the same as ``omni-preflight`` (for torchrun's ``-m``)."""

from megascale_omni.preflight.cli import cli

if __name__ == "__main__":
    cli()
