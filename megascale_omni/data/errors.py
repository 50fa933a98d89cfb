"""Data errors that end a run with a readable message (not a traceback).

Entry points (:func:`megascale_omni.entry.run_cli`) print ``data error: <message>``
as one line and exit with code 3 for every :class:`DataQualityError`,
including :class:`DataFileError`.
"""

from __future__ import annotations

import os


class DataQualityError(RuntimeError):
    """Too many bad samples, or a data file the run cannot use: the dataset
    needs attention before training continues."""


class DataFileError(DataQualityError):
    """A whole data file is unusable: a shard index, a shard or a tokenizer
    that is missing, unreadable, malformed or does not match its manifest.

    Fatal (unlike a bad sample, which is skipped and counted) because the
    set as a whole cannot be trusted. The message is one line: the file, the
    problem and the fix.

    Attributes:
        path: the offending file.
        problem: what is wrong with it.
        fix: what the user should do.
    """

    def __init__(self, path: str | os.PathLike, problem: str, fix: str):
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        super().__init__(f"{self.path}: {problem}; {fix}")

    def __reduce__(self):  # keep the fields when pickled across processes
        return (type(self), (self.path, self.problem, self.fix))
