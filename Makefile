# Two commands: `make demo` and `make test`. Both create the environment when needed.
SHELL := /bin/bash
VENV = $(shell bash scripts/setup-env.sh | tail -n 1)
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test lint demo bench docs

setup:
	@bash scripts/setup-env.sh

lint:
	@v=$(VENV); $$v/bin/ruff check langgraph_kvcache server tests benchmarks examples

test:
	@v=$(VENV); set -e; \
	$$v/bin/ruff check langgraph_kvcache server tests benchmarks examples; \
	$$v/bin/python -m pytest -q -ra --timeout 1200 $(PYTEST_ARGS)

demo:
	@v=$(VENV); $$v/bin/python -m examples.demo

bench:
	@v=$(VENV); $$v/bin/python benchmarks/checkpointer.py
