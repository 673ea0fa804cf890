# Two entry points: `make serve` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch the suite is tested with, pinned on every machine (the CPU build where pip is configured to
# find one, else PyPI's CUDA wheel); TORCH_SPEC= skips the pin, keeping a torch already in $(VENV).
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
CONFIG ?= configs/tiny.json
# The default model: the trained retrieval model where its weights are in the tree (models-shipped/, see
# the README), else the random tiny model of CONFIG, written to models/tiny if missing.
SHIPPED := models-shipped/retrieval-wip
MODEL ?= $(if $(wildcard $(SHIPPED)/model.safetensors),$(SHIPPED),models/tiny)
PYTEST_ARGS ?=

.PHONY: venv serve test lint typecheck model clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e '.[triton,test]'
	touch $@

venv: $(BIN)/.installed

$(MODEL)/config.json: | $(BIN)/.installed
	$(BIN)/longctx init-model --config $(CONFIG) --out $(MODEL) --seed 0

model: $(MODEL)/config.json

serve: $(BIN)/.installed $(MODEL)/config.json
	$(BIN)/longctx serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy longctx kernels

clean:
	rm -rf $(VENV) build *.egg-info
