"""Every call stream of an agent keeps its context: each call's cached share of the earlier
call it extends.

Real agents make more than one stream of model calls per LangGraph thread, and ChatKVCache
puts them all in the thread's session. Five scenarios, each a LangGraph graph on ChatKVCache
with ``SQLAlchemySaver(kv_server=...)`` on SQLite, one thread each, a ~700-token system prompt
unique to the run:

- ``nested``: each user turn a node first calls the model with its own prompt (a tool's own
  model call: its system prompt and the question), then the agent answers on the history;
- ``summarizer``: after each answer a node asks the model to summarise the history (history +
  an instruction); the next turn extends the answer, not the summary;
- ``send``: each turn fans out (``Send``) to two branches with their own system prompts, run in
  parallel, each extending its own previous call;
- ``rewind``: four turns, then a turn from the checkpoint after turn 2;
- ``fork``: four turns, ``copy_thread``, then a turn on the copy.

Per scenario it prints the calls measured and the least and mean **cover**: the call's cached
tokens over the prompt + answer of the earlier call it extends (that call's last token never
had KV, so a full hit reads all but one). The goal (issue 28) is >= 0.99 everywhere. Two
servers in one invocation, on the same cores, flags and model: ``--kv-branch-blocks 64`` (the
default: a session keeps every branch) and ``0`` (a session is its last call's path, as before
the tree; reuse up to the last shared token stays on in both).

    python benchmarks/agent_streams.py            # SmolLM2-135M-Instruct float32
    python benchmarks/agent_streams.py --turns 3  # shorter

tests/integration/thread_session/test_session_tree.py runs the scenarios on the test server.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Send

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("nested", "summarizer", "send", "rewind", "fork")
QUESTIONS = (
    "How heavy is item 3?",
    "And item 12, compared with item 3?",
    "Which of the two is lighter?",
    "What about item 40?",
    "Summarise the weights we discussed.",
)


@dataclass(frozen=True)
class Call:
    """One model call's usage."""

    prompt: int
    completion: int
    cached: int

    def cover(self, earlier: Call) -> float:
        """Share of ``earlier``'s prompt + answer this call read from the cache."""
        return self.cached / (earlier.prompt + earlier.completion)


@dataclass
class Streams:
    """The calls of each stream of a scenario, in order."""

    calls: dict[str, list[Call]] = field(default_factory=dict)
    covers: list[float] = field(default_factory=list)
    """Cover of every measured call against the call it extends."""

    def record(self, stream: str, answer: AIMessage) -> None:
        usage = answer.usage_metadata or {}
        cached = (usage.get("input_token_details") or {}).get("cache_read", 0)
        call = Call(usage.get("input_tokens", 0), usage.get("output_tokens", 0), cached)
        self.calls.setdefault(stream, []).append(call)

    def measure(self, stream: str, earlier: Call | None = None) -> None:
        """Count the stream's last call against ``earlier`` (default: its call before)."""
        calls = self.calls[stream]
        self.covers.append(calls[-1].cover(earlier or calls[-2]))


def facts(run: str, who: str = "assistant") -> SystemMessage:
    """About 700 tokens, unique to ``run``."""
    body = " ".join(f"Item {i} weighs {i * 7 % 97} grams." for i in range(50))
    return SystemMessage(f"Run {run}. You are a terse {who}; answer in one line. {body}")


def _merge(a: dict[str, list[AnyMessage]], b: dict[str, list[AnyMessage]]) -> dict[str, Any]:
    return {**a, **b}


