#!/usr/bin/env bash
# The GPU suite on a CUDA host whose image has Python 3.12 and a CUDA torch
# but none of our other dependencies and no package index:
#
#   tools/gpu_ci/run.sh [WHEELS]      # from the repository root; default build/gpu-wheels
#
# WHEELS holds tools/gpu_ci/prepare_wheels.sh's cp312 wheels. A venv over the
# image's torch (--system-site-packages) gets them with --no-index --no-deps;
# the package itself is imported from the checkout (PYTHONPATH), since
# setup.py targets the Python 3.11 CPU install. Then: tests/gpu, and
# benchmarks/gpu_mfu.py on the local spec + SDPA. Logs and JSON go to $OUT
# (default runs/gpu-ci). Whole run capped at GPU_CI_BUDGET_S (default 540 s, inside
# a 10-minute command limit).
set -uo pipefail

WHEELS=${1:-build/gpu-wheels}
OUT=${OUT:-runs/gpu-ci}
BUDGET=${GPU_CI_BUDGET_S:-540}
VENV=${GPU_CI_VENV:-/tmp/omni-gpu-venv}
PY3=${PYTHON:-python3}
START=$(date +%s)
mkdir -p "$OUT"
left() { echo $((BUDGET - ($(date +%s) - START))); }

{
    echo "== host"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
    "$PY3" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/host.txt"

"$PY3" -m venv --system-site-packages "$VENV" || exit 3
"$VENV/bin/python" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl 2>&1 | tee "$OUT/install.txt" || exit 3
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$VENV/bin/python" -c 'import megatron.core, torchft, tokenizers, webdataset, megascale_omni; print("imports ok: megatron-core", megatron.core.__version__)' \
    2>&1 | tee -a "$OUT/install.txt" || exit 3

# tests/gpu: per-test limits from the tests' own timeout marks; the suite gets what is left minus the benchmark's 150 s.
timeout --signal=TERM --kill-after=20 $(( $(left) - 150 )) \
    "$VENV/bin/python" -m pytest tests/gpu -m gpu -v -s -p no:cacheprovider --junitxml="$OUT/tests-gpu.xml" \
    2>&1 | tee "$OUT/tests-gpu.log"
TESTS_RC=${PIPESTATUS[0]}

timeout --signal=TERM --kill-after=10 $(( $(left) > 30 ? $(left) - 10 : 20 )) \
    "$VENV/bin/python" benchmarks/gpu_mfu.py --json "$OUT/gpu_mfu.json" 2>&1 | tee "$OUT/gpu_mfu.log"
BENCH_RC=${PIPESTATUS[0]}

echo "tests/gpu exit $TESTS_RC, gpu_mfu exit $BENCH_RC, $(( $(date +%s) - START )) s" | tee "$OUT/summary.txt"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
