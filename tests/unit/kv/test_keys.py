"""Block keys are matched as a whole: a trailing newline or suffix is not a key."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.kv.keys import InvalidBlockKey, block_path, check_key, parse_block_name

KEY = "0123456789abcdef" * 2


def test_a_key_is_accepted() -> None:
    assert check_key(KEY) == KEY
    assert parse_block_name(Path(f"{KEY}.kvb")) == (KEY, None)
    assert parse_block_name(Path(f"{KEY}.r1.kvb")) == (KEY, 1)


@pytest.mark.parametrize("bad", [KEY + "\n", KEY + "\n\n", "\n" + KEY, KEY.upper(), KEY[:15]])
def test_check_key_refuses_what_is_not_a_whole_key(bad: str) -> None:
    with pytest.raises(InvalidBlockKey):
        check_key(bad)
    with pytest.raises(InvalidBlockKey):
        block_path(Path("/blocks"), bad)


@pytest.mark.parametrize("name", [f"{KEY}\n.kvb", f"{KEY}.r1\n.kvb", f"{KEY}.r12345.kvb"])
def test_block_names_with_a_newline_are_not_blocks(name: str) -> None:
    assert parse_block_name(Path(name)) is None
