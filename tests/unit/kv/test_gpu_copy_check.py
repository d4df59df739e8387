"""``scripts/gpu_copy_check.py`` on CPU: the worker's CUDA copy path (one indexed copy per
layer, ``RamPool(batched=True)``) and its CPU path move blocks of vLLM's GPU cache layouts
(FlashAttention's ``[2, blocks, ...]``, MLA's latent) into the RAM pool and back bit for bit
(``int8`` within its bound), every layer at once and layer by layer, without touching other
blocks; and the script needs torch alone, as the GPU machine has no vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_copy_check.py"

BLOCKED = """
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"vllm", "redis", "fastapi", "transformers", "pydantic",
                                   "httpx", "langchain_core", "langgraph", "sqlalchemy"}:
            raise ImportError(f"the GPU check must not import {name}")
sys.meta_path.insert(0, Block())
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_blocks_come_back_on_both_paths_with_torch_alone(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", BLOCKED, str(SCRIPT), "--device", "cpu", "--quick",
         "--reps", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = (tmp_path / "gpu_copy_check.txt").read_text()
    checks = [line for line in report.splitlines() if line.startswith("  ok")]
    assert "FAIL" not in report and report.rstrip().endswith("byte checks: all passed")
    paths = {(line.split()[1], line.split()[2], line.split()[3]) for line in checks}
    assert paths == {
        ("flash_attn", "auto", "batched"),
        ("flash_attn", "int8", "batched"),
        ("mla", "auto", "batched"),
        ("flash_attn", "auto", "per"),
    }
    assert len(checks) == 8  # each every layer at once and layer by layer
    assert "link: host -> device" in report and "load / link" in report
