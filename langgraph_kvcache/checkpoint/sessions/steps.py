"""The steps the session keeper's logic yields, and the drivers that run them.

:class:`~.keeper.SessionKeeper` writes its logic once, as generators (:data:`Steps`) that yield
:class:`Sql` (run an operation through the saver's :class:`Runner`) and :class:`Request` (call
the session API client); :func:`drive` runs them with a sync runner and ``KVCacheClient``,
:func:`adrive` with an async runner and ``AsyncKVCacheClient``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from langgraph_kvcache.checkpoint.base import Mode, Op

__all__ = ["Request", "Runner", "Sql", "Step", "StepRun", "Steps", "adrive", "drive"]

T = TypeVar("T")
R = TypeVar("R", covariant=True)


@dataclass(frozen=True)
class Runner(Generic[R]):
    """What a keeper needs of its saver's database, and all it gets.

    ``Runner[Any]`` for a sync saver; ``Runner[Awaitable[Any]]`` for an async one.
    """

    dialect: str
    """``"sqlite"`` or ``"postgresql"``."""
    run: Callable[[Op[Any], Mode], R]
    """Run an operation as one transaction of the given mode and return its result (sync), or
    an awaitable of it (async); the database's errors propagate, nothing is committed then."""
    delete_threads: Callable[[Sequence[str]], Op[None]]
    """The saver's operation that deletes threads' checkpoints, blobs and writes (run by
    ``sweep_expired`` inside its own transaction)."""


@dataclass(frozen=True)
class Sql:
    """Step: run ``op`` through the keeper's :class:`Runner`; sent its result."""

    op: Op[Any]
    mode: Mode = "read"

    def make(self, client: Any, runner: Runner[Any]) -> Any:
        """Run the operation (an awaitable of its result with an async runner)."""
        return runner.run(self.op, self.mode)


ClientMethod = Literal[
    "create_session", "update_session", "delete_session", "copy_session", "prefetch", "pin",
    "unpin", "list_sessions",
]  # fmt: skip


@dataclass(frozen=True)
class Request:
    """Step: call ``method`` of the keeper's session API client (sync or async: the two have the
    same methods); sent its result, or thrown its
    :class:`~langgraph_kvcache.client.KVCacheClientError`."""

    method: ClientMethod
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def make(self, client: Any, runner: Runner[Any]) -> Any:
        """Call the client (an awaitable of the result with an async client)."""
        return getattr(client, self.method)(*self.args, **self.kwargs)


Step = Sql | Request
Steps = Generator[Step, Any, T]
"""Keeper logic: yields steps, is sent their results (or thrown their errors), returns ``T``."""


@dataclass(frozen=True)
class Outcome:
    """What a step came to: its value, or the error it raised."""

    value: Any = None
    error: Exception | None = None


def _outcome(step: Step, client: Any, runner: Runner[Any]) -> Outcome:
    try:
        return Outcome(step.make(client, runner))
    except Exception as exc:  # for the steps to handle or re-raise
        return Outcome(error=exc)


async def _aoutcome(step: Step, client: Any, runner: Runner[Any]) -> Outcome:
    try:
        return Outcome(await step.make(client, runner))
    except Exception as exc:  # for the steps to handle or re-raise
        return Outcome(error=exc)


def drive(steps: Steps[T], client: Any, runner: Runner[Any]) -> T:
    """Run keeper steps to their result: SQL through a sync ``runner``, requests through a
    ``KVCacheClient``. Raises what the steps do not handle."""
    run = StepRun(steps)
    while run.step is not None:
        run.answer(_outcome(run.step, client, runner))
    return run.result


async def adrive(steps: Steps[T], client: Any, runner: Runner[Awaitable[Any]]) -> T:
    """:func:`drive` for an async ``runner`` and an ``AsyncKVCacheClient``."""
    run = StepRun(steps)
    while run.step is not None:
        run.answer(await _aoutcome(run.step, client, runner))
    return run.result


class StepRun(Generic[T]):
    """One run of keeper steps by a driver, which loops while :attr:`step` is not ``None``:
    it makes the step and hands its :class:`Outcome` to :meth:`answer`; :attr:`result` holds
    what the steps returned. Errors the steps do not handle propagate from :meth:`answer`."""

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self.step: Step | None = None
        self.result: T
        self._advance(lambda: next(steps))

    def answer(self, done: Outcome) -> None:
        """Send the step's value to the steps, or throw its error into them."""
        if done.error is not None:
            error = done.error
            self._advance(lambda: self._steps.throw(error))
        else:
            self._advance(lambda: self._steps.send(done.value))

    def _advance(self, resume: Callable[[], Step]) -> None:
        try:
            self.step = resume()
        except StopIteration as stop:
            self.step = None
            self.result = stop.value
