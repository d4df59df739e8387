"""Run turns on a fresh engine in its own process; print one JSON line of results.

Usage: ``python engine_script.py SPEC.json``. SPEC: ``{"engine": <LLM kwargs incl.
kv_connector_extra_config>, "turns": [{"prompt": [ids] | "messages": [...], "session": str|null,
"cache": bool, "reset": bool, "max_tokens": int}]}``. In ``messages``, an assistant message
with content ``"$PREV"`` takes the text of the previous turn's answer. Used by the tests for
engine restarts and for the SmolLM2 check (vLLM keeps one KV connector per process).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from kv_engine import make_llm
    from vllm import SamplingParams

    llm = make_llm(spec["engine"])
    tok = llm.get_tokenizer()
    results: list[dict[str, Any]] = []
    prev_text = ""
    for turn in spec["turns"]:
        if "messages" in turn:
            msgs = [
                {**m, "content": prev_text} if m["content"] == "$PREV" else m
                for m in turn["messages"]
            ]
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(prompt, dict):
                prompt = prompt["input_ids"]
        else:
            prompt = turn["prompt"]
        if turn.get("reset"):
            llm.reset_prefix_cache()
        session = turn.get("session")
        params = SamplingParams(
            max_tokens=turn.get("max_tokens", 8),
            temperature=0.0,
            logprobs=1,
            skip_reading_prefix_cache=not turn.get("cache", True),
            extra_args={"session_id": session, "tenant": "t"} if session else None,
        )
        out = llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0]
        comp = out.outputs[0]
        if turn.get("keep_text", True):
            prev_text = comp.text
        results.append(
            {
                "prompt_len": len(prompt),
                "tokens": list(comp.token_ids),
                "text": comp.text,
                "logprobs": [
                    lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=False)
                ],
                "num_cached_tokens": out.num_cached_tokens,
            }
        )
    llm.llm_engine.engine_core.shutdown()
    return {"turns": results}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    print("RESULT " + json.dumps(run(spec)), flush=True)
