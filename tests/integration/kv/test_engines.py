"""Scenarios with their own engine process: SmolLM2 chat turns, and prefetch through an
AsyncLLM whose engine core runs in another process (as in the server)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from kv_engine import BLOCK, block_bytes_of, engine_kwargs, run_engine_script

from server.kv.registry import Registry

pytestmark = pytest.mark.vllm

DOC = (
    "The lighthouse keeper of Varn Island kept a log of every ship that passed. "
    "In spring the fishing boats came north; in autumn the grain ships went south. "
)


def test_smollm2_second_turn_identical_from_ram_and_disk(smollm2_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    engine = engine_kwargs(smollm2_dir, cache)
    engine["kv_cache_memory_bytes"] = 48 * block_bytes_of(smollm2_dir)
    history = [{"role": "user", "content": DOC * 12 + "Who kept the log? Answer in one sentence."}]
    second = [
        *history,
        {"role": "assistant", "content": "$PREV"},
        {"role": "user", "content": "Which ships went south in autumn?"},
    ]
    turns = [
        {"messages": history, "session": "chat", "max_tokens": 24},
        {"messages": second, "cache": False, "reset": True, "max_tokens": 24, "keep_text": False},
        {
            "messages": second,
            "session": "chat",
            "reset": True,
            "max_tokens": 24,
            "keep_text": False,
        },
    ]
    first, ref, hit = run_engine_script({"engine": engine, "turns": turns}, tmp_path)
    assert first["text"].strip() and ref["prompt_len"] > 2 * BLOCK
    assert hit["tokens"] == ref["tokens"] and hit["text"] == ref["text"]
    # Turn 1's prompt and answer, but its last token (never computed), come from the tiers
    # (its tail block too) as far as the template re-renders them token for token.
    prior = first["prompt"] + first["tokens"]
    same = next(
        (i for i, (a, b) in enumerate(zip(prior, hit["prompt"], strict=False)) if a != b),
        min(len(prior), len(hit["prompt"])),
    )
    kept = min(same, len(prior) - 1)
    assert hit["num_cached_tokens"] == (kept if kept == len(prior) - 1 else kept // BLOCK * BLOCK)
    print(
        f"\nSmolLM2 chat: turn 2 cached {hit['num_cached_tokens']} of the {len(prior)} tokens "
        f"of turn 1's prompt and answer ({hit['num_cached_tokens'] / len(prior):.1%}); the "
        f"template re-renders {same} of them"
    )
    # A restarted engine (same cache folder) serves the same turn from disk, same answer.
    again = run_engine_script({"engine": engine, "turns": [turns[2]]}, tmp_path)[0]
    assert again["tokens"] == ref["tokens"] and again["num_cached_tokens"] >= 2 * BLOCK
    reg = Registry(cache / "sessions.sqlite3")
    stats = reg.stats()
    reg.close()
    assert stats['lgkv_hit_blocks_total{tier="ram"}'] >= 2
    assert stats['lgkv_hit_blocks_total{tier="disk"}'] >= 2


def test_prefetch_through_async_engine_in_another_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model_dir
    cache = tmp_path / "cache"
    engine = engine_kwargs(model, cache)
    ram_blocks = engine["kv_connector_extra_config"]["ram_bytes"] // block_bytes_of(model)
    prompt_a = [300 + i for i in range(3 * BLOCK + 20)]
    prompt_b = [5000 + i for i in range(ram_blocks * BLOCK + 20)]
    turns = [
        {"prompt": prompt_a, "session": "A"},
        {"prompt": prompt_b, "session": "B"},  # pushes A out of RAM
        {"prefetch": "A"},
        {"prompt": [*prompt_a, 7, 7, 7], "session": "A", "reset": True},
    ]
    spec = {"engine": engine, "async": True, "turns": turns}
    results = run_engine_script(spec, tmp_path, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert results[2] == {"blocks": 4, "ram_blocks": 4}  # 3 blocks + a tail
    # 3 blocks and the tail up to where the prompt leaves turn 1's tokens (continuations)
    assert results[3]["num_cached_tokens"] == len(prompt_a)
    reg = Registry(cache / "sessions.sqlite3")
    stats = reg.stats()
    reg.close()
    assert stats['lgkv_hit_blocks_total{tier="ram"}'] == 3  # prefetched: no disk hit needed
    assert stats.get('lgkv_hit_blocks_total{tier="disk"}', 0) == 0


REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_replicas(model: Path, folder: Path, what: str) -> Callable[[str], dict]:
    """Engine kwargs of replicas ``name`` (own cache folder ``folder/name``) sharing Redis
    under a fresh namespace (their keys expire); skips the test without Redis."""
    import redis

    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    model_id = f"{what}-test-{uuid.uuid4().hex}"

    def replica(name: str) -> dict:
        engine = engine_kwargs(model, folder / name)
        engine["kv_connector_extra_config"].update(
            redis_url=REDIS_URL, model_id=model_id, redis_ttl_s=120
        )
        return engine

    return replica


@pytest.mark.redis
def test_a_tail_block_crosses_replicas_through_redis(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Replica A's turn ends inside a block; B's next turn extends it token for token and
    loads A's full blocks and A's partial tail block from Redis (B has no disk files of its
    own): only the new tokens are computed, with the cache-off run's tokens and logprobs, and
    B's counters and the shared session record show it."""
    replica = redis_replicas(tiny_model_dir, tmp_path, "tail")
    model_id = replica("a")["kv_connector_extra_config"]["model_id"]

    prompt = [700 + i for i in range(3 * BLOCK + 20)]
    (turn1,) = run_engine_script(
        {  # the settle steps the engine once more: the turn's tail is saved in that step
            "engine": replica("a"),
            "turns": [{"prompt": prompt, "session": "T"}, {"settle": True}],
        },
        tmp_path,
    )
    tail = len(prompt) + len(turn1["tokens"]) - 1 - 3 * BLOCK  # A's last block: KV of these
    nxt = [*prompt, *turn1["tokens"], *range(300, 310)]
    hit, ref = run_engine_script(
        {
            "engine": replica("b"),
            "turns": [
                {"settle": True},  # B has read the registry's changes, as a running replica has
                {"prompt": nxt, "session": "T"},
                {"prompt": nxt, "cache": False},
            ],
        },
        tmp_path,
    )
    assert hit["num_cached_tokens"] == 3 * BLOCK + tail  # B has no files of its own
    assert hit["tokens"] == ref["tokens"]
    assert hit["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-3)
    reg = Registry(tmp_path / "b" / "sessions.sqlite3")
    stats = reg.stats()
    reg.close()
    assert stats['lgkv_hit_blocks_total{tier="redis"}'] == 3
    assert stats['lgkv_hit_tails_total{tier="redis"}'] == 1
    from server.kv.registry.redis import RedisSessions

    shared = RedisSessions(REDIS_URL, model_id)  # both replicas' sessions (namespace: model id)
    assert shared.get_session("t", "T").turns == 2  # a turn on each replica
    shared.clear()
