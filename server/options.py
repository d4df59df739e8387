"""How a setting is given from outside: parsers for text values and the per-field metadata.

:class:`Setting` is the metadata of one :class:`server.config.ServerConfig` field: its flag, its
``LGKV_*`` variable, how its text is parsed, its one-line help, and its key in vLLM's
``kv_connector_extra_config`` when the connector reads it. :func:`setting` declares a field
with it. :mod:`server.config` derives everything else (environment, flags, ``--help``, docs,
the connector dict) from these declarations, so each setting is spelled out once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag/variable and the accepted form."""


def parse_size(value: str | int, *, name: str = "size") -> int:
    """Parse a byte count such as ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` or ``4096``.

    Raises:
        ConfigError: the text is not a non-negative number with a known unit.
    """
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0 bytes, got {value}")
        return value
    m = _SIZE.fullmatch(str(value))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ConfigError(
            f"{name}: cannot read {value!r} as a size; use bytes or a unit, e.g. 512MiB, 2GiB, 1GB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def parse_bool(value: str, *, name: str) -> bool:
    """Parse ``1/0, true/false, yes/no, on/off`` (case-insensitive)."""
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}: expected 1/0, true/false, yes/no or on/off, got {value!r}")


def parse_seconds(value: str | float | None, *, name: str) -> float | None:
    """Parse a positive number of seconds; ``None``, ``""``, ``0`` and ``none`` mean no TTL."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() in ("", "none", "null", "0"):
            return None
        try:
            value = float(value)
        except ValueError as exc:
            raise ConfigError(f"{name}: expected seconds as a number, got {value!r}") from exc
    if value < 0 or not math.isfinite(value):
        raise ConfigError(f"{name}: seconds must be a finite number >= 0, got {value}")
    return float(value) or None


def parse_int(value: str, *, name: str) -> int:
    """Parse a decimal integer."""
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from exc


def parse_rate(value: str | float, *, name: str) -> float:
    """Parse a rate per second: a finite number >= 0 (0: no limit)."""
    try:
        rate = float(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: expected a number per second, got {value!r}") from exc
    if not math.isfinite(rate) or rate < 0:
        raise ConfigError(f"{name}: a rate must be a finite number >= 0, got {value!r}")
    return rate


def parse_share(value: str | float, *, name: str) -> float:
    """Parse a share of a whole: a number in ``0..1`` (``0.25``), or a percentage (``25%``)."""
    text = str(value).strip()
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: expected a share such as 0.25 or 25%, got {value!r}") from exc
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"{name}: a share must be within 0..1 (0%..100%), got {value!r}")
    return share


def parse_text(value: str, *, name: str) -> str:
    """Text as given."""
    return value


def parse_lower(value: str, *, name: str) -> str:
    """Text, stripped and lower-cased (choices)."""
    return value.strip().lower()


def parse_path(value: str, *, name: str) -> Path:
    """A filesystem path."""
    return Path(value)


def parse_keys(value: str, *, name: str) -> tuple[str, ...]:
    """Comma-separated keys (for a variable; flags take several words)."""
    return tuple(k.strip() for k in value.split(",") if k.strip())


Parser = Callable[..., Any]
"""``parse(text, *, name=...)`` -> value; raises :class:`ConfigError` naming ``name``."""


@dataclass(frozen=True)
class Setting:
    """How one configuration field is set from outside (the one row of its table entry)."""

    help: str
    """One line for ``--help``."""
    flag: str | None = None
    """Command-line flag (``--kv-ram-bytes``); ``None``: settable in code only."""
    env: str | None = None
    """Environment variable (``LGKV_KV_RAM_BYTES``); ``None``: none."""
    parse: Parser = parse_text
    """Reads the flag's and the variable's text."""
    connector: str | None = None
    """Key of the value in ``kv_connector_extra_config``; ``None``: the connector never sees it."""
    vllm: bool = False
    """The flag is vLLM's own too (``--port``): ``--help`` shows it in vLLM's groups."""
    switch: bool = False
    """A flag without a value (``store_true``)."""
    negated: bool = False
    """The flag and the variable turn the field off (``--no-kv-offload``)."""
    many: bool = False
    """The flag takes several values (``--api-key A B``)."""
    choices: tuple[str, ...] | None = None
    """Accepted values, when there is a fixed list."""
    size: bool = False
    """A byte count: ``--help`` shows it with units."""


def setting(default: Any = None, *, default_factory: Any = None, **meta: Any) -> Any:
    """A dataclass field carrying its :class:`Setting` (keyword arguments of Setting)."""
    info = {"setting": Setting(**meta)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=info)
    return field(default=default, metadata=info)
