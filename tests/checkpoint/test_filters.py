"""``list(filter=...)`` with any JSON key (quotes, dots, brackets, NUL) on both databases, and
the typed error for metadata PostgreSQL cannot store (issue 8)."""

from __future__ import annotations

from typing import Any

import pytest
from langgraph.checkpoint.base import empty_checkpoint

from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver
from langgraph_kvcache.errors import CheckpointerError, UnstorableValueError

ODD_KEYS = ['a"b', "x.y", "$[0]", "it's", "back\\slash", '"', "", "ключ"]


@pytest.fixture
def saver(db_url: str) -> Any:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        yield saver


def _put(saver: SQLAlchemySaver, thread_id: str, metadata: dict[str, Any]) -> str:
    checkpoint = empty_checkpoint()
    config = saver.put(
        {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}, checkpoint, metadata, {}
    )
    return config["configurable"]["checkpoint_id"]


def _found(saver: SQLAlchemySaver, filter: dict[str, Any], **kw: Any) -> list[str]:
    return [t.metadata["name"] for t in saver.list(None, filter=filter, **kw)]


@pytest.mark.parametrize("key", ODD_KEYS)
def test_any_key_filters(saver: SQLAlchemySaver, key: str) -> None:
    _put(saver, "t", {"name": "one", key: "v1"})
    _put(saver, "t", {"name": "two", key: "v2"})
    _put(saver, "t", {"name": "none"})
    assert _found(saver, {key: "v1"}) == ["one"]
    assert _found(saver, {key: "v2", "name": "two"}) == ["two"]
    assert _found(saver, {key: "v3"}) == []


def test_values_compare_as_json(saver: SQLAlchemySaver) -> None:
    _put(saver, "t", {"name": "true", "k": True})
    _put(saver, "t", {"name": "one", "k": 1})
    _put(saver, "t", {"name": "null", "k": None})
    _put(saver, "t", {"name": "text", "k": "1"})
    _put(saver, "t", {"name": "nested", "k": {"a": [1, 2], 'q"': "x"}})
    assert _found(saver, {"k": True}) == ["true"]
    assert _found(saver, {"k": 1}) == ["one"]
    assert _found(saver, {"k": None}) == ["null"]
    assert _found(saver, {"k": "1"}) == ["text"]
    assert _found(saver, {"k": {"a": [1, 2], 'q"': "x"}}) == ["nested"]
    assert _found(saver, {"missing": None}) == []


def test_nul_in_metadata(saver: SQLAlchemySaver) -> None:
    # LangGraph strips NUL from metadata *values* before a saver sees them
    # (get_serializable_checkpoint_metadata); keys keep it.
    metadata = {"name": "nul", "x\x00y": "v"}
    if saver.dialect == "postgresql":
        with pytest.raises(UnstorableValueError, match="NUL") as caught:
            _put(saver, "t", metadata)
        assert isinstance(caught.value, CheckpointerError) and isinstance(caught.value, ValueError)
        assert "INSERT" not in str(caught.value)  # no SQL in the message
        assert list(saver.list(None)) == []
        # Nothing stored can hold NUL, so a filter with NUL matches nothing (no driver error).
        _put(saver, "t", {"name": "plain", "x": "v"})
        assert _found(saver, {"x\x00y": "v"}) == []
        assert _found(saver, {"x": "v\x00"}) == []
        return
    _put(saver, "t", {"name": "other", "x\x00y": "w"})
    _put(saver, "t", metadata)
    _put(saver, "t", {"name": "prefix", "x": "v"})
    _put(saver, "t", {"name": "again", "x\x00y": "w"})
    assert _found(saver, {"x\x00y": "v"}) == ["nul"]
    assert _found(saver, {"x\x00y": "v", "name": "nul"}) == ["nul"]
    assert _found(saver, {"x\x00y": "w"}) == ["again", "other"]
    assert _found(saver, {"x": "v\x00"}) == []
    assert _found(saver, {"x\x00": "v"}) == []
    # The limit applies after the Python-side check.
    assert _found(saver, {"x\x00y": "w"}, limit=1) == ["again"]
