"""Every architecture the connector meets, on vLLM's CPU backend: does it start, how much of
turns 2+ it reads from the tiers, are the answers those of cache-off, what a session costs in
each tier, and what vLLM's hybrid KV cache manager saves where the model has several kinds of
layers.

    python benchmarks/models.py [--archs llama,qwen3,gemma3,...] [--prompt 600] [--turns 3]

Each model is a tiny random-weight one (``server/tiny_models.py``; ``llama`` is the suite's
2-layer Llama) whose text depends on the context, so a wrong KV shows as other tokens. Per
model, in one engine process each (vLLM keeps one KV connector per process):

- **hit**: a conversation of ``--turns`` turns (a ``--prompt``-token first turn, then 40 new
  tokens a turn); before each later turn vLLM's own prefix cache is reset, so history can
  only come from the connector's tiers (RAM); then one more turn on a new engine (disk).
- **ref**: every later prompt on an engine without the connector's reads (cache-off).
- **manager off** (models with sliding-window and global layers): the same engine with the
  plain connector class, so vLLM turns its hybrid KV cache manager off.

Printed per model: the connector class, KV cache groups, whether it started, the cached share
of turns 2+ (RAM, then disk after the restart), whether every answer equals cache-off token for
token (logprobs within 1e-4), the session's bytes in each tier, and vLLM's "maximum
concurrency" for the same KV memory: at ``max_model_len`` 4096, and for models with
sliding-window layers at :data:`LONG_CONTEXT` with the manager on and off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARCHS = [
    "llama",
    "qwen3",
    "mistral",
    "mixtral",
    "gemma3",
    "deepseek_v2",
    "granitemoehybrid",
    "qwen3_next",
]
KV_MEMORY = 64 * 1024 * 1024
"""vLLM's KV cache memory for every engine (the same for the manager on and off)."""
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "distributed_executor_backend": "uni",
    "kv_cache_memory_bytes": KV_MEMORY,
    "max_model_len": 4096,
    "seed": 0,
}
OVERRIDES: dict[str, dict[str, Any]] = {
    # the reference CPU MLA backend (vLLM disables prefix caching for MLA on CPU)
    "deepseek_v2": {"attention_backend": "CPU_MLA"},
    # CPU's gated-delta-net kernel needs bfloat16
    "qwen3_next": {"dtype": "bfloat16"},
}
LONG_CONTEXT = 32768
"""``max_model_len`` of the capacity figure of models with sliding-window layers (at the suite's
4096 a 256-token window saves nothing: vLLM sizes a sliding group for the window plus one
batch of new tokens)."""
SHORT = {"granitemoehybrid": (40, 8)}
"""vLLM 0.32's CPU Mamba-2 kernel fails past one 128-token block with prefix caching on
(plain vLLM too): that model's conversation stays inside one block (first turn's tokens, new
tokens a turn)."""


def model_dir(arch: str) -> Path:
    """Build (once) the tiny model of ``arch``."""
    from server.model import build_default_model, build_tiny_model, default_cache_dir
    from server.tiny_models import build_tiny_arch

    smollm2 = build_default_model()
    if arch == "llama":
        return build_tiny_model(default_cache_dir() / "models" / "tiny-llama-h32", smollm2)
    return build_tiny_arch(arch, tokenizer_from=smollm2)


# ------------------------------------------------------------------------- engine process


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one engine: ``spec`` = {"engine", "extra", "class", "turns", "session"}."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from langgraph_kvcache.contract import SYNC_OP, XARG_OP
    from server.kv import layout
    from server.kv.offline import reset_prefix_cache

    config = layout.transfer_config(spec["extra"], spec["engine"]["model"])
    if spec.get("class"):
        config["kv_connector"] = spec["class"]
    llm = LLM(**spec["engine"], kv_transfer_config=KVTransferConfig(**config))
    print("STARTED", flush=True)
    core = llm.llm_engine.engine_core.engine_core
    kv_config = core.scheduler.kv_cache_config
    out: dict[str, Any] = {
        "class": config["kv_connector"],
        "groups": [type(g.kv_cache_spec).__name__ for g in kv_config.kv_cache_groups],
        "concurrency": get_max_concurrency_for_kv_cache_config(
            llm.llm_engine.vllm_config, kv_config
        ),
        "turns": [],
    }
    prompt: list[int] = []
    for turn in spec["turns"]:
        prompt = list(turn["prompt"]) if "prompt" in turn else [*prompt, *turn["continue"]]
        if turn.get("reset"):
            reset_prefix_cache(llm)
        params = SamplingParams(
            max_tokens=16,
            temperature=0.0,
            logprobs=1,
            skip_reading_prefix_cache=not turn.get("cache", True),
            extra_args={"session_id": spec["session"], "tenant": "t"},
        )
        (res,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        comp = res.outputs[0]
        out["turns"].append(
            {
                "prompt": prompt,
                "tokens": list(comp.token_ids),
                "logprobs": [
                    lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)
                ],
                "cached": res.num_cached_tokens,
            }
        )
        prompt = [*prompt, *comp.token_ids]
    sync = SamplingParams(max_tokens=1, extra_args={XARG_OP: SYNC_OP})
    llm.generate([{"prompt_token_ids": [0]}], sync, use_tqdm=False)  # registry up to date
    core.shutdown()
    return out


