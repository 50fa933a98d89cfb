"""Pre-flight health checks (``omni-preflight``; docs/preflight.md).

Before a job trains, and before an elastic replica group joins the quorum
(``preflight.enabled``), every rank checks its device (a timed matmul; on
CUDA also free memory and NVML's ECC/XID counters), the group's all-reduce
bandwidth, the checkpoint directories' write throughput and free space, a
sample of the data shards, and its clock against rank 0's. A failed check
ends the group with one line naming node, check, measured and expected
value, exit code 44 and a JSON result file a scheduler reads
(:func:`~megascale_omni.preflight.result.read_report`).

One module per check (:mod:`.device` with :mod:`.nvml`, :mod:`.collective`,
:mod:`.checkpoint_dir`, :mod:`.data`, :mod:`.clock`); :mod:`.runner` runs
them and decides; :mod:`.result` is the record, the line and the file
(stdlib only). Imports config, platform and data; never training or models.
"""
