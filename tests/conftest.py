"""Shared fixtures: offline model folders and the environment every vLLM engine needs.

Fixtures that start an engine or a server live in the conftest of the folder that uses them and
are session-scoped: one engine per test session, never one per test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Set before anything imports vLLM: in-process engine, no thread pinning, no network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct, float32), built once into the user cache."""
    from server.model import build_default_model

    return build_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir: Path) -> Path:
    """A random-weight 2-layer Llama with SmolLM2's tokenizer and chat template (fast tests)."""
    from server.model import build_tiny_model, default_cache_dir

    out = default_cache_dir() / "models" / "tiny-llama-h32"
    return build_tiny_model(out, tokenizer_from=smollm2_dir)
