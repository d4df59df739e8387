# Two commands: `make demo` and `make test`. Both create the environment when needed.
# `make cluster`: two replicas sharing Redis behind vllm-router (docs/operations.md).
SHELL := /bin/bash
VENV = $(shell bash scripts/setup-env.sh | tail -n 1)
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export TOKENIZERS_PARALLELISM := false

# `make test` runs two pytest-xdist workers (14 to 21 minutes on 2 cores, fresh clones on
# 2026-12-07, as the machine's speed varies; serially, TEST_WORKERS=0, 27). tests/conftest.py's scheduler runs each group whole on one worker: a module, or the
# modules that share an in-process engine or a server, longest groups first (xdist's own
# loadgroup split every module across the workers until 2026-12-07; see
# pytest_xdist_make_scheduler there).
# `make test-long` runs the full-size scenarios (LGKV_TEST_LONG=1, tests/sizes.py).
TEST_WORKERS ?= 2
PYTEST = $$v/bin/python -m pytest -q -ra --timeout 1200 -n $(TEST_WORKERS) --dist loadgroup \
	--no-loadscope-reorder --durations 20

.PHONY: setup test test-long lint demo bench docs cluster

setup:
	@bash scripts/setup-env.sh

SOURCES = langgraph_kvcache server tests benchmarks examples scripts

lint:
	@v=$(VENV); set -e; $$v/bin/ruff check $(SOURCES); $$v/bin/ruff format --check $(SOURCES)

test:
	@v=$(VENV); set -e; \
	$$v/bin/ruff check $(SOURCES); \
	$$v/bin/ruff format --check $(SOURCES); \
	$(PYTEST) $(PYTEST_ARGS)

test-long:
	@v=$(VENV); set -e; LGKV_TEST_LONG=1 $(PYTEST) $(PYTEST_ARGS)

demo:
	@v=$(VENV); $$v/bin/python -m examples.demo

cluster:
	@v=$(VENV); $$v/bin/python -m examples.cluster $(CLUSTER_ARGS)

bench:
	@v=$(VENV); $$v/bin/python benchmarks/checkpointer.py
