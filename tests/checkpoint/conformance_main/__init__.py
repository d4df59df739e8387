# ruff: noqa
# Vendored from langchain-ai/langgraph@f09cfe8 libs/checkpoint-conformance (MIT); see README.md.
"""langgraph-checkpoint-conformance: conformance test suite for checkpointer implementations."""

from conformance_main.initializer import checkpointer_test
from conformance_main.validate import validate

__all__ = [
    "checkpointer_test",
    "validate",
]
