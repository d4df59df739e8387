"""LangGraph chat agents on the bundled server: this server's KV tiers vs vLLM's prefix cache.

Run ``make demo`` or ``python -m examples.demo``. It

1. builds (once) or locates the default model, SmolLM2-135M-Instruct;
2. starts ``python -m server`` (examples/server_process.py) with the session KV cache on, and
   runs four LangGraph agent threads (one LLM node, ``ChatKVCache``; ``SQLAlchemySaver`` on a
   SQLite file with ``kv_server=`` keeping each thread's KV session) for five turns each,
   interleaved (turn 1 of every thread, then turn 2, ...). Each thread's system prompt holds
   notes about its user and ~600 words of background reading (an offline Wikipedia article,
   a different one per thread), about 1k tokens that every turn sends again;
3. starts the same server with ``--no-kv-offload``: vLLM's own engine with prefix caching on,
   what a vLLM user runs today, and runs the same turns. The resident KV budget of both
   (``--kv-cache-memory-bytes 96MiB``, 17 blocks of 128 tokens) holds about two of the four
   histories, so between two turns of a thread the other threads push it out of vLLM's cache,
   as many threads do on a real GPU cache; this server finds it in its RAM tier;
4. prints per turn, the median over the threads: prompt tokens, time to first token (TTFT,
   measured by streaming the graph with ``stream_mode="messages"``) and cached prompt tokens of
   both runs; stops the servers.

Turn 1 finds nothing cached in either run (its row is the no-cache reference). Both servers get
the same cores (``equal_cores_env``; each one's OpenMP core list is printed from its log).
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

from examples.server_process import ServerProcess, equal_cores_env, locate_model
from langgraph_kvcache import ChatKVCache, SQLAlchemySaver

NOTES = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. "
    "Answer in English, in one or two short sentences. "
    "Notes about the user for the whole conversation: they plan a one-week trip to {region} in "
    "late spring, like museums, good bread, trains rather than cars, quiet mornings and long "
    "walks, and want to see two or three cities without hurrying. "
    "They carry one small backpack, book hotels near the main station, prefer small family "
    "restaurants to famous ones, read a little of the local language, wake up early, avoid "
    "crowds at midday, enjoy markets, rivers, bridges and old churches, and like to end each "
    "day with a quiet dinner and a short evening walk before going to bed early."
)
REGIONS = ("Europe", "Asia", "Africa", "South America")
"""One thread per region: its user's trip, and the Wikipedia article of its background."""
BACKGROUND_WORDS = 600
"""Words of the region's Wikipedia article added to the system prompt as background reading:
a realistic agent context (~1k tokens) whose prefill the cache saves on every later turn."""
QUESTIONS = [
    "Which city should I visit first?",
    "Name one famous museum there.",
    "How do I get from there to the next city?",
    "What food should I try there?",
    "Thanks! Summarise my trip in one sentence.",
]
SERVER_FLAGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", "96MiB"]
PLAIN_VLLM_FLAGS = ["--no-kv-offload"]
"""vLLM's engine with its prefix cache (on, as in ``vllm serve``) and no KV tiers."""


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


def system_prompt(region: str) -> str:
    """The user notes plus the start of the offline Wikipedia article on ``region``."""
    from examples.rag import load_articles

    background = " ".join(load_articles()[region].split()[:BACKGROUND_WORDS])
    return (
        f"{NOTES.format(region=region)}\n\nBackground reading (Wikipedia, {region}):\n{background}"
    )


def build_agent(llm: ChatKVCache, saver: SQLAlchemySaver, region: str) -> CompiledStateGraph:
    """A one-node chat agent: the system prompt, then the thread's messages, to the model."""
    system = SystemMessage(system_prompt(region))

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


