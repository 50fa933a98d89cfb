# Two commands do everything on a fresh machine:
#   make demo   - create .venv if missing, install the exact versions of constraints.txt, run the demo job
#   make test   - same set-up, then the test suite without the slow cases (18-56 min on 2 CPU cores, docs/testing.md)
#   make slurm-up / slurm-down - a single-host Slurm for the Slurm tests and demos (installs
#                   slurmctld, slurmd, slurm-client, munge with apt when missing; root); then
#                   export SLURM_CONF=$(SLURM_DIR)/slurm.conf (docs/scheduler.md, "A real Slurm")
#   make test-gpu - tests/gpu on a CUDA host, against GPU_PYTHON's own torch (no .venv, no CPU torch):
#                   installs build/gpu-wheels when present (tools/gpu_ci/run.sh --tests-only)
PYTHON ?= python3.11
GPU_PYTHON ?= python3
GPU_WHEELS ?= build/gpu-wheels
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Re-install only when the dependency ranges or the pinned versions change.
STAMP  := $(VENV)/.installed-$(shell cat setup.py constraints.txt | cksum | cut -d' ' -f1)
NPROC  ?= 2
SLURM_DIR ?= /tmp/omni-slurm

.PHONY: demo test test-all test-gpu install smoke clean slurm-up slurm-down

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): setup.py constraints.txt | $(PY)
	# torch first, at constraints.txt's exact version: pip takes the CPU wheel on this disk
	# (setup.py's range alone would download GBs of CUDA wheels).
	$(PIP) install --quiet -c constraints.txt torch
	$(PIP) install --quiet -c constraints.txt -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: install
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) pretrain_llava.py \
		--config examples/llava/tiny_cpu.yaml vision.lr_mult=0.3 logging.output_dir=runs/demo-llava

smoke: install
	$(PY) -m megascale_omni.smoke --config examples/gpt/tiny.yaml logging.output_dir=runs/smoke

test: install
	$(PY) -m pytest -m "not slow"

test-all: install
	$(PY) -m pytest

# tests/gpu on a CUDA host (skipped, with the reason, without one); see docs/gpu.md.
# No `install`: the host's interpreter keeps its own (CUDA) torch.
test-gpu:
	PYTHON=$(GPU_PYTHON) tools/gpu_ci/run.sh --tests-only $(GPU_WHEELS)

# Standard library only: runs before (and without) the venv.
slurm-up:
	$(PYTHON) tools/slurm_local.py up --dir $(SLURM_DIR)

slurm-down:
	$(PYTHON) tools/slurm_local.py down --dir $(SLURM_DIR)

clean:
	rm -rf runs .pytest_cache
