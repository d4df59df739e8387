"""A database as the release before migration 7 left it, frozen as data.

``data/layout6.json`` holds the rows that release's savers wrote (tables ``checkpoints``,
``checkpoint_blobs``, ``checkpoint_items``, ``checkpoint_writes``, as migrations 1 to 6 made
them) for a few real graph threads, and what each thread read back then: every checkpoint
tuple of ``list()`` and a ``DeltaChannel`` history, serialized with ``JsonPlusSerializer``. A
test loads the rows into a database set up with the first six migrations only, runs
``setup()`` and checks that everything reads back equal, whatever layout later releases write.

The rows are frozen on purpose: regenerate them (``python tests/checkpoint/old_layout.py``)
only from a commit whose write path is that release's (before any change of the stored layout),
never after, or the test stops testing an upgrade.
"""

from __future__ import annotations

import base64
import json
import tempfile
from pathlib import Path
from typing import Any

from langchain_core.messages import HumanMessage
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.types import Command
from sqlalchemy import Connection, text

FIXTURE = Path(__file__).with_name("data") / "layout6.json"
PREVIOUS = 6
"""Migrations the release that wrote the rows had run."""

TABLES: dict[str, tuple[str, ...]] = {
    "checkpoints": (
        "thread_id",
        "checkpoint_ns",
        "checkpoint_id",
        "parent_checkpoint_id",
        "run_id",
        "type",
        "checkpoint",
        "metadata",
        "blob_versions",
    ),
    "checkpoint_blobs": (
        "thread_id",
        "checkpoint_ns",
        "channel",
        "version",
        "type",
        "blob",
        "base_version",
        "since_snapshot",
    ),
    "checkpoint_items": ("thread_id", "checkpoint_ns", "item", "type", "blob"),
    "checkpoint_writes": (
        "thread_id",
        "checkpoint_ns",
        "checkpoint_id",
        "task_id",
        "idx",
        "task_path",
        "channel",
        "type",
        "blob",
    ),
}
"""Each table's columns as the sixth migration left them (written out, not taken from the saver's
statements, which follow the current layout)."""
JSON_COLUMNS = {"metadata", "blob_versions"}
THREADS = ("chat", "sub", "delta")
DELTA_CHANNEL = "log"

_serde = JsonPlusSerializer()


def _encode(value: Any) -> Any:
    if isinstance(value, (bytes, memoryview)):
        return {"b64": base64.b64encode(bytes(value)).decode()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"b64"}:
        return base64.b64decode(value["b64"])
    return value


def dump_value(value: Any) -> str:
    """``value`` serialized as the fixture keeps expected results."""
    type_, data = _serde.dumps_typed(value)
    return json.dumps([type_, base64.b64encode(data).decode()])


def load_value(stored: str) -> Any:
    """A value kept with :func:`dump_value`."""
    type_, data = json.loads(stored)
    return _serde.loads_typed((type_, base64.b64decode(data)))


def normalized(value: Any) -> Any:
    """``value`` with tuples as lists (msgpack keeps no tuples), for comparing."""
    if isinstance(value, (list, tuple)):
        return [normalized(v) for v in value]
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()}
    return value


def tuple_value(found: Any) -> Any:
    """A ``CheckpointTuple`` as comparable plain data."""
    return normalized(found._asdict()) if found is not None else None


def insert_rows(conn: Connection, dialect: str, rows: dict[str, list[list[Any]]]) -> None:
    """Insert the fixture's rows with plain SQL (not :mod:`.schema`, which may change)."""
    for table, columns in TABLES.items():
        values = ", ".join(
            f"CAST(:{c} AS JSONB)" if c in JSON_COLUMNS and dialect == "postgresql" else f":{c}"
            for c in columns
        )
        stmt = text(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({values})")
        params = [{c: _decode(v) for c, v in zip(columns, row, strict=True)} for row in rows[table]]
        if params:
            conn.execute(stmt, params)


def _write_history(saver: Any) -> None:
    """The threads: an interrupting chat with a fork, a subgraph, a ``DeltaChannel`` log."""
    from checkpoint_graphs import approval_graph, delta_graph, subgraph_graph

    chat = approval_graph().compile(checkpointer=saver)
    config: Any = {"configurable": {"thread_id": "chat"}}
    for i in range(3):
        chat.invoke({"messages": [HumanMessage(f"question {i}")]}, config)
        chat.invoke(Command(resume=f"answer {i}"), config)
    older = list(saver.list(config))[5].config
    chat.update_state(older, {"messages": [HumanMessage("a fork")]})
    sub = subgraph_graph().compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "sub"}}
    sub.invoke({"messages": [HumanMessage("hello")]}, config)
    sub.invoke(Command(resume="yes"), config)
    log = delta_graph().compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "delta"}}
    for _ in range(5):
        log.invoke({"log": []}, config)


def capture() -> dict[str, Any]:
    """Write the threads with this checkout's saver on a fresh SQLite file and read them back."""
    from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver

    with tempfile.TemporaryDirectory() as tmp:
        with SQLAlchemySaver.from_conn_string(f"sqlite:///{tmp}/old.db") as saver:
            saver.setup()
            _write_history(saver)
        with SQLAlchemySaver.from_conn_string(f"sqlite:///{tmp}/old.db") as saver:
            expected = {
                thread: [dump_value(tuple_value(t)) for t in saver.list(_config(thread))]
                for thread in THREADS
            }
            history = saver.get_delta_channel_history(
                config=_config("delta"), channels=[DELTA_CHANNEL]
            )
            with saver.engine.connect() as conn:
                rows = {
                    table: [
                        [_encode(v) for v in row]
                        for row in conn.execute(text(f"SELECT {', '.join(cols)} FROM {table}"))
                    ]
                    for table, cols in TABLES.items()
                }
    return {
        "rows": rows,
        "expected": expected,
        "delta_history": dump_value(normalized(dict(history))),
    }


def _config(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id}}


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(capture(), indent=0) + "\n")
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
