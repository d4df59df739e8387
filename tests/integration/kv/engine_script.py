"""Run turns on a fresh engine in its own process; print one JSON line of results.

Usage: ``python engine_script.py SPEC.json``. SPEC: ``{"engine": <LLM kwargs incl.
kv_connector_extra_config>, "async": bool, "turns": [...]}``; a turn is
``{"prompt": [ids] | "messages": [...] | "continue": [ids] | "repeat": n, "session": str|null,
"cache": bool, "reset": bool, "max_tokens": int, "keep_text": bool}`` or
``{"prefetch": session}`` (async only: calls ``SessionControl.prefetch`` with the AsyncLLM as
engine client). In ``messages``, an assistant
message with content ``"$PREV"`` takes the text of the last kept answer; ``continue`` is the
last turn's prompt and answer tokens followed by ``ids`` (the next turn of a conversation,
token for token); ``repeat`` is the prompt of result ``n`` again (a cache-off reference on the
same engine). Sync only:
``{"signal": path}`` creates the file (the turns before it are done), ``{"await": path}``
waits until the file exists (at most 300 s), ``{"settle": true}`` runs a ``SYNC_OP``
request (the engine's registry records are committed when it returns).

Used for engine restarts, the SmolLM2 check and the AsyncLLM prefetch path (vLLM keeps one KV
connector per process, so each engine gets its own process).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))


class Runner:
    """Applies the turns of a spec to an engine and collects the results."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.prev_text = ""
        self.results: list[dict[str, Any]] = []

    def prompt(self, turn: dict[str, Any]) -> list[int]:
        if "repeat" in turn:
            return list(self.results[turn["repeat"]]["prompt"])
        if "continue" in turn:
            last = self.results[-1]
            return [*last["prompt"], *last["tokens"], *turn["continue"]]
        if "messages" not in turn:
            return list(turn["prompt"])
        msgs = [
            {**m, "content": self.prev_text} if m["content"] == "$PREV" else m
            for m in turn["messages"]
        ]
        text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return list(self.tok.encode(text, add_special_tokens=False))

    def params(self, turn: dict[str, Any]) -> Any:
        from vllm import SamplingParams

        session = turn.get("session")
        return SamplingParams(
            max_tokens=turn.get("max_tokens", 8),
            temperature=0.0,
            logprobs=1,
            skip_reading_prefix_cache=not turn.get("cache", True),
            extra_args={"session_id": session, "tenant": "t"} if session else None,
        )

    def record(self, turn: dict[str, Any], prompt: list[int], out: Any) -> None:
        comp = out.outputs[0]
        if turn.get("keep_text", True):
            self.prev_text = comp.text
        self.results.append(
            {
                "prompt_len": len(prompt),
                "prompt": prompt,
                "tokens": list(comp.token_ids),
                "text": comp.text,
                "logprobs": [
                    lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)
                ],
                "num_cached_tokens": out.num_cached_tokens,
            }
        )


def run_sync(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from kv_engine import make_llm, settle

    from server.kv.offline import reset_prefix_cache

    llm = make_llm(spec["engine"])
    runner = Runner(llm.get_tokenizer())
    for turn in spec["turns"]:
        if "signal" in turn:
            tmp = Path(turn["signal"] + ".tmp")
            tmp.write_text(json.dumps(runner.results))
            tmp.replace(turn["signal"])
            continue
        if "await" in turn:
            deadline = time.monotonic() + 300
            while not Path(turn["await"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            continue
        if "settle" in turn:
            settle(llm)
            continue
        prompt = runner.prompt(turn)
        if turn.get("reset"):
            reset_prefix_cache(llm)
        out = llm.generate([{"prompt_token_ids": prompt}], runner.params(turn), use_tqdm=False)
        runner.record(turn, prompt, out[0])
    llm.llm_engine.engine_core.shutdown()
    return runner.results


async def run_async(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from kv_engine import make_async_llm

    from server.kv.offline import reset_prefix_cache_async
    from server.kv.registry.control import SessionControl

    engine = make_async_llm(spec["engine"])
    cache_dir = Path(spec["engine"]["kv_connector_extra_config"]["cache_dir"])
    control = SessionControl(cache_dir, engine_client=engine)
    runner = Runner(engine.tokenizer)
    try:
        for turn in spec["turns"]:
            if "prefetch" in turn:
                runner.results.append(await control.prefetch(turn["prefetch"], "t"))
                continue
            prompt = runner.prompt(turn)
            if turn.get("reset"):
                await reset_prefix_cache_async(engine)
            final = None
            async for out in engine.generate(
                {"prompt_token_ids": prompt}, runner.params(turn), request_id=uuid.uuid4().hex
            ):
                final = out
            runner.record(turn, prompt, final)
    finally:
        control.close()
        engine.shutdown()
    return runner.results


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = asyncio.run(run_async(spec)) if spec.get("async") else run_sync(spec)
    print("RESULT " + json.dumps({"turns": results}), flush=True)
