"""The KV session lifecycle of a saver given ``kv_server=``: the thread <-> session keeper.

- :mod:`.sync`, :mod:`.aio`: ``ThreadSessions`` / ``AsyncThreadSessions``, the keepers the
  savers build (what they do is in :mod:`.sync`);
- :mod:`.keeper`: their logic, written once (in-transaction operations and steps);
- :mod:`.steps`: the steps' kinds (SQL, session API request) and their sync and async drivers;
- :mod:`.options`: ``KVSessionOptions`` (what ``kv_server=`` becomes) and the per-process tracker;
- :mod:`.pins`: run-scoped pins;
- :mod:`.store`: the ``checkpoint_kv_sessions`` and ``checkpoint_kv_outbox`` tables.

Imported by the savers only when they need it; importing this package imports nothing.
"""
