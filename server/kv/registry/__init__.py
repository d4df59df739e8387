"""The session registry (sessions, block lists, feeds, counters) and the API process's access to it.

- :mod:`.api`: its two interfaces, ``SessionStore`` (shared) and ``LocalState`` (this replica);
- :mod:`.sqlite` (``Registry``), :mod:`.sql`, :mod:`.local`: the SQLite registry (the default);
- :mod:`.redis`, :mod:`.lua`: sessions in Redis (``--kv-redis-url``);
- :mod:`.shared`: ``open_registry``, where the parts are composed;
- :mod:`.control`, :mod:`.drop_watch`: the API process's session control and its watch on the
  shared drops stream.

No torch, no vLLM at import. The engine's registry thread is on the scheduler side
(:mod:`server.kv.scheduler.registry_sync`).
"""

from server.kv.registry.sql import SessionRow, TierCount
from server.kv.registry.sqlite import Registry

__all__ = ["Registry", "SessionRow", "TierCount"]
