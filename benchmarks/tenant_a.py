"""Tenant A of ``benchmarks/tenants.py``: the loads one key puts on a shared server while
tenant B measures (oversized bodies, pins to its quota, long generations), each counting what
it got back in a :class:`Load`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
MAX_BODY = 2 << 20  # the server's default --max-body-bytes
MAX_NUM_SEQS = 8


@dataclass
class Load:
    """Tenant A's activity in one phase: answers by HTTP status (or exception name)."""

    statuses: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    note: str = ""
    sample: str = ""
    """The start of one refusal's text."""

    def count(self, what: str | int, text: str = "") -> None:
        with self.lock:
            self.statuses[str(what)] += 1
            if text and not self.sample:
                self.sample = f"{what}: {text[:140]}"

    def summary(self) -> str:
        done = ", ".join(f"{n} x {s}" for s, n in sorted(self.statuses.items()))
        return "; ".join(p for p in (done or "nothing", self.note, self.sample) if p)


def client(url: str, key: str, timeout: float = 300.0) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


# --------------------------------------------------------------------------- tenant A


def oversized_bodies(
    url: str, model: str, stop: threading.Event, load: Load, parallel: int
) -> None:
    """``parallel`` senders of bodies just under the body limit, back to back."""
    head = json.dumps({"model": model, "max_tokens": 1})[:-1] + ', "prompt": ['
    count = (MAX_BODY - len(head) - 4096) // 6  # "12345," per id
    body = (head + ",".join(["12345"] * count) + "]}").encode()
    load.note = f"{parallel} senders of {len(body) / (1 << 20):.2f} MiB bodies"

    def sender() -> None:
        with client(url, KEY_A) as c:
            while not stop.is_set():
                try:
                    r = c.post(
                        "/v1/completions", content=body,
                        headers={"Content-Type": "application/json"},
                    )  # fmt: skip
                    load.count(r.status_code, r.text if r.status_code != 200 else "")
                except httpx.HTTPError as exc:
                    load.count(type(exc).__name__)

    _run_threads([sender] * parallel, stop)


def pin_setup(url: str, model: str, load: Load, limit: int = 64) -> list[str]:
    """A's sessions pinned up to its quota: fill one, pin it with a lease, until a 409."""
    pinned: list[str] = []
    with client(url, KEY_A) as c:
        for i in range(limit):
            sid = f"a-pin-{i}"
            text = " ".join(f"Tenant A private line {i}.{j}." for j in range(110))
            r = c.post(
                "/v1/completions",
                json={"model": model, "prompt": text, "max_tokens": 1, "session_id": sid},
            )
            load.count(f"fill {r.status_code}")
            time.sleep(0.2)  # the turn's record reaches the registry
            pin = c.post(f"/v1/sessions/{sid}/pin", json={"pin_ttl_seconds": 900})
            load.count(f"pin {pin.status_code}")
            if pin.status_code != 200:
                load.note = (
                    f"{len(pinned)} sessions pinned, then {pin.status_code}: "
                    + (pin.json().get("error", {}).get("message", pin.text)[:160])
                )
                pinned.append(sid)  # the session over the quota: tried again below
                break
            pinned.append(sid)
    return pinned


def pin_churn(url: str, stop: threading.Event, load: Load, sessions: list[str]) -> None:
    """Renew A's pins, try the pin over the quota again, list A's sessions; in a loop."""

    def worker(offset: int) -> None:
        with client(url, KEY_A) as c:
            i = offset
            while not stop.is_set():
                sid = sessions[i % len(sessions)]
                try:
                    r = c.post(f"/v1/sessions/{sid}/pin", json={"pin_ttl_seconds": 900})
                    load.count(f"pin {r.status_code}")
                    if i % 5 == 0:
                        load.count(f"list {c.get('/v1/sessions').status_code}")
                except httpx.HTTPError as exc:
                    load.count(type(exc).__name__)
                i += 1

    _run_threads([lambda: worker(0), lambda: worker(1)], stop)


def pin_cleanup(url: str, sessions: list[str]) -> None:
    with client(url, KEY_A) as c:
        for sid in sessions:
            c.delete(f"/v1/sessions/{sid}")


def long_generations(
    url: str, model: str, stop: threading.Event, load: Load, streams: int, tokens: int
) -> None:
    """``streams`` long generations at once, each re-sent as it ends, until ``stop``."""
    load.note = f"{streams} streams of {tokens} tokens (of {MAX_NUM_SEQS} sequences)"

    def stream(n: int) -> None:
        prompt = " ".join(f"Tenant A story {n}, part {j}." for j in range(20))
        body = {
            "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "session_id": f"a-gen-{n}",
        }  # fmt: skip
        with client(url, KEY_A) as c:
            while not stop.is_set():
                try:
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        for _ in r.iter_lines():
                            if stop.is_set():
                                break  # closing the stream aborts the request
                    load.count(r.status_code)
                except httpx.HTTPError as exc:
                    load.count(type(exc).__name__)

    _run_threads([lambda n=n: stream(n) for n in range(streams)], stop)


def _run_threads(targets: list[Callable[[], None]], stop: threading.Event) -> None:
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(timeout=60)


# --------------------------------------------------------------------------- phases