def run(spec: dict[str, Any], work: Path) -> dict[str, Any] | str:
    """Run :func:`child` in a fresh process; its result, or the error text when it failed."""
    path = work / f"spec-{len(list(work.iterdir()))}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(path)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        err = [ln for ln in (proc.stderr + proc.stdout).splitlines() if "Error" in ln]
        text = (err or [f"exit code {proc.returncode}"])[-1][:160]
        return f"after start: {text}" if "STARTED" in proc.stdout else text
    return json.loads(lines[-1][len("RESULT ") :])


# ------------------------------------------------------------------------------- parent


def measure(arch: str, prompt_len: int, turns: int, work: Path) -> dict[str, Any]:
    """Every figure of one architecture."""
    from server.kv.registry import Registry

    folder = model_dir(arch)
    cache = work / arch / "cache"
    cache.mkdir(parents=True)
    cfg = json.loads((folder / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block = 2 * 128 * cfg.get("num_key_value_heads", 1) * head * 4 * cfg["num_hidden_layers"]
    engine = {**ENGINE, "model": str(folder), **OVERRIDES.get(arch, {})}
    extra = {
        "cache_dir": str(cache),
        "ram_bytes": 64 * block,
        "disk_bytes": 256 * (block + 8192),
        "model_id": arch,
    }
    n, new = SHORT.get(arch, (prompt_len, 40))
    first = [400 + (i * 37) % 3000 for i in range(n)]
    later = [
        {"continue": list(range(900 + 40 * t, 900 + 40 * t + new)), "reset": True}
        for t in range(1, turns)
    ]
    spec = {"engine": engine, "extra": extra, "session": "s", "turns": [{"prompt": first}, *later]}
    hit = run(spec, work)
    row: dict[str, Any] = {"arch": arch}
    if isinstance(hit, str):
        return {**row, "started": hit.startswith("after start"), "error": hit}
    last = hit["turns"][-1]
    again = [*last["prompt"], *last["tokens"], *range(1900, 1900 + min(new, 30))]
    disk = run({**spec, "turns": [{"prompt": again}]}, work)
    later_turns = hit["turns"][1:] + (disk["turns"] if isinstance(disk, dict) else [])
    ref = run(
        {
            **spec,
            "extra": {**extra, "cache_dir": str(work / arch / "ref")},
            "turns": [{"prompt": t["prompt"], "cache": False, "reset": True} for t in later_turns],
        },
        work,
    )
    same = isinstance(ref, dict) and all(
        got["tokens"] == want["tokens"]
        and all(abs(a - b) <= 1e-4 for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
        for got, want in zip(later_turns, ref["turns"], strict=True)
    )
    reg = Registry(cache / "sessions.sqlite3")
    try:
        usage = {tier: count.bytes for tier, count in reg.tier_usage("t", "s").items()}
    finally:
        reg.close()
    row.update(
        started=True,
        connector=hit["class"],
        groups=hit["groups"],
        ram_share=sum(t["cached"] for t in hit["turns"][1:])
        / sum(len(t["prompt"]) for t in hit["turns"][1:]),
        disk_share=(disk["turns"][0]["cached"] / len(again)) if isinstance(disk, dict) else None,
        identical=same,
        tier_bytes=usage,
        concurrency=hit["concurrency"],
    )
    if len(hit["groups"]) > 1 and "SlidingWindowSpec" in hit["groups"]:
        # vLLM's own capacity figure at a long context, with the hybrid manager on and off
        long = {**engine, "max_model_len": LONG_CONTEXT}
        for name, cls in (("long_on", None), ("long_off", "SessionKVConnector")):
            got = run({**spec, "engine": long, "class": cls, "turns": spec["turns"][:1]}, work)
            row[name] = got["concurrency"] if isinstance(got, dict) else got
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--prompt", type=int, default=600, help="first turn's tokens")
    parser.add_argument("--turns", type=int, default=3, help="turns on the first engine")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(json.loads(Path(args.child).read_text()))
        print("RESULT " + json.dumps(result), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="lgkv-models-") as tmp:
        for arch in args.archs.split(","):
            row = measure(arch, args.prompt, args.turns, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        "\narch              class                     groups  cached RAM  cached disk  "
        "identical  RAM/disk bytes   concurrency 4k  32k manager on/off"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['arch']:<17} started: {r['started']}; {r['error']}")
            continue
        disk = "-" if r["disk_share"] is None else f"{r['disk_share']:.2f}"
        tiers = f"{r['tier_bytes'].get('ram', 0)}/{r['tier_bytes'].get('disk', 0)}"
        long = "-"
        if "long_on" in r:
            long = " / ".join(
                f"{v:.2f}x" if isinstance(v, float) else str(v)
                for v in (r["long_on"], r["long_off"])
            )
        print(
            f"{r['arch']:<17} {r['connector']:<25} {len(r['groups']):>6}  "
            f"{r['ram_share']:>10.2f}  {disk:>11}  {r['identical']!s:>9}  {tiers:>15}  "
            f"{r['concurrency']:>13.2f}x  {long}"
        )


if __name__ == "__main__":
    main()
