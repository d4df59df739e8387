"""Two replicas sharing KV and sessions through Redis: the figures of issue 11's note.

Starts replicas A and B of this server (SmolLM2-135M-Instruct, 32-token blocks, each its own
cache folder, the same ``--kv-redis-url``: db 12, emptied first) and prints:

- **cross-replica hits**: per repetition, a new thread's turn 1 on A, then its turn 2 sent to
  B (the other replica: loads from Redis) and to A (the replica that has the thread), and a
  cold turn of the same length (a new thread). TTFT (first streamed token) and cached tokens
  of each; B's hit share (cached / prompt tokens, and / turn 1's prompt and answer).
- **Redis memory per cached token**: ``INFO memory`` before and after, over the tokens of the
  blocks in Redis, and ``MEMORY USAGE`` of one block key over its tokens.
- **data lost** (``FLUSHDB``): a thread's turn 1 on A, Redis emptied, its turn 2 on B: a miss
  (no cached tokens from Redis), the same answer as the hit on A (greedy), no error.

    python benchmarks/replicas.py              # 3 repetitions (a few minutes on 2 cores)
    python benchmarks/replicas.py --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multi_turn import stream_chat  # noqa: E402

from examples.server_process import ServerProcess  # noqa: E402

REDIS_URL = "redis://127.0.0.1:6379/12"
BLOCK = 32
FLAGS = [
    "--block-size", str(BLOCK),
    "--max-model-len", "4096",
    "--kv-cache-memory-bytes", "256MiB",
    "--kv-ram-bytes", "256MiB",
    "--kv-disk-bytes", "1GiB",
    "--kv-redis-url", REDIS_URL,
    "--kv-stats-flush", "0.2",
]  # fmt: skip


def document(tag: str, lines: int = 60) -> str:
    """A distinct long user message (about 15 tokens a line)."""
    return " ".join(f"Log {tag}-{i}: ship {i * 7 % 13} left dock {i % 5}." for i in range(lines))


def chat(url: str, messages: list[dict], session: str, max_tokens: int = 16) -> dict:
    """One streamed greedy chat turn: TTFT, answer, prompt and cached tokens."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt_cache_key": session,
    }
    with httpx.Client(base_url=url, timeout=300) as client:
        text, ttft, usage = stream_chat(client, body)
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "text": text,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "cached_tokens": int(details.get("cached_tokens") or 0),
    }


def metric(url: str, name: str) -> float:
    """One sample of the server's ``/metrics``."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def wait_redis_blocks(url: str, at_least: float, timeout_s: float = 30.0) -> None:
    """Until the replica's metrics count ``at_least`` of its blocks in Redis."""
    deadline = time.monotonic() + timeout_s
    while metric(url, 'lgkv_tier_blocks{tier="redis"}') < at_least:
        if time.monotonic() > deadline:
            raise SystemExit("the replica's blocks did not reach Redis in time")
        time.sleep(0.2)


def turn_two(first: list[dict], answer: str) -> list[dict]:
    """Turn 2 of a thread: turn 1, its answer, a follow-up question."""
    return [*first, {"role": "assistant", "content": answer},
            {"role": "user", "content": "Which dock did ship 3 leave from?"}]  # fmt: skip


