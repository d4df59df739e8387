"""Execute each example notebook end to end in a fresh kernel, offline, as CI does.

Each notebook starts its own server (examples/server_process.py) on a temp cache dir, checks
its own results with ``assert`` (cached tokens after the first turn, after a restart, on a
fork...) and stops the server in its last cell. A failing cell fails the test with the cell's
source and error; the kernel is then shut down, which also stops the notebook's server
(``ServerProcess`` registers ``atexit``). The figure printed per notebook is its run time.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tests.conftest import ENGINE_THREADS

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO_ROOT / "examples").glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 600
"""Longest a single cell may run (a server start on a busy 2-core machine takes ~1 minute)."""

PLOTS = {"02_agentic_rag": 1, "05_tool_agent": 1}
"""Inline PNG figures a notebook must produce (matplotlib)."""

pytestmark = pytest.mark.vllm


def test_the_five_notebooks_are_found() -> None:
    names = [nb.name for nb in NOTEBOOKS]
    assert names == [
        "01_quickstart.ipynb",
        "02_agentic_rag.ipynb",
        "03_human_in_the_loop.ipynb",
        "04_fork_and_rewind.ipynb",
        "05_tool_agent.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernel and the server it starts inherit this: the forward pass gets this worker's cores
    monkeypatch.setenv("OMP_NUM_THREADS", ENGINE_THREADS)
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        f"{path.name} is committed with outputs; clear them (Jupyter: Clear All Outputs)"
    )
    # A kernel shut down after a failed cell stops its server at exit: give it time to.
    km = KernelManager(kernel_name="python3", shutdown_wait_time=90)
    client = NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO_ROOT)}},
    )
    t0 = time.monotonic()
    try:
        client.execute()
    except CellExecutionError as exc:
        pytest.fail(f"{path.name} failed:\n{exc}", pytrace=False)
    finally:
        # nbclient leaves a kernel it did not create running (about 1 GB each): shut it down.
        if km.has_kernel:
            km.shutdown_kernel(now=False)
    elapsed = time.monotonic() - t0
    pngs = sum(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    )
    assert pngs >= PLOTS.get(path.stem, 0), f"{path.name} showed {pngs} inline PNG plots"
    printed = [
        out.get("text", "")
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stdout"
    ]
    print(f"\n----- {path.name}: ran in {elapsed:.0f}s; its output:\n{''.join(printed)}")
