# Training at Speed: set-up, lab, tests and release.
#   make lab     set up .venv if needed, then serve JupyterLab on notebooks/ (the student's lab)
#   make lab-instructor   the same on the project root, with nbgrader's instructor extensions
#   make test    set up .venv if needed, then run the whole CPU test suite (lint first)
#   make lint    ruff and mypy only
#   make site    build the course website (both editions of every chapter) in build/site/html
#   make site-check   check the built site: links, images, outputs, no solutions; its pages in Chromium
#   make test-repeat N=5 LOAD=2   the CPU suite N times in a row (LOAD busy processes beside it), a line per run
#   make multi-node NNODES=2 NPROC=2   the distributed chapters' checks as a 2-node torchrun job on this host
# Variables you may override, e.g. `make test TORCH_BUILD=cuda JOBS=4`:
#   PYTHON       interpreter that creates the venv (3.11 or newer)
#   TORCH_BUILD  auto | cpu | cuda. auto picks cuda when `nvidia-smi -L` finds a GPU, else cpu.
#                cpu installs a CPU-only torch: a wheel pip already has on disk (its find-links)
#                when there is one, else PyTorch's CPU wheel index; never the multi-GB CUDA build.
#   TORCH_VERSION, TORCH_CPU_INDEX, JOBS / GPU_JOBS (pytest workers), LAB_ARGS (extra JupyterLab flags)

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

.PHONY: install sandbox-deps browser-deps lab lab-instructor lint test test-repeat test-browser test-gpu notebooks-run multi-gpu multi-node release bench bench-records bench-grading site audit clean help
help:
	@sed -n '2,16p' Makefile

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
	$(PY) -m pip install -q -e ".[course]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (Training at Speed)" >/dev/null
	@touch $@

# System packages (Debian/Ubuntu, as root): bubblewrap for the grader's sandbox, chromium for the
# browser test. Each is skipped when already there.
sandbox-deps:
	@command -v bwrap >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap; }

browser-deps:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; }

# The student's lab leaves out nbgrader's instructor extensions (jupyter/README.md says how).
STUDENT_JUPYTER_CONFIG := $(abspath jupyter/student)
LAB_FLAGS = $(if $(DISPLAY),,--no-browser) $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)
lab: $(STAMP)
	JUPYTER_CONFIG_PATH=$(STUDENT_JUPYTER_CONFIG)$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH)) \
	  $(BIN)/jupyter lab --notebook-dir=notebooks $(LAB_FLAGS)

lab-instructor: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=. $(LAB_FLAGS)

# CPU tier: unit tests, release sync, grading end to end, every solution notebook under nbval, and
# every released (blank) notebook under nbval: there only exercise cells, tagged raises-exception,
# may raise, so a lecture cell that breaks without the student's code fails the suite.
test: $(STAMP) lint
	$(PY) -m pytest -n $(JOBS) --dist loadscope --nbval-lax -m "not gpu" tests solutions notebooks

# Flake hunt: the CPU suite (as `make test` runs it, lint aside) N times in a row, optionally with LOAD
# processes spinning on the CPU beside it, each run's output in artifacts/repeat/run<i>.log and one
# line per run. Fails when any run failed. REPEAT_TESTS narrows it (e.g. "tests/test_data_parallel.py").
N ?= 3
LOAD ?= 0
REPEAT_TESTS ?= tests solutions notebooks
test-repeat: $(STAMP)
	@mkdir -p artifacts/repeat; \
	spinners=""; for j in $$(seq 1 $(LOAD)); do $(PY) -c "while True: pass" & spinners="$$spinners $$!"; done; \
	trap 'kill $$spinners 2>/dev/null' EXIT; failed=0; \
	for i in $$(seq 1 $(N)); do \
	  start=$$(date +%s); \
	  if $(PY) -m pytest -n $(JOBS) --dist loadscope --nbval-lax -m "not gpu" -q -p no:cacheprovider $(REPEAT_TESTS) \
	    > artifacts/repeat/run$$i.log 2>&1; then verdict=passed; else verdict=FAILED; failed=$$((failed + 1)); fi; \
	  echo "run $$i of $(N) (load $(LOAD)): $$verdict in $$(( $$(date +%s) - start )) s: $$(tail -n 1 artifacts/repeat/run$$i.log)"; \
	done; \
	echo "$$failed of $(N) runs failed"; test $$failed -eq 0

# Static tier: ruff (style, imports, likely bugs) over the Python code, mypy over the packages; both
# configured in pyproject.toml. Part of `make test`, first, so a slip fails in seconds.
lint: $(STAMP)
	$(BIN)/ruff check course_lib autograder benchmarks website tests conftest.py
	$(BIN)/mypy