class StreamState(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    branches: Annotated[dict[str, list[AnyMessage]], _merge]


def build(kind: str, model: Any, streams: Streams, run: str, checkpointer: Any) -> Any:
    """The graph of scenario ``kind`` (see the module doc)."""

    def agent(state: StreamState) -> dict[str, Any]:
        answer = model.invoke(state["messages"])
        streams.record("agent", answer)
        return {"messages": [answer]}

    def helper(state: StreamState) -> dict[str, Any]:
        question = state["messages"][-1].content
        msgs = [SystemMessage(f"Run {run}. You look up notes."), HumanMessage(question)]
        streams.record("helper", model.invoke(msgs))
        return {}

    def summarize(state: StreamState) -> dict[str, Any]:
        msgs = [*state["messages"], HumanMessage("Summarise our conversation in one line.")]
        streams.record("summary", model.invoke(msgs))
        return {}

    def fan_out(state: StreamState) -> list[Send]:
        question = state["messages"][-1].content
        known = state.get("branches") or {}
        return [
            Send("branch", {"name": n, "history": known.get(n) or [facts(run, n)], "q": question})
            for n in ("critic", "planner")
        ]

    def branch(payload: dict[str, Any]) -> dict[str, Any]:
        msgs = [*payload["history"], HumanMessage(payload["q"])]
        answer = model.invoke(msgs)
        streams.record(payload["name"], answer)
        return {"branches": {payload["name"]: [*msgs, answer]}}

    builder = StateGraph(StreamState)
    if kind == "send":
        builder.add_node("branch", branch)  # type: ignore[arg-type]
        builder.add_conditional_edges(START, fan_out, ["branch"])
        return builder.compile(checkpointer=checkpointer)
    builder.add_node("agent", agent)
    if kind == "nested":
        builder.add_node("helper", helper)
        builder.add_edge(START, "helper")
        builder.add_edge("helper", "agent")
    else:
        builder.add_edge(START, "agent")
    if kind == "summarizer":
        builder.add_node("summarize", summarize)
        builder.add_edge("agent", "summarize")
    return builder.compile(checkpointer=checkpointer)


def run_scenario(kind: str, model: Any, saver: Any, run: str, turns: int) -> Streams:
    """Run scenario ``kind`` on a fresh thread; return its calls and covers."""
    streams = Streams()
    graph = build(kind, model, streams, run, saver)
    thread = f"{kind}-{run}"
    config: dict[str, Any] = {"configurable": {"thread_id": thread}}
    first: list[AnyMessage] = [facts(run)]
    for i in range(turns):
        graph.invoke({"messages": [*first, HumanMessage(QUESTIONS[i % len(QUESTIONS)])]}, config)
        first = []
        if i == 0:
            continue
        if kind == "send":
            streams.measure("critic")
            streams.measure("planner")
        elif kind in ("nested", "summarizer"):
            streams.measure("agent")
    if kind == "rewind":
        back = next(
            s
            for s in graph.get_state_history(config)
            if len(s.values["messages"]) == 1 + 2 * 2 and not s.next
        )
        graph.invoke({"messages": [HumanMessage("Back to item 5: how heavy?")]}, back.config)
        streams.measure("agent", streams.calls["agent"][1])
    elif kind == "fork":
        saver.copy_thread(thread, f"{thread}-copy")
        copy = {"configurable": {"thread_id": f"{thread}-copy"}}
        graph.invoke({"messages": [HumanMessage("And item 7?")]}, copy)
        streams.measure("agent", streams.calls["agent"][-2])
    return streams


def run_all(
    base_url: str, model_name: str, db_path: Path, turns: int, max_tokens: int, run: str
) -> dict[str, Streams]:
    """Every scenario against the server at ``base_url``."""
    from langgraph_kvcache import ChatKVCache
    from langgraph_kvcache.checkpoint import SQLAlchemySaver

    model = ChatKVCache(
        base_url=f"{base_url}/v1", model=model_name, max_tokens=max_tokens, timeout=300
    )
    out: dict[str, Streams] = {}
    with SQLAlchemySaver.from_conn_string(f"sqlite:///{db_path}", kv_server=base_url) as saver:
        saver.setup()
        for kind in SCENARIOS:
            out[kind] = run_scenario(kind, model, saver, run, turns)
    return out


def summary(streams: Streams) -> str:
    covers = streams.covers
    if not covers:
        return "no call measured"
    return f"{len(covers)} calls, cover min {min(covers):.3f} mean {statistics.mean(covers):.3f}"


def say(msg: str) -> None:
    print(f"[agent_streams] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    import tempfile

    import httpx

    from examples.server_process import ServerProcess, equal_cores_env
    from server.model import build_default_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--turns", type=int, default=4, help="user turns per scenario (4)")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer length (16)")
    ap.add_argument("--reserved-cpus", type=int, default=0)
    args = ap.parse_args(argv)
    flags = ["--kv-cache-memory-bytes", "128MiB", "--max-model-len", "2048"]
    rows: dict[str, dict[str, str]] = {}
    cores: dict[str, str] = {}
    started = time.perf_counter()
    for label, branch in (("branches kept (64)", "64"), ("last call only (0)", "0")):
        with tempfile.TemporaryDirectory() as tmp, ServerProcess(
            flags=[*flags, "--kv-branch-blocks", branch], model=build_default_model(),
            progress=say, env=equal_cores_env(args.reserved_cpus),
        ) as server:  # fmt: skip
            name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            run = uuid.uuid4().hex[:8]
            t0 = time.perf_counter()
            results = run_all(
                server.url, name, Path(tmp) / "threads.db", args.turns, args.max_tokens, run
            )
            rows[label] = {k: summary(v) for k, v in results.items()}
            cores[label] = server.omp_cores()
            for kind, line in rows[label].items():
                say(f"{label}: {kind}: {line}")
            say(f"{label}: {time.perf_counter() - t0:.0f}s")
    print()
    print(f"SmolLM2-135M-Instruct float32, {args.turns} turns per scenario, answers of up to "
          f"{args.max_tokens} tokens, wall {time.perf_counter() - started:.0f}s")  # fmt: skip
    for label, line in cores.items():
        print(f"  {label}: {line}")
    labels = list(rows)
    print("| scenario | " + " | ".join(labels) + " |")
    print("| --- | " + " | ".join("---" for _ in labels) + " |")
    for kind in SCENARIOS:
        print(f"| {kind} | " + " | ".join(rows[label][kind] for label in labels) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
