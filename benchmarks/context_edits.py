"""Edited context against the cache: how much of an edited prompt the server reads back.

Agents edit their context: they trim it, summarise it, clear old tool results. The server
reuses KV only where a prompt extends an earlier one token for token, so each edit costs the
reuse of what follows it. This benchmark runs the same agent conversations under each kind of
edit and prints, per kind, what could be reused and what was:

- the agent: LangChain 1.x ``create_agent`` on ``ChatKVCache`` with one tool (``lookup``,
  a ~120-token result); each turn forces one tool call (up to 48 tokens) and then a text
  answer (up to 24; two model calls); ``--threads`` threads interleaved one turn at a time
  over ``--turns`` turns, so a thread's KV leaves vLLM's resident cache between its turns
  and comes back from the tiers;
- the edits (LangChain's own middleware where it has one): ``none``; ``trim W`` (a
  ``wrap_model_call`` with ``trim_messages(strategy="last")`` at a window of W tokens, two
  sizes); ``stepped W`` (:class:`langgraph_kvcache.middleware.SteppedTrimMiddleware`, same
  windows); ``summary`` (``SummarizationMiddleware``, keeping the last 6 messages);
  ``cached summary`` (:class:`langgraph_kvcache.middleware.CachedSummarizationMiddleware`,
  the same trigger and keep: its summary call continues the thread's conversation);
  ``clear tools`` (``ContextEditingMiddleware`` with ``ClearToolUsesEdit``, keeping 2 results);
  and ``trim W shifted``, ``summary shifted``, ``clear tools shifted``: the same edits with
  ``ChatKVCache(reuse="shifted")`` (the history the edit moved is loaded at its new positions;
  approximate KV, so their answers may differ from the run without cache);
- per kind, over the model calls after the first edit of each thread: **prefix** (the longest
  prefix the prompt shares with an earlier prompt of its thread: the most that exact reuse can
  read), **anywhere** (the prompt's tokens that occur, in runs of 16 or more, in earlier
  prompts of its thread: what position-independent reuse could read), **cached** (what the
  server read from its cache, ``cached_tokens``), and the time to first token p50 with the
  cache (one ``cache_salt`` per kind, so a kind never reads another kind's identical prompts)
  and in a run of the same calls with nothing cached (a fresh ``cache_salt`` per call);
  greedy answers are the same in both runs (exact reuse changes no output), which the
  benchmark checks;
- per summary kind, the summary calls: their prompt tokens, the tokens recomputed (prompt less
  cached) and the time of a summary call, with the cache and without.

Token counts come from the server's ``/tokenize`` with the same messages and tools.

    python benchmarks/context_edits.py            # SmolLM2-135M-Instruct, about 8 minutes
    python benchmarks/context_edits.py --quick    # 2 threads, 8 turns, one window
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tools import tool
from pydantic import Field

ROOT = Path(__file__).resolve().parent.parent
NGRAM = 16
"""Shortest run of tokens counted as found elsewhere (``anywhere``)."""
SUBJECTS = ["Rivers", "Comets", "Violins", "Glaciers", "Owls", "Clocks", "Tides", "Bees",
            "Lanterns", "Copper", "Ferns", "Harbors", "Maps", "Bread", "Salt", "Kites"]  # fmt: skip


def say(msg: str) -> None:
    print(f"[context_edits] {msg}", flush=True)


@dataclass
class Call:
    """One model call: its prompt's token ids, the tokens read from the cache, TTFT, answer."""

    thread: str
    prompt: list[int]
    cached: int
    ttft_s: float
    answer: str


@dataclass
class Run:
    calls: list[Call] = field(default_factory=list)
    summaries: list[tuple[int, int, float]] = field(default_factory=list)
    """(cached tokens, prompt tokens, seconds) of each summary call."""


@tool
def lookup(title: Annotated[str, Field(max_length=40)]) -> str:
    """Look up an encyclopedia article by its title."""
    words = [w for w in title.split() if w.isalpha()] or ["things"]
    return " ".join(f"Note {i}: {words[i % len(words)]} relate to item {i * 7 % 13}."
                    for i in range(10))  # fmt: skip


