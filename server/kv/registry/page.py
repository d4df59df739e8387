"""The session list's page cursor: where the next page of a tenant's listing starts.

A listing is ordered by last use, newest first; a cursor names the last row of the page
before (its ``last_used_at`` and id), so the next page is an index range read from there
(keyset pagination): its cost does not grow with how many pages came before, and a session
added or used meanwhile (it moves to the front) never shifts the rest of the listing, so
paging on visits every session that stayed untouched exactly once.

The text is opaque to clients (URL-safe base64 of a small JSON array); build it with
:func:`session_cursor` from the last row of a page and hand it back as
``list_sessions(..., after=cursor)``. :func:`parse_session_cursor` raises :class:`ValueError`
with a message fit for an HTTP 400 on anything else.
"""

from __future__ import annotations

import base64
import binascii
import json
import math

from server.kv.registry.sql import SessionRow

__all__ = ["parse_session_cursor", "session_cursor"]

_VERSION = 1


def session_cursor(row: SessionRow) -> str:
    """The cursor that continues a listing after ``row`` (the last row of a page)."""
    raw = json.dumps([_VERSION, row.last_used_at, row.id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def parse_session_cursor(cursor: str) -> tuple[float, str]:
    """(last used at, session id) of a cursor from :func:`session_cursor`; ValueError when
    ``cursor`` is not one."""
    bad = ValueError(
        f"malformed session list cursor {cursor[:80]!r}: pass back the one a listing gave"
    )
    if not isinstance(cursor, str) or not cursor or len(cursor) > 1024:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        version, last_used_at, session_id = json.loads(raw)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise bad from exc
    ok = (
        version == _VERSION
        and isinstance(last_used_at, int | float)
        and not isinstance(last_used_at, bool)
        and math.isfinite(last_used_at)
        and isinstance(session_id, str)
        and session_id != ""
    )
    if not ok:
        raise bad
    return float(last_used_at), session_id
