# Two commands: `make demo` and `make test`. Both create the environment when needed.
# `make cluster`: two replicas sharing Redis behind vllm-router (docs/operations.md).
SHELL := /bin/bash
VENV = $(shell bash scripts/setup-env.sh | tail -n 1)
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export TOKENIZERS_PARALLELISM := false

# TEST_WORKERS=2 runs test modules in two pytest-xdist processes (whole modules each): about
# 17 minutes instead of about 40 on 2 cores, but not yet reliable: the in-process engine tests of
# tests/integration/kv depend on their module order (vLLM keeps the KV connector in a process
# global), and two workers' servers peaked at 21 GB of the machine's 24. The default is serial.
TEST_WORKERS ?= 0

.PHONY: setup test lint demo bench docs cluster

setup:
	@bash scripts/setup-env.sh

lint:
	@v=$(VENV); $$v/bin/ruff check langgraph_kvcache server tests benchmarks examples

test:
	@v=$(VENV); set -e; \
	$$v/bin/ruff check langgraph_kvcache server tests benchmarks examples; \
	$$v/bin/python -m pytest -q -ra --timeout 1200 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo:
	@v=$(VENV); $$v/bin/python -m examples.demo

cluster:
	@v=$(VENV); $$v/bin/python -m examples.cluster $(CLUSTER_ARGS)

bench:
	@v=$(VENV); $$v/bin/python benchmarks/checkpointer.py
