"""The session API of a real server against its own OpenAPI schema (schemathesis, bounded).

Every generated request, valid or not, must get a documented status code and a body of the
documented shape, never a 5xx; schema-valid requests are not rejected as invalid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

if TYPE_CHECKING:
    from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.vllm


def test_session_routes_conform_to_their_schema(lgkv_server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{lgkv_server.base_url}/openapi.json")
    schema = schema.include(path_regex=r"^/v1/sessions")
    failures: dict[str, str] = {}
    calls: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 9
    for operation in operations:

        @settings(max_examples=15, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            calls.append(case.operation.label)
            case.call_and_validate(timeout=60)

        try:
            check()
        except Exception as exc:  # collect every operation's failure, then report them all
            failures[operation.label] = str(exc)[:2000]
    assert len(set(calls)) == 9 and len(calls) >= 9 * 10  # every operation was exercised
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())


def test_options_names_the_allowed_methods(lgkv_server: ServerProcess) -> None:
    with httpx.Client(base_url=lgkv_server.base_url) as c:
        r = c.options("/v1/sessions/some-id")
        assert r.status_code in (200, 204), r.text
        assert set(r.headers["allow"].replace(" ", "").split(",")) >= {"GET", "PATCH", "DELETE"}
        assert "POST" not in r.headers["allow"]
        listing = c.options("/v1/sessions")
        assert set(listing.headers["allow"].replace(" ", "").split(",")) >= {"GET", "POST"}
