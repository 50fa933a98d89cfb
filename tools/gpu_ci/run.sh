#!/usr/bin/env bash
# The GPU run on a host whose image has its own torch (e.g. Python 3.12, CUDA
# torch 2.11) but none of our other dependencies and no package index:
#
#   tools/gpu_ci/run.sh [--check-install | --tests-only] [WHEELS]   # default WHEELS: build/gpu-wheels
#
# PYTHON (default python3) is the image's interpreter; it is never replaced
# and no venv is made (a venv over an image that is itself a venv would not
# see the image's torch). WHEELS (tools/gpu_ci/prepare_wheels.sh, built for
# that Python) go in with `pip install --no-index --no-deps --target SITE`,
# and PYTHONPATH is this checkout then SITE: the package itself runs from the
# checkout, where tests/ and benchmarks/ are. Without WHEELS (or with an
# empty folder) the interpreter's environment is used as it is.
#
# Steps, each recorded in OUT/steps.tsv, then merged into OUT/results.json
# (schema: docs/gpu_ci.md):
#   host, install (+ import check)        all modes; --check-install stops here (needs WHEELS)
#   preflight: 2 steps per family         full run only; GPU_CI_PRECISION (bf16), GPU_CI_PREFLIGHT_S (60)
#   tests/gpu (JUnit XML)                 full run and --tests-only (make test-gpu)
#   benchmarks/gpu_mfu.py                 full run only
# A failed pre-flight stops the run (GPU_CI_CONTINUE=1 goes on). The whole run
# stays within GPU_CI_BUDGET_S (540 s). OUT (runs/gpu-ci), SITE
# (GPU_CI_SITE, /tmp/omni-gpu-site). Exit 0 when every step that ran passed;
# 2 bad usage; 3 the install or the import check failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

MODE=full
case "${1:-}" in
    --check-install) MODE=check; shift ;;
    --tests-only) MODE=tests; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    -*) echo "error: unknown option $1; use --check-install, --tests-only or none" >&2; exit 2 ;;
esac
WHEELS=${1:-build/gpu-wheels}
OUT=${OUT:-runs/gpu-ci}
BUDGET=${GPU_CI_BUDGET_S:-540}
PREFLIGHT_S=${GPU_CI_PREFLIGHT_S:-60}
PRECISION=${GPU_CI_PRECISION:-bf16}
SITE=${GPU_CI_SITE:-/tmp/omni-gpu-site}
PY3=${PYTHON:-python3}
BENCH_RESERVE=150  # seconds kept back from tests/gpu for the benchmark
START=$(date +%s)
mkdir -p "$OUT" && rm -f "$OUT"/steps.tsv "$OUT"/results.json
left() { echo $((BUDGET - ($(date +%s) - START))); }

# record NAME RC T0: one line of steps.tsv
record() { printf '%s\t%s\t%s\n' "$1" "$2" $(( $(date +%s) - $3 )) >> "$OUT/steps.tsv"; }
finish() { "$PY3" tools/gpu_ci/record.py merge "$OUT"; exit "$1"; }

T0=$(date +%s)
"$PY3" tools/gpu_ci/record.py host "$OUT" 2>&1 | tee "$OUT/host.txt"
record host "${PIPESTATUS[0]}" "$T0"

T0=$(date +%s)
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    rm -rf "$SITE"
    "$PY3" -m pip install --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl > "$OUT/install.txt" 2>&1
    RC=$?
    tail -3 "$OUT/install.txt"
    export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
elif [ "$MODE" = check ]; then
    echo "error: --check-install: no wheels in $WHEELS; run tools/gpu_ci/prepare_wheels.sh --python-version X.Y $WHEELS" >&2
    record install 3 "$T0"
    finish 3
else
    echo "no wheels in $WHEELS: using $PY3's environment as it is" | tee "$OUT/install.txt"
    SITE=
    RC=0
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$RC" = 0 ]; then
    "$PY3" tools/gpu_ci/record.py imports "$OUT" --site "$SITE" --wheels "$WHEELS" 2>&1 | tee -a "$OUT/install.txt"
    RC=${PIPESTATUS[0]}
fi
record install "$RC" "$T0"
if [ "$RC" != 0 ]; then
    echo "error: install failed (exit $RC); see $OUT/install.txt" >&2
    finish 3
fi
[ "$MODE" = check ] && finish 0

FAILED=0
if [ "$MODE" = full ]; then
    T0=$(date +%s)
    timeout --signal=TERM --kill-after=10 $((PREFLIGHT_S + 15)) \
        "$PY3" tools/gpu_ci/preflight.py --precision "$PRECISION" --budget "$PREFLIGHT_S" --json "$OUT/preflight.json" \
        2>&1 | tee "$OUT/preflight.log"
    RC=${PIPESTATUS[0]}
    record preflight "$RC" "$T0"
    if [ "$RC" != 0 ]; then
        FAILED=1
        if [ "${GPU_CI_CONTINUE:-0}" != 1 ]; then
            echo "error: pre-flight failed; tests/gpu and gpu_mfu not run (GPU_CI_CONTINUE=1 runs them)" >&2
            finish 1
        fi
    fi
fi

# tests/gpu: per-test limits from the tests' own timeout marks; the suite gets what is left
# minus the benchmark's reserve (full run) and 15 s for the record.
RESERVE=$([ "$MODE" = full ] && echo $((BENCH_RESERVE + 15)) || echo 15)
T0=$(date +%s)
timeout --signal=TERM --kill-after=20 $(( $(left) > RESERVE + 30 ? $(left) - RESERVE : 30 )) \
    "$PY3" -m pytest tests/gpu -m gpu -v -s -p no:cacheprovider --junitxml="$OUT/tests-gpu.xml" \
    2>&1 | tee "$OUT/tests-gpu.log"
RC=${PIPESTATUS[0]}
record tests_gpu "$RC" "$T0"
[ "$RC" != 0 ] && FAILED=1

if [ "$MODE" = full ]; then
    T0=$(date +%s)
    timeout --signal=TERM --kill-after=10 $(( $(left) > 45 ? $(left) - 15 : 30 )) \
        "$PY3" benchmarks/gpu_mfu.py --json "$OUT/gpu_mfu.json" 2>&1 | tee "$OUT/gpu_mfu.log"
    RC=${PIPESTATUS[0]}
    record gpu_mfu "$RC" "$T0"
    [ "$RC" != 0 ] && FAILED=1
fi
finish "$FAILED"
