"""Reports of finished runs from their records (``tools/report.py``).

:mod:`.run` loads a run's ``metrics.jsonl``/``checkpoints.jsonl`` and holds
the statistics, :mod:`.plots` draws the PNGs (matplotlib, the ``report``
extra), :mod:`.summary` writes ``summary.md``, :mod:`.job` puts an elastic
job's replica groups side by side, and :mod:`.write` builds the report
directory and renames it into place. Nothing here imports torch.
"""
