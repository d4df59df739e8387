"""Compressed KV in the tiers (``--kv-offload-dtype``): sizes, codec cost, quality, capacity.

    python benchmarks/compression.py sizes      # bytes per block and blocks per GiB per format
    python benchmarks/compression.py codec      # microseconds per block to compress / restore
    python benchmarks/compression.py quality    # >= 100 multi-turn prompts, greedy 32 tokens
    python benchmarks/compression.py capacity   # the multi-turn benchmark, RAM tier too small
    python benchmarks/compression.py quality --prompts 12 --formats auto int8   # a quick look

``quality`` runs one offline engine per format (the default model, float32, eager). Each prompt
runs twice: first with ``skip_reading_prefix_cache`` (a full prefill, the cache-off answer;
its blocks are saved to the RAM tier in the format), then, after ``reset_prefix_cache()``, as a
hit whose history KV comes back from the RAM tier decoded. It prints the share of identical
32-token greedy continuations, the mean position of the first differing token (32 when none
differs), and the mean absolute difference of the chosen tokens' logprobs over the tokens
before the first difference. Prompts: Wikipedia passages of the RAG example and the user
turns of ``benchmarks/multi_turn.py``, as 2- and 3-turn chats.

``capacity`` runs ``python -m server`` once per configuration with the same flags, cores and
workload (``multi_turn.py``'s interleaved conversations, disk tier off) and prints the hit rate
and the TTFT p50 of the late turns: ``auto`` at ``--ram-bytes``, ``auto`` at 4x that, and each
compressed format at ``--ram-bytes`` (``benchmarks/compression_capacity.py``). Timings on a
shared CPU are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

FORMATS = ["auto", "float16", "bfloat16", "int8", "fp8"]
TOKENS = 32
_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def model_geometry(model: Path) -> tuple[int, int, int, int]:
    """(layers, KV heads, head size, block size) of a model folder (CPU block size 128)."""
    cfg = json.loads((model / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg["num_key_value_heads"], head, 128


def block_format(model: Path, name: str) -> Any:
    from server.kv.formats import BlockFormat

    layers, heads, head, block = model_geometry(model)
    layer_bytes = (heads * 2 * block * head * 4,) * layers
    return BlockFormat(name, "float32", layer_bytes, kv_heads=heads, block_tokens=block)


def sizes(model: Path) -> None:
    print("\nformat     bytes/block  blocks/GiB  ratio")
    for name in FORMATS:
        fmt = block_format(model, name)
        per_gib = (1 << 30) // fmt.block_bytes
        print(f"{name:>9} {fmt.block_bytes:>12} {per_gib:>11} {fmt.ratio:>6.2f}x")


def codec_cost(model: Path, batch: int, reps: int) -> None:
    """Microseconds per block of RamPool.save (paged -> slot, encode) and .load (decode)."""
    import torch

    from server.kv.groups import LayerBlocks
    from server.kv.tiers.codec import BlockCodec, fp8_available
    from server.kv.tiers.ram import RamPool

    layers, heads, head, block = model_geometry(model)
    shape = (heads, 2 * block, head)
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(2 * batch + 1, *shape, generator=g) for _ in range(layers)]
    ids, slots = LayerBlocks(range(1, batch + 1)), list(range(batch))  # block 0 is vLLM's null
    back = LayerBlocks(range(batch + 1, 2 * batch + 1))
    print(f"\n{batch} blocks per call, median of {reps}, torch threads {torch.get_num_threads()}")
    print("format     save us/block (min)  load us/block (min)  (paged <-> RAM slot, with copy)")
    for name in FORMATS:
        if name == "fp8" and not fp8_available():
            continue
        pool = RamPool(batch, BlockCodec(block_format(model, name), [shape] * layers))
        pool.save(kv, ids, slots)  # warm up: the pool's pages are touched once
        pool.load(kv, slots, back)
        save, load = [], []
        for _ in range(reps):
            t = time.perf_counter()
            pool.save(kv, ids, slots)
            save.append(time.perf_counter() - t)
            t = time.perf_counter()
            pool.load(kv, slots, back)
            load.append(time.perf_counter() - t)
        med = [statistics.median(x) / batch * 1e6 for x in (save, load)]
        best = [min(x) / batch * 1e6 for x in (save, load)]
        print(f"{name:>9} {med[0]:>8.0f} ({best[0]:>5.0f}) {med[1]:>8.0f} ({best[1]:>5.0f})")


# ------------------------------------------------------------------------------------ quality


def quality_prompts(n: int) -> list[list[dict[str, str]]]:
    """``n`` varied 2- and 3-turn chats: half RAG passages, half multi_turn.py user turns,
    interleaved, so the first prompts of a run cut short hold both kinds."""
    from multi_turn import _user_turns

    from examples.rag import chunk_articles, load_articles

    chunks = chunk_articles(load_articles(), words=90, max_per_article=6)
    by_title: dict[str, list[str]] = {}
    for c in chunks:
        by_title.setdefault(c.title, []).append(c.text)
    titles = [t for t, cs in by_title.items() if len(cs) >= 3]
    rag: list[list[dict[str, str]]] = []
    for i in range(n - n // 2):
        title = titles[i % len(titles)]
        c = by_title[title]
        first = c[0].split(". ")[0]
        rag.append(
            [
                {"role": "system", "content": "You answer questions about Wikipedia passages."},
                {"role": "user", "content": f"An article on {title}:\n\n{c[0]}\n\n{c[1]}\n\n"
                 "What is it mainly about?"},
                {"role": "assistant", "content": f"It is about {title}. {first}."},
                {"role": "user", "content": f"It goes on:\n\n{c[2]}\n\nName one fact from it."},
            ]
        )  # fmt: skip
    chats: list[list[dict[str, str]]] = []
    for j, turns in enumerate(_user_turns(n // 2, 3, seed=1)):
        chat: list[dict[str, str]] = []
        for k in range(2 + j % 2):
            if chat:
                words = turns[k - 1].split(": ", 1)[-1].split()
                chat.append({"role": "assistant", "content": " ".join(words[3 + j % 5 : 20])})
            chat.append({"role": "user", "content": turns[k]})
        chats.append(chat)
    out = [c for pair in zip(rag, chats, strict=False) for c in pair]
    return out + rag[len(chats) :]


def quality_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One format: cache-off and compressed-hit continuations of every prompt (subprocess)."""
    from vllm import LLM, SamplingParams

    from server.kv.offline import reset_prefix_cache, transfer_config

    extra = {
        "cache_dir": spec["cache_dir"],
        "ram_bytes": spec["ram_bytes"],
        "disk_bytes": 0,
        "model_id": "bench",
        "offload_dtype": spec["format"],
        "stats_flush_s": 0.05,
    }
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=spec["resident_bytes"],
        max_model_len=4096,
        seed=0,
        kv_transfer_config=transfer_config(extra, spec["model"]),
    )
    tok = llm.get_tokenizer()
    prompts = [
        tok.encode(
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for m in spec["chats"]
    ]

    def params(i: int, cache_off: bool) -> SamplingParams:
        return SamplingParams(
            max_tokens=TOKENS,
            ignore_eos=True,
            temperature=0.0,
            logprobs=1,
            skip_reading_prefix_cache=cache_off,
            extra_args={"session_id": f"q{i}", "tenant": "bench"},
        )

    rows: list[dict[str, Any]] = []
    step = spec["batch"]
    for start in range(0, len(prompts), step):
        idx = list(range(start, min(start + step, len(prompts))))
        batch = [{"prompt_token_ids": prompts[i]} for i in idx]
        ref = llm.generate(batch, [params(i, True) for i in idx], use_tqdm=False)
        reset_prefix_cache(llm)  # the hit must come from the tier, decoded
        hit = llm.generate(batch, [params(i, False) for i in idx], use_tqdm=False)
        reset_prefix_cache(llm)
        batch_rows = [
            {"prompt": i, "prompt_len": len(prompts[i]), "cached": h.num_cached_tokens,
             "ref": _tokens(r), "hit": _tokens(h)}
            for i, r, h in zip(idx, ref, hit, strict=True)
        ]  # fmt: skip
        print("ROWS " + json.dumps(batch_rows), flush=True)  # partial results survive a timeout
        rows += batch_rows
    llm.llm_engine.engine_core.shutdown()
    return {"format": spec["format"], "rows": rows}


def _tokens(out: Any) -> list[tuple[int, float]]:
    comp = out.outputs[0]
    return [(t, lp[t].logprob) for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]


def compare(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Identical share, mean first-divergence position, mean |logprob diff| before it."""
    firsts, diffs, hits = [], [], 0
    for row in rows:
        ref, hit = row["ref"], row["hit"]
        first = next(
            (k for k, (a, b) in enumerate(zip(ref, hit, strict=True)) if a[0] != b[0]), len(ref)
        )
        firsts.append(first)
        diffs += [abs(a[1] - b[1]) for a, b in zip(ref[:first], hit[:first], strict=True)]
        hits += row["cached"] > 0
    return {
        "identical": sum(f == len(r["ref"]) for f, r in zip(firsts, rows, strict=True)) / len(rows),
        "first_divergence": statistics.mean(firsts),
        "logprob_diff": statistics.mean(diffs) if diffs else float("nan"),
        "hit_prompts": hits / len(rows),
        "cached_tokens": statistics.mean(r["cached"] for r in rows),
        "prompt_tokens": statistics.mean(r["prompt_len"] for r in rows),
    }


def quality(model: Path, formats: list[str], n: int, batch: int, out: Path) -> None:
    chats = quality_prompts(n)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}
    print(f"{n} prompts, greedy {TOKENS} tokens, compressed-KV hit vs cache-off (same engine)")
    print(
        "format     identical  first-divergence  |logprob diff|  hit prompts  cached/prompt"
        "  cache-off = first engine's"
    )
    for name in formats:
        with tempfile.TemporaryDirectory(prefix=f"lgkv-quality-{name}-") as tmp:
            spec = {
                "model": str(model), "format": name, "chats": chats, "batch": batch,
                "cache_dir": tmp, "ram_bytes": 1 << 30, "resident_bytes": 768 << 20,
            }  # fmt: skip
            spec_file = Path(tmp) / "spec.json"
            spec_file.write_text(json.dumps(spec))
            rows = results[name] = []
            log = out / f"compression_quality_{name}.log"
            with log.open("w") as err, subprocess.Popen(
                [sys.executable, __file__, "_quality-engine", str(spec_file)],
                stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, **_ENGINE_ENV},
            ) as proc:  # fmt: skip
                assert proc.stdout is not None
                for line in proc.stdout:
                    if line.startswith("ROWS "):
                        rows += json.loads(line[5:])
                        (out / "compression_quality.json").write_text(json.dumps(results))
                        s = compare(rows)
                        print(f"  {name}: {len(rows)} prompts, {s['identical']:.1%} identical",
                              flush=True)  # fmt: skip
            if proc.returncode or not rows:
                tail = "".join(log.read_text(errors="replace").splitlines(True)[-15:])
                raise SystemExit(f"{name} engine failed (exit {proc.returncode}); {log}:\n{tail}")
        (out / "compression_quality.json").write_text(json.dumps(results))
        first = next(iter(results.values()))
        same = sum(
            [t for t, _ in a["ref"]] == [t for t, _ in b["ref"]]
            for a, b in zip(rows, first, strict=True)
        ) / len(rows)
        s = compare(rows)
        print(
            f"{name:>9} {s['identical']:>10.1%} {s['first_divergence']:>17.2f} "
            f"{s['logprob_diff']:>15.5f} {s['hit_prompts']:>12.0%} "
            f"{s['cached_tokens']:>7.0f}/{s['prompt_tokens']:.0f} {same:>13.0%}",
            flush=True,
        )


def report(sources: list[Path]) -> None:
    """The quality table of saved (possibly partial) runs."""
    print("format    prompts  identical  first-divergence  |logprob diff|  hit prompts")
    for src in sources:
        for name, rows in json.loads(src.read_text()).items():
            if not rows:
                continue
            s = compare(rows)
            print(
                f"{name:>9} {len(rows):>7} {s['identical']:>10.1%} {s['first_divergence']:>17.2f} "
                f"{s['logprob_diff']:>15.5f} {s['hit_prompts']:>12.0%}"
            )


def main() -> None:
    from server.model import default_model_dir

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=["sizes", "codec", "quality", "capacity", "all", "report"])
    p.add_argument(
        "--from",
        dest="sources",
        nargs="*",
        type=Path,
        default=[],
        help="report: compression_quality.json files of (partial) quality runs",
    )
    p.add_argument("--model", type=Path, default=default_model_dir())
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=FORMATS)
    p.add_argument("--prompts", type=int, default=120, help="quality: prompts")
    p.add_argument("--batch", type=int, default=8, help="quality: prompts per generate call")
    p.add_argument("--codec-batch", type=int, default=8, help="codec: blocks per call")
    p.add_argument("--reps", type=int, default=20, help="codec: repetitions")
    p.add_argument("--threads", type=int, default=0, help="codec: torch threads (0: default)")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--resident-bytes", type=int, default=512 << 20)
    p.add_argument("--ram-bytes", type=int, default=512 << 20, help="capacity: small RAM tier")
    p.add_argument("--reserved-cpus", type=int, default=0, help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    p.add_argument("--late-from", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=8192, help="capacity: context length")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    print("command: python benchmarks/compression.py " + " ".join(sys.argv[1:]), flush=True)
    if args.what == "report":
        report(args.sources)
    if args.what in ("sizes", "all"):
        sizes(args.model)
    if args.what in ("codec", "all"):
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        codec_cost(args.model, args.codec_batch, args.reps)
    if args.what in ("quality", "all"):
        quality(args.model, args.formats, args.prompts, args.batch, args.out)
    if args.what in ("capacity", "all"):
        from compression_capacity import capacity

        args.out.mkdir(parents=True, exist_ok=True)
        capacity(args.model, args.formats, args)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_quality-engine":
        result = quality_engine(json.loads(Path(sys.argv[2]).read_text()))
        print("RESULT " + json.dumps(result), flush=True)
    else:
        main()
