"""Command-line flags from the settings table of :class:`server.config.ServerConfig`.

:func:`add_flags` adds one flag per field that has one (all of them, or only those vLLM lacks,
as the ``LangGraphKVCache`` group of ``--help``); :func:`flag_values` reads back the fields the
command line set. Parsing and validation are the fields' own (:class:`server.options.Setting`),
so a flag and its ``LGKV_*`` variable accept the same values and fail with the same message.
"""

from __future__ import annotations

import argparse
from typing import Any

from server.config import settings_table
from server.options import ConfigError, Setting

__all__ = ["add_flags", "flag_values"]


def add_flags(parser: argparse.ArgumentParser, *, include_vllm: bool) -> None:
    """Add the table's flags to ``parser``: all of them, or only those vLLM lacks (a group).

    Each flag's value lands in the namespace under its field name (see :func:`flag_values`).
    """
    target: Any = parser
    if not include_vllm:
        target = parser.add_argument_group(
            "LangGraphKVCache",
            "The session KV cache (RAM + disk tiers). Each flag also reads an LGKV_* variable.",
        )
    for name, s in settings_table():
        if s.flag is None or (s.vllm and not include_vllm):
            continue
        if s.switch:
            target.add_argument(s.flag, dest=name, action="store_true", default=None, help=s.help)
        elif s.many:
            target.add_argument(s.flag, dest=name, nargs="+", action="extend", help=s.help)
        else:
            target.add_argument(s.flag, dest=name, type=_argtype(s), choices=s.choices, help=s.help)


def _argtype(s: Setting) -> Any:
    def parse(text: str) -> Any:
        try:
            return s.parse(text, name=s.flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse.__name__ = s.flag or "value"
    return parse


def flag_values(ns: argparse.Namespace) -> dict[str, object]:
    """The fields given on the command line (parsed by a parser built with :func:`add_flags`)."""
    out: dict[str, object] = {}
    for name, s in settings_table():
        value = getattr(ns, name, None)
        if s.flag is None or value is None:
            continue
        if s.switch:
            if value:
                out[name] = not s.negated
        elif s.many:
            out[name] = tuple(value)
        else:
            out[name] = value
    return out
