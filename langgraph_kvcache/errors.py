"""The package's exception hierarchy.

Every error raised on purpose by ``langgraph_kvcache`` derives from :class:`KVCacheError`, so
callers can catch the package's failures in one place. Each subclass also derives from the
closest built-in (``ValueError``, ``RuntimeError``) so code written against the built-ins keeps
working. Messages say what went wrong and what to do about it.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error raised on purpose by ``langgraph_kvcache``."""


class CheckpointerError(KVCacheError):
    """Base class of the checkpointer's errors."""


class CheckpointerSetupError(CheckpointerError, RuntimeError):
    """The checkpoint tables are missing, too new, or could not be migrated.

    Raised by ``setup()`` when a migration fails, and by the savers when the database holds a
    schema version newer than this package knows (upgrade ``langgraph-kvcache``).
    """


class UnsupportedDatabaseError(CheckpointerError, ValueError):
    """The database URL or engine names a backend the checkpointer does not support.

    Supported: SQLite (``sqlite://``, ``sqlite+aiosqlite://``) and PostgreSQL through psycopg 3
    (``postgresql://``, ``postgresql+psycopg://``).
    """


class ThreadNotEmptyError(CheckpointerError, ValueError):
    """``copy_thread`` was asked to copy into a thread that already has checkpoints.

    Delete the target thread first (``delete_thread``) or copy to a new thread id.
    """


class UnstorableValueError(CheckpointerError, ValueError):
    """A value cannot be stored by the checkpointer's database as given.

    Raised before any SQL runs, e.g. for checkpoint metadata holding NUL characters on
    PostgreSQL (its JSONB text cannot hold them); the message says what to change.
    """
