# Training at Speed: set-up, lab, tests and release.
#   make lab     set up .venv if needed, then serve JupyterLab on notebooks/
#   make test    set up .venv if needed, then run the whole CPU test suite
# Variables you may override, e.g. `make test TORCH_BUILD=cuda JOBS=4`:
#   PYTHON       interpreter that creates the venv (3.11 or newer)
#   TORCH_BUILD  auto | cpu | cuda. auto picks cuda when `nvidia-smi -L` finds a GPU, else cpu.
#                cpu installs a CPU-only torch: a wheel pip already has on disk (its find-links)
#                when there is one, else PyTorch's CPU wheel index; never the multi-GB CUDA build.
#   TORCH_VERSION, TORCH_CPU_INDEX, JOBS (pytest workers), LAB_ARGS (extra JupyterLab flags)

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
TORCH_BUILD ?= auto
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
JOBS ?= 2
LAB_ARGS ?=
STAMP := $(VENV)/.installed
# nbgrader starts `alembic` as a subprocess: the venv's bin/ must be on PATH.
export PATH := $(abspath $(BIN)):$(PATH)

ifeq ($(TORCH_BUILD),auto)
  TORCH_BUILD := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
endif

.PHONY: install lab test test-gpu release bench audit clean help
help:
	@sed -n '2,10p' Makefile

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing torch $(TORCH_VERSION) ($(TORCH_BUILD) build) into $(VENV)"
ifeq ($(TORCH_BUILD),cpu)
	$(PY) -m pip install -q --no-index --no-deps "torch==$(TORCH_VERSION)" 2>/dev/null \
	  || $(PY) -m pip install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX) --extra-index-url https://pypi.org/simple
else
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
endif
	$(PY) -m pip install -q -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (Training at Speed)" >/dev/null
	@touch $@

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks $(if $(DISPLAY),,--no-browser) $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# CPU tier: unit tests, release sync, grading end to end, and every solution notebook under nbval.
test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadscope --nbval-lax -m "not gpu" tests solutions

# GPU tier (on a CUDA machine): kernels compiled, NCCL, every solution notebook in GPU mode.
test-gpu: $(STAMP)
	$(PY) -m pytest --nbval-lax tests solutions

release: $(STAMP)
	$(PY) -m autograder release

# Benchmark suite (on a CUDA machine): our kernels against PyTorch's, written to benchmarks/results/.
bench: $(STAMP)
	$(PY) -m benchmarks

audit:
	python3 ../shared/tools/course-audit .

clean:
	rm -rf $(VENV) .pytest_cache
