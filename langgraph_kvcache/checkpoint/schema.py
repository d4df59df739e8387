"""The checkpointer's tables, as SQLAlchemy 2.0 typed ORM classes.

The layout follows LangGraph's ``checkpoint-postgres``: one row per checkpoint, one row per
*version* of a channel value (so an unchanged channel is stored once, not once per checkpoint),
and one row per pending write; list channels store their items once each in their own table
(:mod:`.lists`). The same classes serve SQLite and PostgreSQL; JSON columns become
``JSONB`` on PostgreSQL so metadata filters use its containment operator.

The tables are created by the migrations in :mod:`langgraph_kvcache.checkpoint.migrations`,
never by ``Base.metadata.create_all``; this module is the typed view the queries use.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Index, Integer, LargeBinary, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

JsonType = JSON().with_variant(JSONB(), "postgresql")
"""JSON on SQLite, JSONB on PostgreSQL."""


class Base(DeclarativeBase):
    """Declarative base of the checkpointer's tables (kept apart from any user models)."""


class MigrationRow(Base):
    """One applied migration: its position in ``MIGRATIONS``."""

    __tablename__ = "checkpoint_migrations"

    v: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)


class CheckpointRow(Base):
    """One checkpoint of one thread and namespace.

    ``checkpoint`` holds the serialized checkpoint (serde ``type`` + bytes) with its large channel
    values taken out; those live in :class:`BlobRow`. Scalar values (``None``, str, int, float,
    bool) stay inline, as in the PostgreSQL saver. ``metadata`` is plain JSON so ``list(filter=)``
    can search it. ``run_id`` is copied out of the metadata for ``delete_for_runs``.
    ``blob_versions`` maps each channel kept in the blobs table to its version, so one query can
    join a checkpoint to its blobs (``json_each`` / ``jsonb_each_text``); those versions are
    not repeated in the body's ``channel_versions``.
    """

    __tablename__ = "checkpoints"

    thread_id: Mapped[str] = mapped_column(Text, primary_key=True)
    checkpoint_ns: Mapped[str] = mapped_column(Text, primary_key=True, server_default="")
    checkpoint_id: Mapped[str] = mapped_column(Text, primary_key=True)
    parent_checkpoint_id: Mapped[str | None] = mapped_column(Text)
    run_id: Mapped[str | None] = mapped_column(Text)
    type: Mapped[str] = mapped_column(Text)
    checkpoint: Mapped[bytes] = mapped_column(LargeBinary)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JsonType)
    blob_versions: Mapped[dict[str, Any]] = mapped_column(JsonType)

    __table_args__ = (
        Index(
            "checkpoints_run_id_idx",
            "run_id",
            sqlite_where=text("run_id IS NOT NULL"),
            postgresql_where=text("run_id IS NOT NULL"),
        ),
    )


class BlobRow(Base):
    """One version of one channel's value, shared by every checkpoint that has that version.

    A list version stored by items (``type`` ``lgkv.items``, see :mod:`.lists`) holds item
    digests: all of them (a snapshot, ``base_version`` NULL) or those appended to
    ``base_version`` (a delta, itself at most one link from a snapshot); ``since_snapshot``
    counts the versions since its chain's snapshot. Every other row holds the serialized
    value (both columns NULL).
    """

    __tablename__ = "checkpoint_blobs"

    thread_id: Mapped[str] = mapped_column(Text, primary_key=True)
    checkpoint_ns: Mapped[str] = mapped_column(Text, primary_key=True, server_default="")
    channel: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[str] = mapped_column(Text, primary_key=True)
    type: Mapped[str] = mapped_column(Text)
    blob: Mapped[bytes | None] = mapped_column(LargeBinary)
    base_version: Mapped[str | None] = mapped_column(Text)
    since_snapshot: Mapped[int | None] = mapped_column(Integer)


class ItemRow(Base):
    """One item of list channels, stored once per thread and namespace, keyed by the digest of
    its serialized form (:mod:`.lists`)."""

    __tablename__ = "checkpoint_items"

    thread_id: Mapped[str] = mapped_column(Text, primary_key=True)
    checkpoint_ns: Mapped[str] = mapped_column(Text, primary_key=True, server_default="")
    item: Mapped[bytes] = mapped_column(LargeBinary, primary_key=True)
    type: Mapped[str] = mapped_column(Text)
    blob: Mapped[bytes] = mapped_column(LargeBinary)


class WriteRow(Base):
    """One pending write of a task, attached to the checkpoint it was made against.

    ``idx`` is the write's position, or a negative index from ``WRITES_IDX_MAP`` for the
    special channels (errors, interrupts, resumes, scheduled), which are upserted.
    """

    __tablename__ = "checkpoint_writes"

    thread_id: Mapped[str] = mapped_column(Text, primary_key=True)
    checkpoint_ns: Mapped[str] = mapped_column(Text, primary_key=True, server_default="")
    checkpoint_id: Mapped[str] = mapped_column(Text, primary_key=True)
    task_id: Mapped[str] = mapped_column(Text, primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    task_path: Mapped[str] = mapped_column(Text, server_default="")
    channel: Mapped[str] = mapped_column(Text)
    type: Mapped[str | None] = mapped_column(Text)
    blob: Mapped[bytes] = mapped_column(LargeBinary)


checkpoints = CheckpointRow.__table__
blobs = BlobRow.__table__
items = ItemRow.__table__
writes = WriteRow.__table__
migrations_table = MigrationRow.__table__
