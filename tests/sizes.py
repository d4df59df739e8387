"""Scenario sizes: the short version for ``make test``, the full size for ``make test-long``.

A test that needs many threads, turns or tool calls to show its behaviour uses
``size(short, long)``: the short size still proves the behaviour (each such test asserts what
makes it meaningful, e.g. that the threads really overflowed vLLM's own cache), the full size is
what the scenario was written for. ``LGKV_TEST_LONG=1`` (``make test-long``) selects it.
"""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")

LONG = os.environ.get("LGKV_TEST_LONG") == "1"
"""True under ``make test-long``."""


def size(short: T, long: T) -> T:
    """``long`` under ``make test-long``, ``short`` otherwise."""
    return long if LONG else short
