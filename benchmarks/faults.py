"""Fault scenarios against a real server, with a table of figures.

Each scenario drives ``python -m server`` subprocesses (tiny random Llama by default, its own
cache folder) and compares every greedy answer with the same prompt sent under a fresh
``cache_salt`` (so nothing of it can come from a cache: the cache-off answer).

- ``kill``: R rounds of C conversations; after each round's last answer the server's whole
  process group gets SIGKILL (saves in flight), then it restarts: answers, corrupt block
  files, 5xx, shared-memory segments the dead engine left and what the restart reclaimed.
- ``sigterm``: one long turn, SIGTERM right after its answer, restart: blocks of that turn
  missing from disk.
- ``damaged``: a truncated, a bit-flipped and a swapped block file of one session: answers,
  5xx, and ``cached_tokens`` against the blocks before the first damaged one.
- ``weights``: the model's weights replaced in place (same folder and config, other random
  weights): prompt tokens served from the old weights' KV, answers.
- ``budget``: ``--kv-disk-bytes`` below one block: the start warning, answers.
- ``full-disk``: the disk tier on a small tmpfs that another writer fills: full-disk warnings,
  per-block write warnings, answers (needs root for ``mount``; skipped otherwise).

    python benchmarks/faults.py                       # every scenario, 10 kill rounds
    python benchmarks/faults.py --rounds 2 --only kill sigterm
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fault_files import (  # noqa: E402
    block_files,
    corrupt_files,
    count_lines,
    damage_session,
    existing,
    recorded_segments,
    session_keys,
)
from benchmarks.fault_server import ENGINE_ARGS, Server, kill_server, log_text  # noqa: E402

BLOCK = 128
"""Tokens per block on CPU."""


# ----------------------------------------------------------------------------- requests


@dataclass
class Tally:
    """What the requests of a scenario saw."""

    requests: int = 0
    errors_5xx: int = 0
    answers: int = 0
    identical: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, other: Tally) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def complete(
    server: Server,
    prompt: str,
    tally: Tally,
    *,
    session: str | None = None,
    salt: str | None = None,
    max_tokens: int = 8,
) -> dict | None:
    """A greedy completion; None (and a count) on a server error."""
    body: dict = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if session:
        body["session_id"] = session
    if salt:
        body["cache_salt"] = salt
    tally.requests += 1
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=300)
    if r.status_code >= 500:
        tally.errors_5xx += 1
        return None
    r.raise_for_status()
    return r.json()


def checked_turn(server: Server, prompt: str, session: str, tally: Tally) -> tuple[str, int]:
    """One session turn and its cache-off twin: (answer, cached tokens); counts agreement."""
    got = complete(server, prompt, tally, session=session)
    ref = complete(server, prompt, tally, salt=uuid.uuid4().hex)
    if got is None or ref is None:
        return "", 0
    usage = got["usage"]
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    tally.answers += 1
    tally.prompt_tokens += usage["prompt_tokens"]
    tally.cached_tokens += cached
    answer = got["choices"][0]["text"]
    tally.identical += answer == ref["choices"][0]["text"]
    return answer, cached


def long_prompt(tag: str, blocks: int) -> str:
    """A prompt of a little more than ``blocks`` full blocks (a line is about 17 tokens)."""
    lines = [f"note {i}: the quick brown fox jumps over dog {i}." for i in range(blocks * 8)]
    return f"{tag}. " + " ".join(lines)


# ----------------------------------------------------------------------------- scenarios

Figures = dict[str, object]


def kill_rounds(
    server: Server,
    rounds: int,
    conversations: int = 3,
    before_restart: Callable[[int], None] | None = None,
) -> Figures:
    """R rounds of C growing conversations, each round ended by SIGKILL of the group.

    ``before_restart(round)`` runs while the server is dead (to damage its files too)."""
    tally = Tally()
    prompts = [long_prompt(f"kill conversation {c}", 4) for c in range(conversations)]
    left, left_after = 0, 0
    for r in range(rounds):
        for c in range(conversations):
            answer, _ = checked_turn(server, prompts[c], f"kill-{c}", tally)
            prompts[c] += answer + f" Question {r}: what comes next?"
        names = recorded_segments(server.cache_dir)
        kill_server(server)
        dead = existing(names)
        left += len(dead)
        if before_restart is not None:
            before_restart(r)
        server.start()
        left_after += len(existing(dead))
    for c in range(conversations):  # the last round's KV, read back after the last crash
        checked_turn(server, prompts[c], f"kill-{c}", tally)
    return {
        **_tally(tally),
        "kill -9 rounds": rounds,
        "corrupt block files": corrupt_files(server.cache_dir),
        "shm segments left by kill -9": left,
        "shm segments left after restart": left_after,
    }


def sigterm_round(server: Server, session: str | None = None, blocks: int = 14) -> Figures:
    """SIGTERM right after a long turn's answer, restart, count the turn's missing blocks."""
    tally = Tally()
    session = session or f"sigterm-{uuid.uuid4().hex[:8]}"
    complete(server, long_prompt(session, blocks), tally, session=session, max_tokens=1)
    server.stop()
    server.start()
    keys = session_keys(server.cache_dir, session)
    missing = sum(1 for k in keys if not block_files(server.cache_dir, k))
    return {
        "blocks of the last turn": len(keys),
        "blocks missing after SIGTERM": missing,
        "5xx responses": tally.errors_5xx,
    }


def damaged_files(
    server: Server, kinds: Sequence[str] = ("truncated", "flipped", "swapped")
) -> Figures:
    """One session per kind of damage, all damaged while the server is stopped; every answer
    must match cache-off and cached_tokens must stop at each session's first damaged block."""
    tally = Tally()
    sessions = {how: f"damaged-{how}-{uuid.uuid4().hex[:6]}" for how in kinds}
    prompts = {how: long_prompt(sessions[how], 6) for how in kinds}
    for how in kinds:
        checked_turn(server, prompts[how], sessions[how], tally)
    server.stop()  # graceful: every block is on disk
    firsts = {how: 1 + i % 3 for i, how in enumerate(kinds)}  # first damaged block of each
    for how in kinds:
        damage_session(server, sessions[how], firsts[how], how)
    server.start()
    wrong_cached = 0
    for how in kinds:
        _, cached = checked_turn(server, prompts[how], sessions[how], tally)
        wrong_cached += cached != firsts[how] * BLOCK
    return {
        **_tally(tally),
        "cached_tokens beyond the damage": wrong_cached,
        "corrupt block files after": corrupt_files(server.cache_dir),
    }


