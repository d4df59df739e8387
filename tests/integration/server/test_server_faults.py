"""Crashes and damage against one real server (a private copy of the tiny model).

The short version of ``benchmarks/faults.py`` (whose scenario functions, and the file helpers
of ``benchmarks/fault_files.py``, these tests call):
engine log lines in vLLM's format, SIGTERM right after an answer keeps every block of that
turn, a damaged block file makes ``cached_tokens`` stop at the damage, kill -9 round leaves no
shared memory after the restart, a lost registry takes its block files with it, and weights
swapped in place never reuse the old weights' KV. The tests run in file order on one server.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import fault_files
import faults

from tests.integration.conftest import USERS_PROCESSES

if TYPE_CHECKING:
    from tests.integration.conftest import ServerFactory, ServerProcess

pytestmark = pytest.mark.vllm

SESSION = "faults-sigterm"


@pytest.fixture(scope="module")
def server(
    start_server: ServerFactory, server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> ServerProcess:
    model = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(server_model_dir, model)  # the weights test rewrites it
    # the crash tests kill the processes users run, shared-memory queues included
    return start_server(model_dir=model, env=USERS_PROCESSES)


def test_engine_process_logs_in_vllm_format(server: ServerProcess) -> None:
    assert server.proc is not None
    text = server.log_path.read_text(errors="replace")
    lines = re.findall(
        r"\((\w+) pid=(\d+)\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[connector\.py:\d+\] "
        r"SessionKVConnector: \d+ RAM slots",
        text,
    )
    assert lines, text[-3000:]
    assert all(int(pid) != server.proc.pid for _, pid in lines)  # the engine core, not the API


def test_sigterm_right_after_an_answer_keeps_every_block(server: ServerProcess) -> None:
    figures = faults.sigterm_round(server, session=SESSION)
    assert "--shutdown-timeout" not in " ".join(server.command())  # the server's own default
    assert figures["blocks of the last turn"] >= 10
    assert figures["blocks missing after SIGTERM"] == 0
    assert figures["5xx responses"] == 0


def test_damaged_block_file_cached_tokens_count_only_what_loaded(server: ServerProcess) -> None:
    prompt = faults.long_prompt(SESSION, 14)  # the turn above: on disk only since the restart
    fault_files.damage_session(server, SESSION, 2, "flipped")
    tally = faults.Tally()
    _, cached = faults.checked_turn(server, prompt, SESSION, tally)
    assert cached == 2 * faults.BLOCK  # vLLM recomputed from the damaged block on
    assert tally.identical == tally.answers == 1 and tally.errors_5xx == 0
    assert "checksum mismatch" in server.log_path.read_text(errors="replace")
    assert fault_files.corrupt_files(server.cache_dir) == 0  # the damaged file went


def test_kill9_rounds_leave_no_shared_memory_then_lost_registry_is_recovered(
    server: ServerProcess,
) -> None:
    """A kill -9 round (``benchmarks/faults.py`` runs ten); before the restart the registry is
    deleted and a block file truncated too: each recovery logs one warning naming its file, and
    afterwards the registry and the files agree (no session, no file)."""
    registry = server.cache_dir / "sessions.sqlite3"
    damaged: list[Path] = []
    keys: list[str] = []

    def lose_registry(round_: int) -> None:
        if round_ == 0:
            keys.extend(fault_files.session_keys(server.cache_dir, SESSION))
            damaged.append(fault_files.block_files(server.cache_dir, keys[3])[0])
            fault_files.damage(damaged[0], "truncated")
            for suffix in ("", "-wal", "-shm"):
                Path(f"{registry}{suffix}").unlink(missing_ok=True)

    log_start = server.log_path.stat().st_size
    figures = faults.kill_rounds(server, rounds=1, conversations=2, before_restart=lose_registry)
    assert figures["shm segments left by kill -9"] > 0  # what vLLM's engine leaves behind
    assert figures["shm segments left after restart"] == 0
    assert figures["corrupt block files"] == 0
    assert figures["5xx responses"] == 0
    assert figures["greedy answers identical to cache-off"] == "4/4"
    log = server.log_path.read_text(errors="replace")[log_start:]
    assert re.search(r"WARNING .*reclaimed \d+ shared-memory segment", log)
    assert re.search(rf"WARNING .*KV block file {re.escape(str(damaged[0]))} is \d+ bytes", log)
    assert re.search(rf"WARNING .*session registry {re.escape(str(registry))} is missing", log)
    r = httpx.get(f"{server.base_url}/v1/sessions/{SESSION}", timeout=30)
    assert r.status_code == 404
    assert keys and not any(fault_files.block_files(server.cache_dir, k) for k in keys)


def test_weights_swapped_in_place_never_reuse_old_kv(server: ServerProcess) -> None:
    figures = faults.swapped_weights(server)
    assert figures["stale tokens reused"] == 0
    assert figures["answers identical after swap"] == "3/3"
    assert figures["5xx responses"] == 0
