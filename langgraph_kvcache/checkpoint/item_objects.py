"""Decoded list items (chat messages) remembered by digest and handed out as copies.

Reading a checkpoint is bound by deserializing its message list: every message is rebuilt
through its pydantic constructor and validators (about 5-10 us each), and an agent reads the
same messages again at every step. :class:`ItemObjects` keeps the object a decode produced
for an item (content-addressed by its digest, so an entry never goes stale) and hands out a
*copy* on every later read, so no caller ever shares an object with the cache or with another
caller: mutating a returned message changes neither.

Only values whose copy is provably equal to a fresh decode are remembered: instances of
LangChain's ``BaseMessage`` subclasses (pydantic v2 models) whose field values, extra fields
and private attributes are plain data (``str``, ``int``, ``float``, ``bool``, ``None``,
``bytes``, and ``dict`` with ``str`` keys / ``list`` of those, any depth). A copy is what
pydantic's shallow ``__copy__`` makes (new ``__dict__``, fields set, extra and private maps)
with every ``dict`` and ``list`` value copied all the way down, so it has the same type, the
same field values and the same fields set as the object the decode built, and serializes to
the same bytes; an object whose first copy is not equal to it is not remembered. Anything
else (a message carrying another object, a non-message item) is decoded on every read, as
before. An item is remembered on its second decode (:data:`SEEN_ENTRIES`). Thread-safe;
bounded by an estimate of the objects' memory (oldest entries go first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage

OBJECT_CACHE_BYTES = 64 * 2**20
"""Default bound of the remembered decoded items, in estimated bytes (:func:`_charge`)."""

SEEN_ENTRIES = 65536
"""Digests of items decoded once and not remembered (yet) that a cache keeps, oldest first
out: an item is remembered when it is decoded a second time, so a one-off read (a thread read
once by this process) pays no copy."""

_SCALARS = frozenset((str, int, float, bool, type(None), bytes))

_set = object.__setattr__

_SLOTS = ("__dict__", "__pydantic_extra__", "__pydantic_fields_set__", "__pydantic_private__")
"""A pydantic v2 model's state (what its ``__copy__`` copies)."""


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data that :func:`_copy` copies completely."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if depth > 32:
        return False
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or (type(item) not in _SCALARS and not _plain(item, depth + 1)):
                return False
        return True
    if kind is list:
        for item in value:
            if type(item) not in _SCALARS and not _plain(item, depth + 1):
                return False
        return True
    return False


def _copy(value: Any) -> Any:
    """A copy of plain data (:func:`_plain`) sharing no ``dict`` or ``list`` with it."""
    kind = type(value)
    if kind is dict:
        return {k: _copy(v) for k, v in value.items()}
    if kind is list:
        return [_copy(v) for v in value]
    return value


def _mutable_fields(obj: Any) -> tuple[str, ...] | None:
    """The names of ``obj``'s fields holding a ``dict`` or ``list`` (copied on every read),
    or None when ``obj`` may not be remembered (see the module docstring)."""
    if not isinstance(obj, BaseMessage) or not all(hasattr(obj, a) for a in _SLOTS):
        return None
    state = obj.__dict__
    extra = obj.__pydantic_extra__
    private = obj.__pydantic_private__
    for part in (state, extra or {}, private or {}):
        if type(part) is not dict or not _plain(part):
            return None
    return tuple(k for k, v in state.items() if type(v) in (dict, list))


def _charge(size: int) -> int:
    """Estimated memory of a remembered object decoded from ``size`` serialized bytes."""
    return 4 * size + 1024


class _Entry:
    """A remembered object and what :meth:`copy` must copy deeply."""

    __slots__ = ("charge", "cls", "mutable", "obj")

    def __init__(self, obj: Any, mutable: tuple[str, ...], charge: int) -> None:
        self.obj = obj
        self.cls = type(obj)
        self.mutable = mutable
        self.charge = charge

    def copy(self) -> Any:
        """A new object equal to :attr:`obj` sharing no ``dict`` or ``list`` with it: what
        pydantic's ``__copy__`` does (the same four slots), with the plain-data values copied
        all the way down."""
        obj = self.obj
        new = self.cls.__new__(self.cls)
        state = obj.__dict__.copy()
        for name in self.mutable:
            value = state[name]
            state[name] = _copy(value) if value else type(value)()
        extra = obj.__pydantic_extra__
        private = obj.__pydantic_private__
        _set(new, "__dict__", state)
        _set(new, "__pydantic_extra__", None if extra is None else _copy(extra))
        _set(new, "__pydantic_fields_set__", obj.__pydantic_fields_set__.copy())
        _set(new, "__pydantic_private__", None if private is None else _copy(private))
        return new


class ItemObjects:
    """Decoded list items by digest (see the module docstring).

    Args:
        max_bytes: Bound of the remembered objects' estimated memory; ``0`` remembers none.
    """

    def __init__(self, max_bytes: int = OBJECT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._data: OrderedDict[bytes, _Entry] = OrderedDict()
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def copies(self, digests: Sequence[bytes]) -> tuple[list[Any], list[int]]:
        """Fresh copies of the remembered items among ``digests``, in order, with None at the
        positions of the others; and those positions (empty when all were remembered)."""
        get = self._data.get
        out: list[Any] = []
        missing: list[int] = []
        for i, digest in enumerate(digests):
            entry = get(digest)
            if entry is None:
                missing.append(i)
                out.append(None)
            else:
                out.append(entry.copy())
        return out, missing

    def keep(self, digest: bytes, obj: Any, size: int) -> Any:
        """Remember ``obj``, just decoded from ``size`` serialized bytes of the item
        ``digest``, when it may be (module docstring) and this is the item's second decode
        (:data:`SEEN_ENTRIES`). Returns what the caller may hand out: ``obj`` itself when it
        was not remembered, else a copy (the cache keeps ``obj``)."""
        if self.max_bytes <= 0 or digest in self._data:
            return obj
        with self._lock:
            if digest not in self._seen:  # first decode: only note it
                self._seen[digest] = None
                if len(self._seen) > SEEN_ENTRIES:
                    self._seen.popitem(last=False)
                return obj
            del self._seen[digest]
        mutable = _mutable_fields(obj)
        charge = _charge(size)
        if mutable is None or charge > self.max_bytes:
            return obj
        entry = _Entry(obj, mutable, charge)
        handed = entry.copy()
        if handed != obj or handed.model_fields_set != obj.model_fields_set:
            return obj  # not a faithful copy (a model this module does not know): decode
        with self._lock:
            if digest not in self._data:
                self._data[digest] = entry
                self._size += charge
                while self._size > self.max_bytes:
                    _, old = self._data.popitem(last=False)
                    self._size -= old.charge
        return handed

    def __len__(self) -> int:
        return len(self._data)
