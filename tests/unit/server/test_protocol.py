"""Session API bodies: a contradiction the schema states is refused with 422, never accepted."""

from __future__ import annotations

import pytest

from server.api.protocol import APIError, SessionUpdate, parse_body


def test_a_pin_lease_with_pinned_false_is_a_422_and_the_schema_excludes_it() -> None:
    with pytest.raises(APIError) as err:
        parse_body(SessionUpdate, b'{"pinned": false, "pin_ttl_seconds": 20}')
    assert err.value.status == 422 and "leave pinned out or true" in str(err.value)
    excluded = SessionUpdate.model_json_schema()["not"]
    assert excluded["required"] == ["pinned", "pin_ttl_seconds"]
    assert excluded["properties"]["pinned"] == {"const": False}
    body = parse_body(SessionUpdate, b'{"pinned": true, "pin_ttl_seconds": 20}')
    assert isinstance(body, SessionUpdate) and body.pin_ttl_seconds == 20.0
    assert isinstance(parse_body(SessionUpdate, b'{"pinned": false}'), SessionUpdate)
