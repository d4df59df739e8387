"""Metadata filters for ``list(filter=...)``, and what metadata each database can store.

Any JSON key works, whatever it holds (quotes, dots, brackets, NUL): keys are bound as
parameters, never spliced into SQL or JSON paths.

- PostgreSQL: JSONB containment (``metadata @> :filter``), as the PostgreSQL saver. JSONB text
  cannot hold NUL (``\\u0000``), so metadata with NUL cannot be stored there (``put`` raises
  :class:`~langgraph_kvcache.errors.UnstorableValueError`) and a filter with NUL matches no
  checkpoint.
- SQLite: per key, ``EXISTS (SELECT 1 FROM json_each(metadata) WHERE key = :key AND ...)``
  comparing the JSON type and value (``true`` is not ``1``; objects and arrays compare as
  minified JSON text). SQLite's JSON functions cut text at NUL, so entries whose key or value
  holds NUL are checked in Python on the decoded metadata (:func:`python_matches`) instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sqlalchemy import and_, bindparam, exists, func, select, type_coerce
from sqlalchemy.dialects import postgresql

from langgraph_kvcache.checkpoint.schema import checkpoints
from langgraph_kvcache.errors import UnstorableValueError


def has_nul(value: Any) -> bool:
    """Whether a JSON-like value holds NUL in a key or a string, at any depth."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(has_nul(k) or has_nul(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(has_nul(v) for v in value)
    return False


def check_storable(dialect: str, metadata: Mapping[str, Any]) -> None:
    """Raise :class:`UnstorableValueError` for metadata the database cannot store (NUL in
    PostgreSQL's JSONB), before any SQL runs."""
    if dialect == "postgresql" and has_nul(metadata):
        raise UnstorableValueError(
            "PostgreSQL cannot store NUL characters (\\x00) in checkpoint metadata (JSONB text); "
            "remove or replace them (e.g. with '\\ufffd') in the metadata keys and values, or "
            "use SQLite."
        )


class MetadataFilter:
    """A ``list(filter=...)`` split into SQL clauses and, where SQL cannot say it, a Python
    check on the decoded metadata. ``never``: no checkpoint can match (skip the query)."""

    def __init__(self, dialect: str, filter: Mapping[str, Any]) -> None:
        self.clauses: list[Any] = []
        self.python: dict[str, Any] = {}
        self.never = False
        col = checkpoints.c.metadata
        if dialect == "postgresql":
            if has_nul(filter):
                self.never = True
            else:
                self.clauses.append(type_coerce(col, postgresql.JSONB).contains(dict(filter)))
            return
        for key, value in filter.items():
            if has_nul(key) or has_nul(value):
                self.python[key] = value
            else:
                self.clauses.append(_sqlite_entry(key, value))

    def matches(self, metadata: Mapping[str, Any]) -> bool:
        """The Python part of the filter, on one checkpoint's metadata."""
        return all(python_matches(metadata, k, v) for k, v in self.python.items())


def _sqlite_entry(key: str, value: Any) -> Any:
    """``metadata`` has ``key`` with ``value`` (SQLite, no NUL)."""
    each = func.json_each(checkpoints.c.metadata).table_valued("key", "type", "value")
    cond = [each.c.key == bindparam(None, key)]
    if value is None:
        cond.append(each.c.type == "null")
    elif isinstance(value, bool):
        cond.append(each.c.type == ("true" if value else "false"))
    elif isinstance(value, (dict, list)):
        cond.append(each.c.type.in_(("object", "array")))
        cond.append(each.c.value == func.json(bindparam(None, json.dumps(value))))
    elif isinstance(value, (int, float)):
        cond.append(each.c.type.in_(("integer", "real")))
        cond.append(each.c.value == bindparam(None, value))
    else:
        cond.append(each.c.type == "text")
        cond.append(each.c.value == bindparam(None, value))
    return exists(select(1).select_from(each).where(and_(*cond)))


def python_matches(metadata: Mapping[str, Any], key: str, value: Any) -> bool:
    """``metadata[key]`` equals ``value`` as JSON would say (``True`` is not ``1``)."""
    if key not in metadata:
        return False
    found = metadata[key]
    if isinstance(value, bool) or isinstance(found, bool):
        return found is value
    return found == value


def has_metadata_key(dialect: str, key: str) -> Any:
    """A clause true for checkpoints whose metadata has ``key``."""
    col = checkpoints.c.metadata
    if dialect == "postgresql":
        return type_coerce(col, postgresql.JSONB).has_key(key)
    each = func.json_each(col).table_valued("key")
    return exists(select(1).select_from(each).where(each.c.key == bindparam(None, key)))
