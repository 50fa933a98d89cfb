#!/usr/bin/env bash
# Download the Python 3.12 (cp312, manylinux x86_64) wheels of every
# dependency the GPU suite needs except torch, for a GPU host whose image
# has Python 3.12 and a CUDA torch but no package index
# (tools/gpu_ci/run.sh installs them there with --no-index).
#
#   tools/gpu_ci/prepare_wheels.sh [DIR]      # default: build/gpu-wheels
#
# Run from the repository root on any machine that reaches the package index.
# Nothing is installed here. Versions are setup.py's pins; torchft's
# OpenTelemetry exporter and pytest bring their own dependencies, resolved
# for cp312. Prints the total size: whatever is copied to the GPU host
# with the checkout must stay small (tens of MiB).
set -euo pipefail

DIR=${1:-build/gpu-wheels}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR"

TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform any -d "$DIR")

# Packages that depend on torch: without their dependencies, so pip never
# downloads a torch wheel (the image's CUDA torch serves them). tokenizers
# imports huggingface_hub only to download tokenizers by name, which the
# training never does.
NO_DEPS=(megatron-core==0.16.1 torchft==0.2.0 tokenizers==0.23.3)

# Everything else, with its dependency closure resolved for cp312.
WITH_DEPS=(
    numpy==2.4.6 PyYAML==6.0.4 webdataset==1.0.2 pillow==13.0.0 tqdm==4.70.1 psutil==7.2.2
    prometheus-client==0.26.0 "packaging>=24.2"
    # torchft imports its OpenTelemetry log exporter at import time.
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
    pytest==9.2.0 pytest-timeout==2.4.0
)

# (pip's notes about configured local mirror folders that do not exist are dropped)
"$PY" -m pip download --quiet --no-deps "${TARGET[@]}" "${NO_DEPS[@]}" 2> >(grep -v '^WARNING: Location' >&2)
"$PY" -m pip download --quiet "${TARGET[@]}" "${WITH_DEPS[@]}" 2> >(grep -v '^WARNING: Location' >&2)

if ls "$DIR" | grep -Eiq '^(torch|nvidia|triton)[-_]'; then
    echo "error: a torch/CUDA wheel was downloaded into $DIR; the GPU image provides torch" >&2
    exit 1
fi
echo "wheels in $DIR: $(ls "$DIR" | wc -l) files, $(du -sh "$DIR" | cut -f1) total"
ls -S "$DIR" | head -5 | while read -r f; do echo "  $(du -h "$DIR/$f" | cut -f1)  $f"; done
