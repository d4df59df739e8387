"""Every Python snippet of README.md and docs/ runs, as written, against the real server.

Snippets drifted from the code before (``from_conn_string`` used without ``with``, a served
model name the README's client did not send). Each ```` ```python ```` block runs here in a
fresh interpreter, in an empty folder (its ``sqlite:///agent.db`` lands there), against
``smollm2_server`` (the default model under its default name): the only change made to the
text is the server's address, ``http://127.0.0.1:8000``, replaced by the test server's (and
``LGKV_SERVER_URL`` set, for ``ChatKVCache()``). A snippet that fails fails the test with its
file, its first line and its output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

REPO_ROOT = Path(__file__).resolve().parents[3]
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
DEFAULT_URL = "http://127.0.0.1:8000"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets() -> list[tuple[str, str]]:
    """(``file:line``, code) of every Python block of README.md and docs/*.md."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append((f"{path.relative_to(REPO_ROOT)}:{line}", match.group(1)))
    return out


SNIPPETS = snippets()


def test_the_docs_have_snippets() -> None:
    places = {where.split(":")[0] for where, _ in SNIPPETS}
    assert {"README.md", "docs/quickstart.md", "docs/agents.md"} <= places, places


@pytest.mark.parametrize(("where", "code"), SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_runs(where: str, code: str, smollm2_server: Any, tmp_path: Path) -> None:
    code = code.replace(DEFAULT_URL, smollm2_server.base_url)
    env = {**os.environ, "LGKV_SERVER_URL": smollm2_server.base_url, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"the snippet at {where} failed:\n{code}\n--- its output:\n{done.stdout}\n{done.stderr}"
    )
    if "input_token_details" in code:  # it prints the cache's figures: a later call read some
        reads = [int(n) for n in re.findall(r"'cache_read': (\d+)", done.stdout)]
        assert reads and max(reads) > 0, done.stdout
    if "cached_tokens" in code:
        assert int(done.stdout.split()[-1]) > 0, done.stdout
