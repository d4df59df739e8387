"""A five-turn chat against the bundled server, showing the session KV cache at work.

Run ``make demo`` or ``python examples/demo.py [extra server flags]``. It

1. builds (once) or locates the default model, SmolLM2-135M-Instruct;
2. starts ``python -m server`` on a free port and waits for ``/health``;
3. chats five turns in one session over the OpenAI-compatible HTTP API (streaming, so the
   time to first token is measured), printing per turn: TTFT, prompt tokens, cached tokens;
4. shows the session through the session API, deletes it, and stops the server cleanly.

Turn 1 computes the whole prompt; from turn 2 on the history's KV comes from the cache, so
``cached`` covers nearly all of the prompt (whole 128-token blocks on CPU).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
SYSTEM = (
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
QUESTIONS = [
    "What is the capital of France?",
    "Name one famous museum there.",
    "How do I get from Paris to Lyon?",
    "What food should I try in Lyon?",
    "Thanks! Summarise my trip in one sentence.",
]
START_TIMEOUT_S = 600.0


def say(msg: str) -> None:
    """Progress message."""
    print(f"[demo] {msg}", flush=True)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def locate_model() -> Path:
    """The default model folder, built from the offline GGUF the first time."""
    from server.model import build_default_model, default_model_dir

    folder = default_model_dir()
    if not (folder / "config.json").is_file():
        say(f"building the default model into {folder} (once, about a minute)...")
    return build_default_model()


def start_server(model: Path, port: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    """``python -m server`` in its own process group, logging to ``log_path``."""
    cmd = [sys.executable, "-m", "server", "serve", "--model", str(model), "--port", str(port)]
    cmd += ["--kv-cache-memory-bytes", "512MiB", "--max-model-len", "4096", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    say(f"starting the server: {' '.join(cmd[1:])}")
    say(f"server log: {log_path}")
    with log_path.open("wb") as log:
        return subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path) -> None:
    """Poll ``/health`` until 200; exit with the log's tail if the server dies first."""
    t0 = time.monotonic()
    last = 0.0
    while time.monotonic() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise SystemExit(f"[demo] the server exited ({proc.returncode}):\n{tail}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                say(f"server ready after {time.monotonic() - t0:.0f}s")
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() - last > 10:
            say(f"waiting for the engine to load ({time.monotonic() - t0:.0f}s)...")
            last = time.monotonic()
        time.sleep(0.5)
    raise SystemExit("[demo] the server did not become healthy in time")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (clean shutdown), SIGKILL of its process group if it hangs."""
    if proc.poll() is not None:
        return
    say("stopping the server...")
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    # uvicorn re-raises the SIGTERM it handled, so a clean stop reads -15.
    clean = proc.returncode in (0, -signal.SIGTERM)
    say("server stopped cleanly" if clean else f"server exited with {proc.returncode}")


def chat_turn(client: httpx.Client, model: str, session: str, messages: list[dict]) -> dict:
    """One streamed turn; returns the answer, TTFT and usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt_cache_key": session,
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"[demo] chat failed ({r.status_code}): {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(text)
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {
        "answer": "".join(parts).strip(),
        "ttft_ms": 1000 * (ttft if ttft is not None else time.perf_counter() - t0),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": details.get("cached_tokens", 0),
    }


def run_chat(base: str, model: str) -> None:
    """Five turns in one session, a line of figures per turn, then the session's record."""
    session = f"demo-{uuid.uuid4().hex[:8]}"
    say(f"chatting in session {session!r}")
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    print(f"\n{'turn':>4}  {'TTFT ms':>8}  {'prompt':>6}  {'cached':>6}  answer")
    with httpx.Client(base_url=base, timeout=300) as client:
        for i, question in enumerate(QUESTIONS, 1):
            messages.append({"role": "user", "content": question})
            turn = chat_turn(client, model, session, messages)
            messages.append({"role": "assistant", "content": turn["answer"]})
            answer = turn["answer"].replace("\n", " ")
            print(
                f"{i:>4}  {turn['ttft_ms']:>8.0f}  {turn['prompt_tokens']:>6}  "
                f"{turn['cached_tokens']:>6}  {answer[:70]}"
            )
        print()
        info = client.get(f"/v1/sessions/{session}")
        if info.status_code == 200:
            s = info.json()
            say(
                f"session {session}: {s['turns']} turns, {s['num_tokens']} tokens in "
                f"{s['num_blocks']} blocks (ram {s['tiers']['ram']['blocks']}, "
                f"disk {s['tiers']['disk']['blocks']})"
            )
            freed = client.delete(f"/v1/sessions/{session}").json().get("freed_blocks")
            say(f"deleted the session ({freed} blocks freed)")
        else:
            say(f"session API: {info.json()['error']['message']}")


def main(argv: list[str] | None = None) -> None:
    """Build/locate the model, start the server, chat, stop."""
    extra = list(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(REPO_ROOT))
    model = locate_model()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp(prefix="lgkv-demo-")) / "server.log"
    proc = start_server(model, port, log_path, extra)
    try:
        wait_healthy(proc, base, log_path)
        served = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        run_chat(base, served)
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
