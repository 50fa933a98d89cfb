"""Config section of the pre-flight health checks (``preflight:``).

The checks themselves live in :mod:`megascale_omni.preflight`; this section
only declares their thresholds and sample sizes. Every default is sized for
a GPU node (a floor a healthy one clears with margin, a broken one does not);
docs/preflight.md says why each value, and how to measure your own.
A top-level section (not a field of ``platform``) like every other: one
level deep for ``section.field=value`` overrides and the generated reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megascale_omni.config.constraints import check_fields, checked


@dataclass
class PreflightConfig:
    """Health checks on every rank before training (docs/preflight.md); also ``omni-preflight`` by hand."""

    #: Run the checks automatically on every rank before a job trains and
    #: before an elastic replica group joins the quorum; a failed check ends
    #: the group with exit code 44 and a JSON result file. ``omni-preflight``
    #: runs them whatever this says.
    enabled: bool = False
    #: CUDA: floor of a timed bf16 matmul, TFLOP/s per device (an A100 reaches
    #: about 250, an H100 about 600; a throttled or broken device far less).
    min_matmul_tflops: float = checked(100.0, gt=0)
    #: CPU runs: floor of a timed fp32 matmul, GFLOP/s per process.
    min_cpu_matmul_gflops: float = checked(1.0, gt=0)
    #: Side of the square matmul operands; ``null`` = 8192 on CUDA, 1024 on CPU.
    matmul_size: Optional[int] = checked(None, gt=0)
    #: Timed matmuls (after one untimed warm-up).
    matmul_iters: int = checked(10, gt=0)
    #: CUDA: free device memory before the job starts, as a fraction of the
    #: device's total (another process's leftovers show up here).
    min_free_memory_fraction: float = checked(0.9, ge=0, le=1)
    #: CUDA with NVML (``pynvml``): most volatile uncorrected ECC errors allowed.
    max_ecc_errors: int = checked(0, ge=0)
    #: CUDA with NVML: most critical XID events allowed while the checks run.
    max_xid_events: int = checked(0, ge=0)
    #: Floor of the group's all-reduce bus bandwidth, GB/s (nccl-tests'
    #: ``busbw``: algorithm bandwidth x 2(n-1)/n). NVLink or InfiniBand clear
    #: 10 with margin; a group fallen back to TCP sockets does not.
    min_allreduce_gb_s: float = checked(10.0, gt=0)
    #: Size of the all-reduced fp32 buffer, MiB.
    allreduce_mib: float = checked(256.0, gt=0)
    #: Timed all-reduces (after one untimed warm-up).
    allreduce_iters: int = checked(5, gt=0)
    #: Floor of each rank's write throughput into ``checkpoint.dir`` (and
    #: ``checkpoint.local_dir``), MB/s, measured with every rank writing at once.
    min_checkpoint_write_mb_s: float = checked(100.0, gt=0)
    #: Floor of the free space of each checkpoint directory's file system, GiB.
    min_checkpoint_free_gib: float = checked(50.0, ge=0)
    #: Bytes each rank writes (and fsyncs) to measure that throughput, MiB.
    checkpoint_probe_mib: float = checked(64.0, gt=0)
    #: Shards of each dataset (``data.path`` and every ``data.blend`` source)
    #: that each rank opens and checks (size, sha256, one sample's tar
    #: headers); ranks take different shards. 0 = no data check.
    data_sample_shards: int = checked(2, ge=0)
    #: Ceiling of the difference between a rank's clock and rank 0's, ms.
    max_clock_skew_ms: float = checked(100.0, gt=0)
    #: Clock readings per rank (the median offset counts).
    clock_rounds: int = checked(5, gt=0)
    #: ``omni-preflight`` only: seconds a collective may take before the run
    #: fails (a dead or hung peer); a training job keeps its own timeout.
    timeout_s: float = checked(300.0, gt=0)
    #: JSON result file written by rank 0 (pass or fail); empty =
    #: ``<logging.output_dir>/preflight.json``.
    result_file: str = ""

    def __post_init__(self) -> None:
        check_fields(self, "preflight")
