#!/usr/bin/env bash
# Download the manylinux x86_64 wheels of every dependency the GPU suite needs
# except torch, for a host whose image has its own torch but no package index
# (tools/gpu_ci/run.sh installs them there with --no-index --no-deps --target).
#
#   tools/gpu_ci/prepare_wheels.sh [--python-version X.Y] [DIR]   # defaults: 3.12 (the GPU image), build/gpu-wheels
#
# Run from the repository root on any machine that reaches the package index;
# PYTHON (default .venv/bin/python) only runs pip, nothing is installed.
# Versions are constraints.txt's exact pins (the CPU environment's); pip
# resolves the closure of torchft's OpenTelemetry exporter and pytest for the
# target Python. Prints the total size: whatever is copied to the GPU host with
# the checkout must stay small (tens of MiB).
set -euo pipefail

PYV=3.12
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) PYV=${2:?--python-version needs X.Y}; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) break ;;
    esac
done
if ! [[ "$PYV" =~ ^3\.[0-9]+$ ]]; then
    echo "error: --python-version $PYV: expected X.Y, e.g. 3.12" >&2
    exit 2
fi
DIR=${1:-build/gpu-wheels}
PY=${PYTHON:-.venv/bin/python}
CONSTRAINTS=${CONSTRAINTS:-constraints.txt}
ABI=cp${PYV/./}
mkdir -p "$DIR"

TARGET=(--only-binary=:all: --python-version "$PYV" --implementation cp --abi "$ABI" --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform any -c "$CONSTRAINTS" -d "$DIR")

# Packages that depend on torch: without their dependencies, so pip never
# downloads a torch wheel (the image's torch serves them). tokenizers
# imports huggingface_hub only to download tokenizers by name, which the
# training never does.
NO_DEPS=(megatron-core torchft tokenizers)

# Everything else, with its dependency closure resolved for the target Python.
# tensorboard is left out: the GPU suite logs JSONL (metrics/writers.py falls back without it).
WITH_DEPS=(
    numpy PyYAML webdataset pillow tqdm psutil prometheus-client packaging
    # torchft imports its OpenTelemetry log exporter at import time.
    opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
    pytest pytest-timeout
)

# (pip's notes about configured local mirror folders that do not exist are dropped)
"$PY" -m pip download --quiet --no-deps "${TARGET[@]}" "${NO_DEPS[@]}" 2> >(grep -v '^WARNING: Location' >&2)
"$PY" -m pip download --quiet "${TARGET[@]}" "${WITH_DEPS[@]}" 2> >(grep -v '^WARNING: Location' >&2)

if ls "$DIR" | grep -Eiq '^(torch|nvidia|triton)[-_]'; then
    echo "error: a torch/CUDA wheel was downloaded into $DIR; the target image provides torch" >&2
    exit 1
fi
echo "wheels for cp${PYV/./} in $DIR: $(ls "$DIR" | wc -l) files, $(du -sh "$DIR" | cut -f1) total"
ls -S "$DIR" | head -5 | while read -r f; do echo "  $(du -h "$DIR/$f" | cut -f1)  $f"; done