def middlewares(kind: str, window: int, summarizer: Any) -> list[Any]:
    """The edit middleware of ``kind`` (see the module doc)."""
    from langchain.agents.middleware import (
        ClearToolUsesEdit,
        ContextEditingMiddleware,
        SummarizationMiddleware,
        wrap_model_call,
    )
    from langchain_core.messages import trim_messages

    from langgraph_kvcache.middleware import CachedSummarizationMiddleware, SteppedTrimMiddleware

    if kind == "none":
        return []
    if kind == "trim":

        @wrap_model_call
        def plain_trim(request: Any, handler: Any) -> Any:
            kept = trim_messages(request.messages, max_tokens=window, token_counter="approximate",
                                 start_on="human")  # fmt: skip
            return handler(request.override(messages=kept))

        return [plain_trim]
    if kind == "stepped":
        return [SteppedTrimMiddleware(max_tokens=window)]
    if kind == "summary":
        return [SummarizationMiddleware(summarizer, trigger=("tokens", window),
                                        keep=("messages", 6))]  # fmt: skip
    if kind == "cached summary":
        return [
            CachedSummarizationMiddleware(
                summarizer, trigger=("tokens", window), keep=("messages", 6), max_summary_tokens=64
            )
        ]
    if kind == "clear tools":
        return [ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=window, keep=2)])]
    raise ValueError(kind)


class SummaryCalls(BaseCallbackHandler):
    """A callback handler: (cached tokens, prompt tokens, seconds) of each summary call
    (``lc_source: summarization``, as LangChain and CachedSummarizationMiddleware mark them)."""

    def __init__(self) -> None:
        self.started: dict[Any, float] = {}
        self.summary_runs: set[Any] = set()
        self.usage: list[tuple[int, int, float]] = []

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: Any,
                            metadata: dict[str, Any] | None = None, **kw: Any) -> None:  # fmt: skip
        self.started[run_id] = time.perf_counter()
        if (metadata or {}).get("lc_source") == "summarization":
            self.summary_runs.add(run_id)

    def on_llm_end(self, response: Any, *, run_id: Any, **kw: Any) -> None:
        if run_id in self.summary_runs:
            usage = response.generations[0][0].message.usage_metadata or {}
            cached = (usage.get("input_token_details") or {}).get("cache_read", 0) or 0
            seconds = time.perf_counter() - self.started[run_id]
            self.usage.append((int(cached), int(usage.get("input_tokens", 0)), seconds))