# JupyterLab in headless Chromium: open a released notebook, run all cells, check for errors, screenshot.
# (Also part of `make test` when chromium is installed; skipped there otherwise.)
test-browser: $(STAMP) browser-deps
	$(PY) -m pytest -m browser tests/test_browser.py

# The built site (`make site`) checked: internal links, images and alt text, every chapter page with outputs and
# no error, no solution or hidden test anywhere; then its pages in headless Chromium (screenshots in tests/artifacts/).
.PHONY: site-check
site-check: $(STAMP) browser-deps
	$(PY) -m website check build/site/html
	SITE_REQUIRED=1 $(PY) -m pytest -m browser tests/test_site_browser.py

# GPU tier (on a CUDA machine): the tests marked gpu (kernels compiled, CUDA timing, grading every
# solution on the GPU), and every solution and released notebook under nbval in GPU mode. The CPU-only tests are
# `make test`'s. GPU_JOBS pytest workers and GPU_GRADE_JOBS grading kernels share the GPU; the notebooks that need
# much GPU memory (tests/gpu_memory.json) take turns (a lock file, conftest.py).
GPU_JOBS ?= 4
GPU_GRADE_JOBS ?= 2
test-gpu: $(STAMP)
	GPU_GRADE_JOBS=$(GPU_GRADE_JOBS) $(PY) -m pytest -n $(GPU_JOBS) --dist loadscope --nbval-lax -m "gpu or notebook" -rf tests solutions notebooks

# Every solution notebook executed once, outputs kept, with its run time (docs/gpu-run.md's table).
notebooks-run: $(STAMP)
	$(PY) -m benchmarks.notebooks --out $(or $(OUT),artifacts/notebooks)

# Multi-GPU host: each distributed chapter under torchrun (checks against one process), then the
# NCCL benchmark (docs/multi-gpu.md). NPROC: GPUs to use.
NPROC ?= 2
DIST_CHECKS := collectives data_parallel tensor_parallel pipeline_parallel context_parallel hybrid
multi-gpu: $(STAMP)
	@mkdir -p $(or $(OUT),artifacts/multi-gpu)
	@for m in $(DIST_CHECKS); do \
	  echo "== benchmarks.checks.$$m"; \
	  $(BIN)/torchrun --standalone --nproc_per_node $(NPROC) -m benchmarks.checks.$$m || exit 1; done
	$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) -m benchmarks.distributed --out $(or $(OUT),artifacts/multi-gpu)

# Several nodes: each distributed chapter's self-check as NNODES torchrun agents ("nodes") of NPROC ranks on this
# host, meeting at a c10d rendezvous on the loopback as a cluster's nodes do over the network (docs/multi-node.md).
# With a CPU-only torch: gloo ranks and tiny sizes. `make test` runs it with 2 nodes x 1 rank (tests/test_torchrun.py).
NNODES ?= 2
multi-node: $(STAMP)
	$(PY) -m benchmarks.checks --nnodes $(NNODES) --nproc-per-node $(NPROC) $(if $(filter cpu,$(TORCH_BUILD)),--small)

release: $(STAMP)
	$(PY) -m autograder release

# Grading throughput: 100 submissions of chapter 01 with --jobs 2 (the figure in INSTRUCTORS.md).
bench-grading: $(STAMP) sandbox-deps
	$(PY) -m benchmarks.grading --submissions 100 --jobs 2 --chapter 01_floating_point

# Benchmark suite (on a CUDA machine): our kernels against PyTorch's, written to benchmarks/results/.
bench: $(STAMP)
	$(PY) -m benchmarks

# Every one-GPU record the chapters render (docs/gpu-run.md lists which chapter reads which), then the suite.
GPU_RECORDS := figures step_graphs mixed_precision cross_entropy gelu_steps tiling attention flash_steps gemm capstone capstone_mfu capstone_attention
bench-records: $(STAMP)
	@for m in $(GPU_RECORDS); do echo "== benchmarks.$$m"; $(PY) -m benchmarks.$$m || exit 1; done
	$(PY) -m benchmarks

# The course website (docs/website.md): both editions of every chapter, the guides and the benchmark records as
# static HTML in build/site/html. Runs every solution notebook on this CPU first (a few minutes).
# SITE_ARGS: more options, e.g. SITE_ARGS="--cpu-from artifacts/notebooks" or "--h200-from DIR".
SITE_ARGS ?=
SITE_STAMP := $(VENV)/.site-installed
$(SITE_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[course,site]"
	@touch $@

site: $(SITE_STAMP)
	$(PY) -m website build $(SITE_ARGS)

audit:
	python3 ../shared/tools/course-audit .

clean:
	rm -rf $(VENV) .pytest_cache