def run_threads(server: ServerProcess, *, keep_sessions: bool, work: Path) -> list[list[Turn]]:
    """Warm the engine up, then ``QUESTIONS`` on one new thread per region of a new SQLite
    checkpointer, interleaved; ``turns[t][i]`` is turn ``t + 1`` of region ``i``."""
    llm = ChatKVCache(
        base_url=server.url + "/v1", model=server.model_name, max_tokens=48, frequency_penalty=0.8
    )
    llm.invoke("Hello!", session_id="warmup")  # first request pays one-off engine costs
    db = work / f"checkpoints-{uuid.uuid4().hex[:6]}.sqlite"
    kv_server = server.url if keep_sessions else None  # no tiers: the session API is off too
    threads = {region: f"demo-{region.lower().replace(' ', '-')}-{uuid.uuid4().hex[:6]}"
               for region in REGIONS}  # fmt: skip
    turns: list[list[Turn]] = []
    with SQLAlchemySaver.from_conn_string(f"sqlite:///{db}", kv_server=kv_server) as saver:
        saver.setup()
        graphs = {region: build_agent(llm, saver, region) for region in REGIONS}
        for i, question in enumerate(QUESTIONS, 1):
            row = [run_turn(graphs[r], threads[r], question) for r in REGIONS]
            cells = ", ".join(f"{t.ttft_s * 1000:.0f} ms/{t.cached_tokens}" for t in row)
            say(f"turn {i} (TTFT/cached per thread): {cells}")
            turns.append(row)
        if keep_sessions:
            for thread_id in threads.values():
                saver.delete_thread(thread_id)  # drops the checkpoints and the KV session
    return turns


def _median(row: list[Turn], attr: str) -> float:
    return statistics.median(getattr(t, attr) for t in row)


def print_table(ours: list[list[Turn]], plain: list[list[Turn]], cores: dict[str, str]) -> None:
    """Per turn the medians over the threads, side by side, then one thread's answers."""
    print()
    print(f"{len(REGIONS)} threads x {len(QUESTIONS)} turns, interleaved; both servers "
          f"{' '.join(SERVER_FLAGS)} (medians over the threads)")  # fmt: skip
    print("kvcache: this server, the session KV cache (RAM + disk tiers), thread = session")
    print("vLLM   : same server with --no-kv-offload: vLLM's engine, prefix caching on; the")
    print("         other threads push each thread's history out of its cache between turns")
    for name, line in cores.items():
        print(f"  {name} cores: {line}")
    print()
    print(f"{'turn':>4}  {'prompt':>6}  {'kvcache':>8}  {'cached':>6}  {'vLLM':>8}  {'cached':>6}"
          "  speed-up")  # fmt: skip
    for i, (a, b) in enumerate(zip(ours, plain, strict=True), 1):
        ta, tb = _median(a, "ttft_s"), _median(b, "ttft_s")
        note = "  (nothing cached yet in either)" if i == 1 else ""
        print(
            f"{i:>4}  {_median(a, 'prompt_tokens'):>6.0f}  {ta * 1000:>6.0f}ms  "
            f"{_median(a, 'cached_tokens'):>6.0f}  {tb * 1000:>6.0f}ms  "
            f"{_median(b, 'cached_tokens'):>6.0f}  {tb / ta:>6.1f}x{note}"
        )
    later_ours = statistics.median(t.ttft_s for row in ours[1:] for t in row) * 1000
    later_plain = statistics.median(t.ttft_s for row in plain[1:] for t in row) * 1000
    n = len(ours)
    print(f"turns 2-{n}: median TTFT {later_ours:.0f} ms kvcache, {later_plain:.0f} ms vLLM")
    print(
        "(TTFT includes the checkpointer and graph overhead; on a busy machine figures are noisy)"
    )
    print()
    print(f"thread {REGIONS[0]}, kvcache run:")
    for q, row in zip(QUESTIONS, ours, strict=True):
        print(f"  user: {q}\n  agent: {row[0].answer[:110]}")
    print()


def main(argv: list[str] | None = None) -> None:
    """Build/locate the model, run the threads on both servers, print the comparison."""
    extra = list(sys.argv[1:] if argv is None else argv)
    locate_model()
    work = Path(tempfile.mkdtemp(prefix="lgkv-demo-"))
    say(f"working folder (SQLite checkpoints, KV cache, server logs): {work}")
    env, cores = equal_cores_env(), {}
    say("1/2: this server (session KV cache on)")
    flags = [*SERVER_FLAGS, *extra]
    with ServerProcess(work / "kv", flags, log_dir=work / "on", env=env) as srv:
        ours = run_threads(srv, keep_sessions=True, work=work)
        cores["kvcache"] = srv.omp_cores()
    say("2/2: vLLM's prefix cache alone (same prompts, --no-kv-offload)")
    flags = [*SERVER_FLAGS, *PLAIN_VLLM_FLAGS, *extra]
    with ServerProcess(work / "kv-off", flags, log_dir=work / "off", env=env) as srv:
        plain = run_threads(srv, keep_sessions=False, work=work)
        cores["vLLM"] = srv.omp_cores()
    print_table(ours, plain, cores)


if __name__ == "__main__":
    main()
