"""One in-process vLLM engine with SessionKVConnector for the whole test session.

RAM is 8 blocks and disk 24 blocks, so a few sessions overflow both tiers. vLLM's own prefix
cache would serve repeats from its resident blocks, so tests call ``llm.reset_prefix_cache()``
before a turn whose hit must come from our tiers, and read the registry's counters to see
which tier served it. Scenarios that need a second engine (a restart, another model) run it
in a subprocess (``engine_script.py``), since vLLM keeps its KV connector in a process global.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_engine import engine_kwargs, make_llm

from server.kv.registry import Registry


@pytest.fixture(scope="session")
def kv_model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="session")
def kv_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lgkv-cache")


@pytest.fixture(scope="session")
def llm(kv_model_dir: Path, kv_cache_dir: Path) -> Iterator[Any]:
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    engine = make_llm(engine_kwargs(kv_model_dir, kv_cache_dir))
    yield engine
    engine.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()  # vLLM keeps the worker connector in a process global


@pytest.fixture(scope="session")
def registry(kv_cache_dir: Path, llm: Any) -> Iterator[Registry]:
    reg = Registry(kv_cache_dir / "sessions.sqlite3")
    yield reg
    reg.close()