class _FirstToken(SummaryCalls):
    """Also the time from each chat model start to its first streamed token."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.first: dict[Any, float] = {}
        self.usage = run.summaries

    def on_llm_new_token(self, token: str, *, run_id: Any, **kw: Any) -> None:
        if run_id in self.started and run_id not in self.first:
            self.first[run_id] = time.perf_counter() - self.started[run_id]


def run_kind(url: str, model_name: str, kind: str, window: int, threads: int, turns: int,
             cached: bool, tag: str) -> Run:  # fmt: skip
    """Run the conversations under one edit kind; with ``cached`` False every call gets a
    fresh ``cache_salt`` and no session (nothing cached can match)."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_openai.chat_models.base import _convert_message_to_dict
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.config import get_config

    from langgraph_kvcache import ChatKVCache

    tools_json = [convert_to_openai_tool(lookup)]
    shifted = kind.endswith(" shifted")
    kind = kind.removesuffix(" shifted")
    model = ChatKVCache(base_url=f"{url}/v1", model=model_name, max_tokens=24, streaming=True,
                        timeout=300, reuse="shifted" if shifted and cached else None)  # fmt: skip
    # with the cache, one salt per kind: a kind reads only its own calls' KV, never another
    # kind's identical prompts (two edits that leave the same prompts would read each other's)
    kind_salt = f"{tag}-{kind}-{window}{'-shifted' if shifted else ''}".replace(" ", "-")
    salt = {"extra_body": {"cache_salt": kind_salt if cached else uuid.uuid4().hex}}
    summarizer = ChatKVCache(base_url=f"{url}/v1", model=model_name, max_tokens=64,
                             session_id=f"summarizer-{tag}", **salt)  # fmt: skip
    if kind == "cached summary":
        summarizer = model  # it summarises with the agent's own model, in the thread's session
    run = Run()
    timer = _FirstToken(run)
    http = httpx.Client(base_url=url, timeout=60)

    @wrap_model_call
    def salted(request: Any, handler: Any) -> Any:
        """Outermost: the kind's ``cache_salt``, or without the cache a fresh one (a summary
        call made in a middleware gets it too)."""
        fresh = kind_salt if cached else uuid.uuid4().hex
        settings = {**request.model_settings, "extra_body": {"cache_salt": fresh}}
        return handler(request.override(model_settings=settings))

    @wrap_model_call
    def record(request: Any, handler: Any) -> Any:
        """Innermost: force the turn's tool call, tokenize what the model sees, note usage."""
        forced = isinstance(request.messages[-1], HumanMessage)
        settings = {} if cached else {"extra_body": {"cache_salt": uuid.uuid4().hex}}
        settings = {**request.model_settings, **settings, **({"max_tokens": 48} if forced else {})}
        request = request.override(tool_choice="lookup" if forced else "none",
                                   model_settings=settings)  # fmt: skip
        msgs = ([request.system_message] if request.system_message else []) + request.messages
        body = {"model": model_name, "messages": [_convert_message_to_dict(m) for m in msgs],
                "tools": tools_json}  # fmt: skip
        prompt = http.post("/tokenize", json=body).json()["tokens"]
        before = set(timer.first)
        response = handler(request)
        answer = response.result[-1]
        assert isinstance(answer, AIMessage)
        details = (answer.usage_metadata or {}).get("input_token_details") or {}
        new = [v for k, v in timer.first.items() if k not in before]
        calls = [(c["name"], c["args"]) for c in answer.tool_calls]
        run.calls.append(Call(thread=get_config()["configurable"]["thread_id"], prompt=prompt,
                              cached=int(details.get("cache_read", 0) or 0),
                              ttft_s=new[0] if new else float("nan"),
                              answer=f"{answer.content!s} {calls}"))  # fmt: skip
        return response

    agents = {}
    for i in range(threads):
        thread = f"edits-{kind_salt}-{i}-{'c' if cached else 'n'}"
        agents[thread] = create_agent(
            model, tools=[lookup], system_prompt="You answer from the notes you look up.",
            middleware=[salted, *middlewares(kind, window, summarizer), record],
            checkpointer=InMemorySaver(),
        )  # fmt: skip
    for turn in range(turns):
        for i, (thread, agent) in enumerate(agents.items()):
            subject = SUBJECTS[(turn + 3 * i) % len(SUBJECTS)]
            ask = f"Turn {turn + 1}: what do the notes say about {subject}?"
            agent.invoke({"messages": [("user", ask)]},
                         {"configurable": {"thread_id": thread}, "callbacks": [timer]})  # fmt: skip
    http.close()
    return run


