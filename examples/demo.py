"""A LangGraph chat agent on the bundled server, with and without KV reuse, side by side.

Run ``make demo`` or ``python -m examples.demo``. It

1. builds (once) or locates the default model, SmolLM2-135M-Instruct;
   the agent's system prompt holds notes about the user and ~600 words of background reading
   (the offline Wikipedia article "Europe"), about 1k tokens that every turn sends again;
2. starts ``python -m server`` (examples/server_process.py) with the session KV cache on, and
   runs a LangGraph agent (one LLM node, ``ChatKVCache``) for five turns on one thread, with
   ``SQLAlchemySaver`` on a SQLite file and ``kv_server=`` keeping the thread's KV session;
3. starts the same server again with KV reuse off (``--no-kv-offload
   --no-enable-prefix-caching``: plain vLLM recomputing every prompt) and runs the same turns;
4. prints per turn: prompt tokens, time to first token (TTFT, measured by streaming the graph
   with ``stream_mode="messages"``) and cached prompt tokens of both runs; stops the servers.

Turn 1 computes the whole prompt in both runs; from turn 2 on the reuse run takes the history's
KV from the cache (whole 128-token blocks on CPU) and computes only the new tokens.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph

from examples.server_process import ServerProcess, locate_model
from langgraph_kvcache import ChatKVCache, SQLAlchemySaver

NOTES = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. "
    "Answer in English, in one or two short sentences. "
    "Notes about the user for the whole conversation: they plan a one-week trip in late "
    "spring, like museums, good bread, trains rather than cars, quiet mornings and long "
    "walks, have been to Italy before, and want to see two or three cities without hurrying. "
    "They carry one small backpack, book hotels near the main station, prefer small family "
    "restaurants to famous ones, read a little of the local language, wake up early, avoid "
    "crowds at midday, enjoy markets, rivers, bridges and old churches, and like to end each "
    "day with a quiet dinner and a short evening walk before going to bed early."
)
BACKGROUND_WORDS = 600
"""Words of the Wikipedia article "Europe" added to the system prompt as background reading:
a realistic agent context (~1k tokens) whose prefill the cache saves on every later turn."""
QUESTIONS = [
    "What is the capital of France?",
    "Name one famous museum there.",
    "How do I get from Paris to Lyon?",
    "What food should I try in Lyon?",
    "Thanks! Summarise my trip in one sentence.",
]
SERVER_FLAGS = ["--max-model-len", "4096", "--kv-cache-memory-bytes", "512MiB"]
NO_REUSE_FLAGS = ["--no-kv-offload", "--no-enable-prefix-caching"]


@dataclass(frozen=True)
class Turn:
    """Figures of one agent turn."""

    ttft_s: float
    """Seconds from ``graph.stream`` to the first streamed answer token."""
    prompt_tokens: int
    """Prompt tokens of the LLM call."""
    cached_tokens: int
    """Prompt tokens whose KV came from the cache."""
    answer: str


def say(msg: str) -> None:
    """Progress message."""
    print(f"[demo] {msg}", flush=True)


def system_prompt() -> str:
    """The user notes plus the start of the offline Wikipedia article "Europe"."""
    from examples.rag import load_articles

    background = " ".join(load_articles()["Europe"].split()[:BACKGROUND_WORDS])
    return f"{NOTES}\n\nBackground reading (Wikipedia, Europe):\n{background}"


def build_agent(llm: ChatKVCache, saver: SQLAlchemySaver) -> CompiledStateGraph:
    """A one-node chat agent: the system prompt, then the thread's messages, to the model."""
    system = SystemMessage(system_prompt())

    def agent(state: MessagesState) -> dict:
        # ChatKVCache names the KV session after the running thread by itself.
        return {"messages": [llm.invoke([system, *state["messages"]])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    return builder.compile(checkpointer=saver)


def run_turn(graph: CompiledStateGraph, thread_id: str, question: str) -> Turn:
    """One user turn, streamed; TTFT is the time to the first non-empty token chunk."""
    config = {"configurable": {"thread_id": thread_id}}
    t0 = time.perf_counter()
    ttft: float | None = None
    for chunk, _meta in graph.stream(
        {"messages": [HumanMessage(question)]}, config, stream_mode="messages"
    ):
        if ttft is None and isinstance(chunk, AIMessageChunk) and chunk.content:
            ttft = time.perf_counter() - t0
    last = graph.get_state(config).values["messages"][-1]
    assert isinstance(last, AIMessage)
    usage = last.usage_metadata or {}
    return Turn(
        ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
        prompt_tokens=usage.get("input_tokens", 0),
        cached_tokens=usage.get("input_token_details", {}).get("cache_read", 0),
        answer=str(last.content).replace("\n", " ").strip(),
    )


def run_conversation(server: ServerProcess, *, keep_sessions: bool, work: Path) -> list[Turn]:
    """Warm the engine up, then all ``QUESTIONS`` on a new thread of a new SQLite checkpointer."""
    llm = ChatKVCache(
        base_url=server.url + "/v1", model=server.model_name, max_tokens=48, frequency_penalty=0.8
    )
    llm.invoke("Hello!", session_id="warmup")  # first request pays one-off engine costs
    db = work / f"checkpoints-{uuid.uuid4().hex[:6]}.sqlite"
    kv_server = server.url if keep_sessions else None  # reuse off: the session API is off too
    thread_id = f"demo-{uuid.uuid4().hex[:8]}"
    turns = []
    with SQLAlchemySaver.from_conn_string(f"sqlite:///{db}", kv_server=kv_server) as saver:
        saver.setup()
        graph = build_agent(llm, saver)
        for i, question in enumerate(QUESTIONS, 1):
            turn = run_turn(graph, thread_id, question)
            say(f"turn {i}: TTFT {turn.ttft_s * 1000:.0f} ms, cached {turn.cached_tokens}")
            turns.append(turn)
        if keep_sessions:
            saver.delete_thread(thread_id)  # drops the checkpoints and the KV session
    return turns


def print_table(reuse: list[Turn], plain: list[Turn]) -> None:
    """Side by side figures, then the answers of the reuse run."""
    print()
    print("KV reuse ON : session KV cache (RAM + disk tiers), thread = session")
    print("KV reuse OFF: same server and model with --no-kv-offload --no-enable-prefix-caching")
    print("              (plain vLLM: every turn recomputes the whole prompt)")
    print()
    head = (
        f"{'turn':>4}  {'prompt':>6}  {'TTFT on':>8}  {'cached':>6}  {'TTFT off':>8}  {'cached':>6}"
    )
    print(head + "  speed-up")
    for i, (a, b) in enumerate(zip(reuse, plain, strict=True), 1):
        print(
            f"{i:>4}  {a.prompt_tokens:>6}  {a.ttft_s * 1000:>6.0f}ms  {a.cached_tokens:>6}  "
            f"{b.ttft_s * 1000:>6.0f}ms  {b.cached_tokens:>6}  {b.ttft_s / a.ttft_s:>6.1f}x"
        )
    later_on = statistics.median(t.ttft_s for t in reuse[1:]) * 1000
    later_off = statistics.median(t.ttft_s for t in plain[1:]) * 1000
    n = len(reuse)
    print(f"turns 2-{n}: median TTFT {later_on:.0f} ms with reuse, {later_off:.0f} ms without")
    print(
        "(TTFT includes the checkpointer and graph overhead; on a busy machine figures are noisy)"
    )
    print()
    for i, (q, a) in enumerate(zip(QUESTIONS, reuse, strict=True), 1):
        print(f"{i}. user: {q}\n   agent: {a.answer[:110]}")
    print()


def main(argv: list[str] | None = None) -> None:
    """Build/locate the model, run both conversations, print the comparison."""
    extra = list(sys.argv[1:] if argv is None else argv)
    locate_model()
    work = Path(tempfile.mkdtemp(prefix="lgkv-demo-"))
    say(f"working folder (SQLite checkpoints, KV cache, server logs): {work}")
    say("1/2: KV reuse ON")
    with ServerProcess(work / "kv", [*SERVER_FLAGS, *extra], log_dir=work / "on") as srv:
        reuse = run_conversation(srv, keep_sessions=True, work=work)
    say("2/2: KV reuse OFF (same prompts, plain vLLM)")
    flags = [*SERVER_FLAGS, *NO_REUSE_FLAGS, *extra]
    with ServerProcess(work / "kv-off", flags, log_dir=work / "off") as srv:
        plain = run_conversation(srv, keep_sessions=False, work=work)
    print_table(reuse, plain)


if __name__ == "__main__":
    main()