def swap_weights(model_dir: Path, seed: int) -> None:
    """New random weights in place: same file, same tensor names, shapes and header."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    fresh = {
        k: torch.randn(v.shape, generator=gen, dtype=v.dtype) * v.float().std().clamp(min=0.02)
        for k, v in tensors.items()
    }
    save_file(fresh, path, metadata={"format": "pt"})


def swapped_weights(server: Server, seed: int = 1234) -> Figures:
    """Turns on one set of weights, the weights swapped in place, the same turns again."""
    tally = Tally()
    # No two prompts share a token (a block is reused up to its last shared token), so every
    # token read after the swap would be stale.
    prompts = [long_prompt(f"{name} weights", 5) for name in ("Amber", "Basalt", "Cobalt")]
    for c, prompt in enumerate(prompts):
        checked_turn(server, prompt, f"weights-{c}", tally)
    server.stop()
    swap_weights(server.model_dir, seed)
    server.start()
    after = Tally()
    stale = 0
    for c, prompt in enumerate(prompts):
        _, cached = checked_turn(server, prompt, f"weights-{c}", after)
        stale += cached
    return {
        "answers identical after swap": f"{after.identical}/{after.answers}",
        "stale tokens reused": stale,
        "5xx responses": tally.errors_5xx + after.errors_5xx,
    }


def small_budget(make: Callable[..., Server]) -> Figures:
    """A disk budget below one block: warned at start, answers unaffected."""
    server = make(disk_bytes="100000")
    server.start()
    try:
        tally = Tally()
        checked_turn(server, long_prompt("budget", 3), "budget", tally)
        warned = count_lines(log_text(server), r"--kv-disk-bytes \d+ cannot hold one block")
    finally:
        server.stop()
    return {**_tally(tally), "start warnings (budget < 1 block)": warned}


def full_disk(make: Callable[..., Server], size_mb: int = 20) -> Figures:
    """Disk tier on a small tmpfs; another writer fills it while conversations run."""
    mount = Path(tempfile.mkdtemp(prefix="lgkv-tmpfs-"))
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mount)],
            capture_output=True,
        ).returncode
        != 0
    ):
        mount.rmdir()
        return {"full disk": "skipped (mount -t tmpfs not permitted)"}
    try:
        server = make(disk_dir=mount / "blocks")
        server.start()
        tally = Tally()
        try:
            checked_turn(server, long_prompt("full 0", 4), "full-0", tally)
            filler = mount / "filler"
            with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:  # until ENOSPC: less than one block is left free
                    f.write(b"\0" * (64 << 10))
                    f.flush()
            for c in range(1, 6):
                checked_turn(server, long_prompt(f"full {c}", 4), f"full-{c}", tally)
            filler.unlink()
            time.sleep(1)
            checked_turn(server, long_prompt("full 9", 4), "full-9", tally)
            log = log_text(server)
        finally:
            server.stop()
        return {
            **_tally(tally),
            "full-disk warnings": count_lines(log, r"file system full, a write failed"),
            "per-block write warnings": count_lines(log, r"not written to disk"),
        }
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        mount.rmdir()


def _tally(t: Tally) -> Figures:
    return {
        "greedy answers identical to cache-off": f"{t.identical}/{t.answers}",
        "5xx responses": t.errors_5xx,
        "prompt tokens cached": f"{t.cached_tokens}/{t.prompt_tokens}",
    }


# ----------------------------------------------------------------------------- main

SCENARIOS = ("kill", "sigterm", "damaged", "weights", "budget", "full-disk")


def print_table(results: dict[str, Figures]) -> None:
    rows = [
        (name, key, str(value)) for name, figs in results.items() for key, value in figs.items()
    ]
    widths = [max(len(r[i]) for r in [*rows, ("scenario", "figure", "value")]) for i in range(3)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format("scenario", "figure", "value"))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*row))


def main(argv: Sequence[str] | None = None) -> dict[str, Figures]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=10, help="kill -9 rounds")
    p.add_argument("--only", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--model", type=Path, help="model folder (default: the tiny random Llama)")
    p.add_argument("--work", type=Path, help="folder for caches, logs and the model copy")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="lgkv-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    source = args.model or _tiny_model()
    model_dir = work / "model"  # a private copy: the weights scenario rewrites it
    shutil.copytree(source, model_dir, dirs_exist_ok=True)

    def make(disk_bytes: str | None = None, disk_dir: Path | None = None) -> Server:
        extra = list(ENGINE_ARGS)
        if disk_bytes is not None:
            extra[extra.index("--kv-disk-bytes") + 1] = disk_bytes
        if disk_dir is not None:
            extra += ["--kv-disk-dir", str(disk_dir)]
        cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
        return Server(model_dir, cache, cache / "server.log", extra)

    results: dict[str, Figures] = {}
    shared = None
    try:
        for name in args.only:
            if name in ("budget", "full-disk"):
                results[name] = small_budget(make) if name == "budget" else full_disk(make)
                print(f"{name}: {results[name]}", flush=True)
                continue
            if shared is None:
                shared = make()
                shared.start()
            run = {
                "kill": lambda s: kill_rounds(s, args.rounds),
                "sigterm": sigterm_round,
                "damaged": damaged_files,
                "weights": swapped_weights,
            }[name]
            results[name] = run(shared)
            print(f"{name}: {results[name]}", flush=True)  # partial results as they come
    finally:
        if shared is not None:
            shared.stop()
    print_table(results)
    print(f"(logs and caches under {work})")
    return results


def _tiny_model() -> Path:
    from server.model import build_default_model, build_tiny_model, default_cache_dir

    out = default_cache_dir() / "models" / "tiny-llama-h32"
    return build_tiny_model(out, tokenizer_from=build_default_model())


if __name__ == "__main__":
    main()
