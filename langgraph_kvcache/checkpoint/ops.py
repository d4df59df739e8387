"""The shape of a saver operation, shared by :mod:`.base` and the modules it is split into.

Each operation is a generator of :class:`Stmt`: it yields a statement, is sent the rows it
returned, and finally returns its result; the sync and async savers differ only in how they run
it (see :mod:`.base`).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from sqlalchemy import Executable

T = TypeVar("T")


@dataclass(frozen=True)
class Stmt:
    """One statement an operation wants run, with its parameters."""

    statement: Executable
    params: list[dict[str, Any]] | dict[str, Any] | None = None
    """A dict, or a list of dicts for an executemany."""
    fetch: bool = False
    """Whether the operation wants the result rows (as mappings) back."""
    plain: bool = False
    """A prebuilt statement whose parameters are str, int, bytes or JSON-typed and whose results
    are str, int or bytes: a driver may run its compiled SQL on the DBAPI connection directly
    (see :func:`langgraph_kvcache.checkpoint.plain.run_plain`)."""


Op = Generator[Stmt, list[Any], T]
"""A saver operation: yields statements, is sent their rows, returns its result."""

Mode = Literal["read", "single", "write"]
"""How a driver runs an operation: ``read`` (reads only), ``single`` (one write statement, atomic
by itself) or ``write`` (several statements in one write transaction)."""
