"""Checkpoint errors that end a run with a readable message (not a traceback)."""


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be loaded, or a save could not complete.

    Entry points turn it into exit code 4 and one line on stderr.
    """
