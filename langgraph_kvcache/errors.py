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


# ----------------------------------------------------------------------------- session API client
class KVCacheClientError(KVCacheError):
    """Base of every error raised by :class:`KVCacheClient` and :class:`AsyncKVCacheClient`."""


class SessionAPIError(KVCacheClientError):
    """The server answered the request with an error (HTTP 4xx/5xx).

    ``status_code`` is the HTTP status, ``message`` the server's own explanation and
    ``error_type`` the server's error type (``""`` when the body had none).
    """

    def __init__(self, message: str, *, status_code: int, error_type: str = "") -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.message = message
        self.status_code = status_code
        self.error_type = error_type


class SessionNotFoundError(SessionAPIError):
    """HTTP 404: no such session for this tenant (check the id and the API key)."""


class AuthenticationError(SessionAPIError):
    """HTTP 401: the server runs with ``--api-key`` and refused this client's key (none, or
    not one of its keys). Pass the key: ``kv_api_key=`` to the savers, ``api_key=`` to the
    clients, or set ``LGKV_API_KEY``."""


class SessionExistsError(SessionAPIError):
    """HTTP 409: the session already exists (pick another id, or pass ``overwrite=True``)."""


class ServerUnavailableError(KVCacheClientError, ConnectionError):
    """The server could not be reached, timed out, or answered 502/503/504."""


class RateLimitedError(ServerUnavailableError):
    """HTTP 429 with ``Retry-After``: the key made more session API calls than the server
    accepts for now (``--tenant-session-rate``); retry after :attr:`retry_after_s`. A
    :class:`ServerUnavailableError`, so the checkpointer keeps the call in its outbox."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# ----------------------------------------------------------------------------- chat model
class ToolCallCutError(KVCacheError, ValueError):
    """A forced tool call (``tool_choice`` ``"required"`` or a tool's name) ended at
    ``max_tokens`` before its arguments were complete (``finish_reason="length"``).

    Returned as is, the partial call would reach an agent loop as a plain text answer and end
    the run. Raise ``max_tokens`` for the call. ``message`` holds what the model returned.
    """

    def __init__(self, text: str, message: object) -> None:
        super().__init__(text)
        self.message = message
