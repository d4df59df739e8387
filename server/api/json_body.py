"""How deep a JSON body nests, read from its bytes before anything parses it.

Parsing a body only to learn that it nests too deep, and walking the parsed tree on the event
loop, let one tenant's large bodies stall every other request (four 8 MiB bodies made another
tenant's ``GET /v1/models`` take 32 s). :func:`nesting_depth` reads the raw bytes instead, in C
and numpy: strings are cut out with one regular expression (brackets inside them do not
count), every byte but ``[]{}`` is deleted, and the running sum of opens (+1) and closes (-1)
peaks at the depth. About 0.06 s for 12 MiB of numbers, 0.1 s for 9 MiB of small arrays.
"""

from __future__ import annotations

import re

import numpy as np

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
"""A JSON string with its escapes (unrolled: linear, no backtracking)."""
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_OPENS = (ord("["), ord("{"))


def nesting_depth(raw: bytes) -> int:
    """Deepest nesting of arrays and objects in the JSON text ``raw`` (a scalar is 0, ``[]``
    is 1). Brackets inside strings do not count. For malformed text the figure is only an
    estimate (the parser refuses such text anyway)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == _OPENS[0]) | (codes == _OPENS[1]), 1, -1).astype(np.int32)
    return max(0, int(np.cumsum(steps).max()))
