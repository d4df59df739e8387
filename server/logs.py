"""Our log lines in vLLM's format, in every process the server starts.

vLLM configures one logger, ``vllm``, in each of its processes (the API process, the engine
core, the executor's workers): level from ``VLLM_LOGGING_LEVEL``, a handler with vLLM's format
(``(EngineCore pid=123) INFO 12-01 10:00:00 [connector.py:42] ...``). Loggers of other
packages have no handler there, so Python's last-resort handler printed our warnings bare and
dropped our INFO lines. :func:`use_vllm_logging` hands vLLM's handlers and level to our loggers
in the calling process; the API process calls it before the engine starts and the connector
calls it in each engine process. With ``VLLM_CONFIGURE_LOGGING=0``, a logging config of your
own (``VLLM_LOGGING_CONFIG_PATH`` that configures ``server``), or handlers on the root logger
(a process that embeds the engine and configured logging) it changes nothing.
"""

from __future__ import annotations

import logging

OUR_LOGGERS = ("server", "langgraph_kvcache")
"""Top-level loggers of this project."""


def use_vllm_logging(names: tuple[str, ...] = OUR_LOGGERS) -> None:
    """Give ``names`` vLLM's handlers and level in this process (idempotent, cheap)."""
    import vllm.logger  # noqa: F401  (configures the ``vllm`` logger on first import)

    source = logging.getLogger("vllm")
    if not source.handlers or logging.getLogger().handlers:
        # vLLM's logging is off, or the host process configured logging itself (an app that
        # embeds the engine, pytest): ours propagate to its handlers as configured there.
        return
    for name in names:
        logger = logging.getLogger(name)
        if logger.handlers:
            continue  # configured already (by an earlier call or the user's config)
        for handler in source.handlers:
            logger.addHandler(handler)
        logger.setLevel(source.level)
        logger.propagate = False
