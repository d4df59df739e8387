# Two commands: `make demo` and `make test`. Both create the environment when needed.
# `make cluster`: two replicas sharing Redis behind vllm-router (docs/operations.md).
SHELL := /bin/bash
VENV = $(shell bash scripts/setup-env.sh | tail -n 1)
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export TOKENIZERS_PARALLELISM := false

# Test modules run in TEST_WORKERS processes (pytest-xdist; a module, and all the tests of the
# shared SmolLM2 server, stay in one worker: tests/conftest.py). The vLLM
# tests compute on one OpenMP thread each (tests/conftest.py), so two workers use both cores of
# a 2-core machine; TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

.PHONY: setup test lint demo bench docs cluster

setup:
	@bash scripts/setup-env.sh

lint:
	@v=$(VENV); $$v/bin/ruff check langgraph_kvcache server tests benchmarks examples

test:
	@v=$(VENV); set -e; \
	$$v/bin/ruff check langgraph_kvcache server tests benchmarks examples; \
	$$v/bin/python -m pytest -q -ra --timeout 1200 -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

demo:
	@v=$(VENV); $$v/bin/python -m examples.demo

cluster:
	@v=$(VENV); $$v/bin/python -m examples.cluster $(CLUSTER_ARGS)

bench:
	@v=$(VENV); $$v/bin/python benchmarks/checkpointer.py