def summarize(rows: list[tuple]) -> None:
    """Medians over the repetitions: TTFT of turn 2 on B, on A, and of a cold turn."""
    med = statistics.median
    print(f"\n== cross-replica hits (medians over {len(rows)} repetitions) ==")
    for name, i in (("turn 2 on B (other replica, from Redis)", 1),
                    ("turn 2 on A (replica with the thread)", 2),
                    ("cold turn (same length, new thread)", 3)):  # fmt: skip
        print(f"{name:42s} TTFT {med(r[i]['ttft_s'] for r in rows) * 1000:8.1f} ms")
    share = med(r[1]["cached_tokens"] / r[1]["prompt_tokens"] for r in rows)
    prior = med(r[1]["cached_tokens"] / r[4] for r in rows)
    print(f"B's hit share: {share:.1%} of turn 2's prompt, {prior:.1%} of turn 1's prompt+answer")
    print(f"answers identical on B and A: {all(r[1]['text'] == r[2]['text'] for r in rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ports", type=int, nargs=2, default=(18111, 18112))
    args = parser.parse_args()

    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    base_mem = int(client.info("memory")["used_memory"])
    a = ServerProcess(flags=FLAGS, port=args.ports[0])
    b = ServerProcess(flags=FLAGS, port=args.ports[1])
    with a, b:
        chat(a.url, [{"role": "user", "content": "Hello"}], "warm-a", 2)  # first-request costs
        chat(b.url, [{"role": "user", "content": "Hello"}], "warm-b", 2)
        rows = []
        for rep in range(args.reps):
            first = [{"role": "user", "content": document(f"t{rep}")}]
            base = metric(a.url, 'lgkv_tier_blocks{tier="redis"}')
            one = chat(a.url, first, f"thread-{rep}")
            wait_redis_blocks(a.url, base + one["prompt_tokens"] // BLOCK - 2)
            hits_before = metric(b.url, 'lgkv_hit_blocks_total{tier="redis"}')
            msgs = turn_two(first, one["text"])
            on_b = chat(b.url, msgs, f"thread-{rep}")
            redis_blocks = metric(b.url, 'lgkv_hit_blocks_total{tier="redis"}') - hits_before
            on_a = chat(a.url, msgs, f"thread-{rep}")
            cold = chat(b.url, turn_two([{"role": "user", "content": document(f"c{rep}")}],
                                        one["text"]), f"cold-{rep}")  # fmt: skip
            prior = one["prompt_tokens"] + one["completion_tokens"]
            rows.append((one, on_b, on_a, cold, prior, redis_blocks))
            print(
                f"rep {rep}: turn 2 on B ttft {on_b['ttft_s'] * 1000:7.1f} ms cached "
                f"{on_b['cached_tokens']}/{on_b['prompt_tokens']} ({redis_blocks:.0f} blocks "
                f"from Redis) | on A {on_a['ttft_s'] * 1000:7.1f} ms cached "
                f"{on_a['cached_tokens']}/{on_a['prompt_tokens']} | cold "
                f"{cold['ttft_s'] * 1000:7.1f} ms cached {cold['cached_tokens']}/"
                f"{cold['prompt_tokens']} | same answer B/A: {on_b['text'] == on_a['text']}",
                flush=True,
            )
        summarize(rows)

        keys = [k for k in client.scan_iter("lgkv:*") if not k.startswith(b"lgkv:reg:")]
        mem = int(client.info("memory")["used_memory"]) - base_mem
        one_key = int(client.memory_usage(keys[0]) or 0) if keys else 0
        tokens = len(keys) * BLOCK
        print("\n== Redis memory ==")
        print(
            f"{len(keys)} blocks in Redis ({tokens} tokens); used_memory grew {mem / 1e6:.2f} "
            f"MB: {mem / max(tokens, 1):.0f} bytes per cached token (registry included)"
        )
        print(f"MEMORY USAGE of one block key: {one_key} bytes, {one_key / BLOCK:.0f} per token")

        first = [{"role": "user", "content": document("lost")}]
        base = metric(a.url, 'lgkv_tier_blocks{tier="redis"}')
        one = chat(a.url, first, "thread-lost")
        wait_redis_blocks(a.url, base + one["prompt_tokens"] // BLOCK - 2)
        hit_on_a = chat(a.url, turn_two(first, one["text"]), "thread-lost")
        client.flushdb()  # Redis loses everything: blocks and sessions
        before = metric(b.url, 'lgkv_hit_blocks_total{tier="redis"}')
        lost = chat(b.url, turn_two(first, one["text"]), "thread-lost")
        after = metric(b.url, 'lgkv_hit_blocks_total{tier="redis"}')
        print("\n== Redis data lost (FLUSHDB) ==")
        print(
            f"turn 2 on B after the flush: cached {lost['cached_tokens']}/"
            f"{lost['prompt_tokens']}, {after - before:.0f} blocks from Redis, TTFT "
            f"{lost['ttft_s'] * 1000:.1f} ms; same answer as the hit on A: "
            f"{lost['text'] == hit_on_a['text']}"
        )
        session = httpx.get(b.url + "/v1/sessions/thread-lost", timeout=60)
        print(f"the session after the flush: HTTP {session.status_code} "
              f"(turns {session.json().get('turns') if session.status_code == 200 else '-'}; "
              "the flush lost its row, B's turn recorded it anew)")  # fmt: skip


if __name__ == "__main__":
    main()
