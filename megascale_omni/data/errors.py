"""Data errors that end a run with a readable message (not a traceback)."""


class DataQualityError(RuntimeError):
    """Too many bad samples: the dataset needs attention before training continues."""