def figures(run: Run) -> dict[str, float]:
    """prefix / anywhere / cached shares and the TTFT p50 over the calls from each thread's
    first edited call on (a prompt that does not extend its thread's previous one); with no
    edit at all (``none``), over every call but each thread's first."""
    threads: dict[str, list[Call]] = {}
    for call in run.calls:
        threads.setdefault(call.thread, []).append(call)
    edited_any = any(
        _common(b.prompt, a.prompt) < len(a.prompt)
        for calls in threads.values()
        for a, b in itertools.pairwise(calls)
    )
    prefix = anywhere = cached = total = 0
    ttfts = []
    for calls in threads.values():
        known: set[tuple[int, ...]] = set()
        counting = False
        for i, call in enumerate(calls):
            p, earlier = call.prompt, [c.prompt for c in calls[:i]]
            if i and (not edited_any or _common(p, earlier[-1]) < len(earlier[-1])):
                counting = True
            if counting:
                covered = [False] * len(p)
                for s in range(len(p) - NGRAM + 1):
                    if tuple(p[s : s + NGRAM]) in known:
                        covered[s : s + NGRAM] = [True] * NGRAM
                prefix += max((_common(p, e) for e in earlier), default=0)
                anywhere += sum(covered)
                cached, total = cached + min(call.cached, len(p)), total + len(p)
                ttfts.append(call.ttft_s)
            known.update(tuple(p[s : s + NGRAM]) for s in range(len(p) - NGRAM + 1))
    if not total:
        return {"calls": 0}
    return {"calls": len(ttfts), "prefix": prefix / total, "anywhere": anywhere / total,
            "cached": cached / total, "ttft": statistics.median(ttfts)}  # fmt: skip


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from examples.server_process import ServerProcess, equal_cores_env
    from server.model import build_default_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 threads, 8 turns, one window")
    ap.add_argument("--threads", type=int, default=None, help="threads interleaved (3)")
    ap.add_argument("--turns", type=int, default=None, help="turns per thread (10)")
    ap.add_argument("--windows", type=int, nargs="+", default=None,
                    help="trim/summary/clear thresholds in tokens (600 1200)")  # fmt: skip
    ap.add_argument("--kinds", nargs="+", default=None,
                    help="only these edit kinds (none, trim, stepped, summary, 'cached summary', "
                         "'clear tools')")  # fmt: skip
    ap.add_argument("--exact-only", action="store_true",
                    help="leave out the shifted-reuse kinds ('trim shifted', ...)")  # fmt: skip
    ap.add_argument("--reserved-cpus", type=int, default=0)
    args = ap.parse_args(argv)
    threads = args.threads or (2 if args.quick else 3)
    turns = args.turns or (8 if args.quick else 10)
    windows = args.windows or ([600] if args.quick else [600, 1200])
    kinds = [("none", 0)] + [(k, w) for w in windows for k in ("trim", "stepped")]
    kinds += [("summary", windows[-1]), ("cached summary", windows[-1]),
              ("clear tools", windows[0])]  # fmt: skip
    if not args.exact_only:  # the same edits with shifted reuse (approximate KV)
        kinds += [(f"{k} shifted", w) for k, w in kinds if k in ("trim", "summary", "clear tools")]
    if args.kinds:
        kinds = [(k, w) for k, w in kinds if k in args.kinds]
    flags = ["--kv-cache-memory-bytes", "128MiB", "--max-model-len", "2560", "--max-num-seqs",
             "8", "--kv-ram-bytes", "1GiB", "--kv-disk-bytes", "4GiB"]  # fmt: skip
    started = time.perf_counter()
    rows = []
    with ServerProcess(flags=flags, model=build_default_model(), progress=say,
                       env=equal_cores_env(args.reserved_cpus)) as server:  # fmt: skip
        name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        tag = uuid.uuid4().hex[:6]
        for kind, window in kinds:
            label = kind if kind in ("none",) else f"{kind} {window}"
            t0 = time.perf_counter()
            on = run_kind(server.url, name, kind, window, threads, turns, True, tag)
            off = run_kind(server.url, name, kind, window, threads, turns, False, tag)
            same = [a.answer for a in on.calls] == [b.answer for b in off.calls]
            f_on, f_off = figures(on), figures(off)
            rows.append((label, f_on, f_off, same, on.summaries, off.summaries))
            say(f"{label}: {f_on} / no cache TTFT {f_off.get('ttft', 0) * 1000:.0f} ms; "
                f"answers identical: {same} ({time.perf_counter() - t0:.0f}s)")  # fmt: skip
        cores = server.omp_cores()
    print()
    print(f"SmolLM2-135M-Instruct float32, {threads} threads x {turns} turns (2 model calls "
          f"each), wall {time.perf_counter() - started:.0f}s; {cores}")  # fmt: skip
    print(
        "| edit | calls after an edit | prefix | anywhere | cached | TTFT p50 cached | "
        "TTFT p50 no cache | speed-up | answers = no cache |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, f, off, same, _, _ in rows:
        if not f.get("calls"):
            print(f"| {label} | 0 (no call was edited) | | | | | | | {same} |")
            continue
        print(f"| {label} | {f['calls']:.0f} | {f['prefix']:.2f} | {f['anywhere']:.2f} | "
              f"{f['cached']:.2f} | {f['ttft'] * 1000:.0f} ms | {off['ttft'] * 1000:.0f} ms | "
              f"{off['ttft'] / f['ttft']:.2f}x | {same} |")  # fmt: skip
    summary_table([(r[0], r[4], r[5]) for r in rows if r[4]])
    return 0


def summary_table(rows: list[tuple[str, list[tuple[int, int, float]], list[Any]]]) -> None:
    """The summary calls of each summary kind: prompt, recomputed, share cached, time."""
    print()
    print("| summary calls | calls | prompt tokens (mean) | recomputed per call (mean) | "
          "cached | time p50 cached | time p50 no cache |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, on, off in rows:
        prompt = sum(p for _, p, _ in on)
        recomputed = sum(p - c for c, p, _ in on)
        t_on = statistics.median(t for *_, t in on)
        t_off = statistics.median(t for *_, t in off) if off else float("nan")
        share = 1 - recomputed / prompt
        print(f"| {label} | {len(on)} | {prompt / len(on):.0f} | {recomputed / len(on):.0f} | "
              f"{share:.2f} | {t_on * 1000:.0f} ms | {t_off * 1000:.0f} ms |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
