"""Session API bodies: a contradiction the server refuses is one the schema excludes."""

from __future__ import annotations

import pytest

from langgraph_kvcache.contract import check_pin_update
from server.api.protocol import SessionUpdate


def test_a_pin_lease_with_pinned_false_is_refused_and_the_schema_excludes_it() -> None:
    with pytest.raises(ValueError, match="leave pinned out or true"):
        check_pin_update(False, 20.0)
    assert check_pin_update(None, 20.0) is True and check_pin_update(True, 20.0) is True
    assert check_pin_update(False, None) is False and check_pin_update(None, None) is None
    excluded = SessionUpdate.model_json_schema()["not"]
    assert excluded["required"] == ["pinned", "pin_ttl_seconds"]
    assert excluded["properties"]["pinned"] == {"const": False}
