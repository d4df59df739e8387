"""Compression of small stored values: list items (``checkpoint_items``) and checkpoint bodies.

An item is a few hundred bytes of msgpack (a chat message), a checkpoint body a few hundred
more (versions, field names): too small for PostgreSQL's TOAST to compress, and mostly names
that every row repeats. They are stored raw-deflate compressed (zlib) against a fixed preset
dictionary of checkpoint and LangChain message framing (:data:`ZDICT_V1`) when that saves at
least :data:`MIN_SAVING` bytes, else as they are; on the dialects of
:data:`COMPRESSED_DIALECTS` only.

Contract: the stored ``type`` of a compressed item is :data:`PREFIX` + the serde type, and
every stored type that starts with :data:`PREFIX` is compressed (a serde type that itself
starts with it is always stored compressed), so :func:`unpack` never guesses. Digests and the
savers' memory always use the uncompressed form, so compression changes neither which items
are shared nor what reads return. :data:`ZDICT_V1` is part of the storage format: never edit
it; a new dictionary needs a new prefix.
"""

from __future__ import annotations

import zlib

PREFIX = "z1:"
"""Stored type prefix of an item compressed with :data:`ZDICT_V1`."""

COMPRESSED_DIALECTS = frozenset({"postgresql"})
"""Dialects whose savers store new items and checkpoint bodies compressed. On PostgreSQL rows
are what a thread costs (values under 2 kB are never TOAST-compressed), and a compressed chat
message is 40% of its msgpack; on SQLite the file stays a few percent of a plain saver's
either way, and compressing costs a write 15-30 us per value (about a third of ``put_writes``).
Any saver reads both forms (:func:`unpack`), so a database may hold both."""

MIN_SAVING = 16
"""Compress only when it saves at least this many bytes."""

LEVEL = 6
"""zlib compression level."""

ZDICT_V1 = (
    b"\x88\xa1v\x04\xa2id\xc0\xa2ts\xd9 2026-01-01T00:00:00.000000+00:00\xaechannel_values"
    b"\x81\xa9__start__\xc0\xb0channel_versions\x82\xa9__start__\xbd0000000000000001.00000"
    b"0000000\xaabranch:to:\xbd0000000000000001.000000000000\xadversions_seen\x82\xa9__inp"
    b"ut__\x80\xa9__start__\x80\xadpending_sends\x90\xb0updated_channels\x91\xa8messages"
    b"\xadfinish_reason\xa4stop\xaatool_calls\xaamodel_name\xb2system_fingerprint\xabtoken"
    b"_usage\xb1completion_tokens\xadprompt_tokens\xactotal_tokens\xacinput_tokens\xadoutp"
    b"ut_tokens\xb3input_token_details\xb4output_token_details\xaacache_read\xa4args\xa8fu"
    b"nction\xa9arguments\xa9tool_call\xa8logprobs\xacservice_tier\xaemodel_provider\xad__"
    b"interrupt__\xae__pregel_tasks\xa8messages\xc7\xa9\x05\x94\xbclangchain_core.messages"
    b".tool\xabToolMessage\x89\xa7content\xa0\xb1additional_kwargs\x80\xb1response_metadat"
    b"a\x80\xa4type\xa4tool\xa4name\xc0\xa2id\xc0\xactool_call_id\xa0\xa8artifact\xc0\xa6s"
    b"tatus\xa7success\xb3model_validate_json\xc7\x88\x05\x94\xbelangchain_core.messages.s"
    b"ystem\xadSystemMessage\x86\xa7content\xa0\xb1additional_kwargs\x80\xb1response_metad"
    b"ata\x80\xa4type\xa6system\xa4name\xc0\xa2id\xc0\xb3model_validate_json\xc7\x85\x05"
    b"\x94\xbdlangchain_core.messages.human\xacHumanMessage\x86\xa7content\xa0\xb1addition"
    b"al_kwargs\x80\xb1response_metadata\x80\xa4type\xa5human\xa4name\xc0\xa2id\xc0\xb3mod"
    b"el_validate_json\xc7\xac\x05\x94\xbalangchain_core.messages.ai\xa9AIMessage\x89\xa7c"
    b"ontent\xa0\xb1additional_kwargs\x80\xb1response_metadata\x80\xa4type\xa2ai\xa4name"
    b"\xc0\xa2id\xc0\xaatool_calls\x90\xb2invalid_tool_calls\x90\xaeusage_metadata\xc0\xb3"
    b"model_validate_json"
)
"""Preset deflate dictionary (frozen bytes): msgpack of a checkpoint body's framing, of common
chat-message keys and of empty LangChain ``ToolMessage``, ``SystemMessage``, ``HumanMessage``
and ``AIMessage``."""


def pack(serde_type: str, data: bytes, compressed: bool = True) -> tuple[str, bytes]:
    """The (type, bytes) to store for an item serialized as (``serde_type``, ``data``);
    ``compressed=False`` stores it as it is (unless its type needs the prefix)."""
    forced = serde_type.startswith(PREFIX)
    if (compressed and len(data) > MIN_SAVING) or forced:
        c = zlib.compressobj(LEVEL, zlib.DEFLATED, -15, zdict=ZDICT_V1)
        packed = c.compress(data) + c.flush()
        if forced or len(packed) + MIN_SAVING <= len(data):
            return PREFIX + serde_type, packed
    return serde_type, data


def unpack(stored_type: str, data: bytes) -> tuple[str, bytes]:
    """The serde (type, bytes) of an item stored as (``stored_type``, ``data``)."""
    if not stored_type.startswith(PREFIX):
        return stored_type, data
    d = zlib.decompressobj(-15, zdict=ZDICT_V1)
    out = d.decompress(data)
    return stored_type[len(PREFIX) :], out if d.eof else out + d.flush()
