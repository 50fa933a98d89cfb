# Two commands do everything on a fresh machine:
#   make demo   - create .venv if missing, install pinned deps, run the demo job
#   make test   - same set-up, then the test suite (12-22 min on 2 CPU cores)
#   make test-gpu - tests/gpu on a CUDA host (GPT/LLaVA/DiT on the device, NCCL layouts, TE parity)
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Re-install only when the dependency list changes.
STAMP  := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)
NPROC  ?= 2

.PHONY: demo test test-all test-gpu install smoke clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): setup.py | $(PY)
	# torch first, by exact version: pip takes the CPU wheel on this disk
	# (a looser spec would download GBs of CUDA wheels).
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
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

# tests/gpu on a CUDA host (skipped, with the reason, without one); see README "GPU".
test-gpu: install
	$(PY) -m pytest -m gpu tests/gpu

clean:
	rm -rf runs .pytest_cache
