"""The FastAPI application: vLLM's own OpenAI app plus the session API and request rewrite.

:func:`create_app` builds vLLM's app (``vllm.entrypoints.launchers.app.build_app``: chat
templates, streaming, tool calls, ``/v1/models``, ``/health``, ``/metrics``...) from the
namespace of :func:`server.engine.build_vllm_args`, adds

* :class:`server.api.chat.SessionRequestMiddleware` (body cap, session/tenant rewrite, the
  ``X-LGKV-Replica`` response header),
* the session API router (:mod:`server.api.sessions`),
* our KV metrics on ``/metrics``,

and wraps vLLM's lifespan with one that starts the engine, runs vLLM's ``init_app_state`` and
opens :class:`server.kv.registry.control.SessionControl` and the child process that checks
large bodies (:class:`server.api.body_check.BodyChecker`). Nothing heavy happens before the lifespan
starts, so the app also runs in-process (``httpx.ASGITransport`` inside
``app.router.lifespan_context(app)``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from server.api.auth import KeyRing
from server.api.body_budget import BodyBudget, CallBudget
from server.api.body_check import BodyChecker
from server.api.chat import SessionRequestMiddleware
from server.api.metrics import SessionMetricsCollector
from server.api.protocol import APIError, api_error_handler, error_response
from server.api.routes import restrict_routes, served_summary
from server.api.sessions import router as sessions_router
from server.config import ServerConfig
from server.engine import build_vllm_args, start_engine

log = logging.getLogger(__name__)

SUPPORTED_TASK = "generate"


class UnsupportedModelError(RuntimeError):
    """The model cannot generate text (e.g. an embedding model)."""


def create_app(config: ServerConfig) -> FastAPI:
    """Build the server app for ``config``; the engine starts with the app's lifespan.

    Raises:
        server.config.ConfigError: a setting or a pass-through vLLM flag is invalid, or the
            model folder is missing (with the command that builds it).
    """
    from vllm.entrypoints.launchers.app import build_app

    args = build_vllm_args(config)
    app = build_app(args, supported_tasks=(SUPPORTED_TASK,), model_config=None)
    app.state.lgkv_config = config
    app.state.session_control = None
    # vLLM's engine-error handler stops the HTTP server through ``app.state.server``;
    # ``serve()`` puts the uvicorn server there, in-process use gets this stand-in.
    app.state.server = SimpleNamespace(should_exit=False)
    restrict_routes(app)
    app.include_router(sessions_router)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(404, _not_found)
    keys = KeyRing(config.api_keys, metrics_public=config.metrics_public)
    app.state.key_ring = keys
    # vLLM's SageMaker bootstrap builds the middleware stack early; nothing has been served
    # yet, so drop it and let Starlette rebuild it with our middleware outermost.
    app.middleware_stack = None
    app.add_middleware(
        SessionRequestMiddleware,
        max_body_bytes=config.max_body_bytes,
        keys=keys,
        replica=config.replica_name,
        body_budget=_body_budget(config),
        call_budget=_call_budget(config),
        reuse=config.kv_reuse,
    )
    vllm_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with start_engine(args, cache_dir=config.cache_dir) as engine:
            tasks = await engine.get_supported_tasks()
            if SUPPORTED_TASK not in tasks:
                raise UnsupportedModelError(
                    f"{args.model} supports {tasks}, not text generation; serve a chat model"
                )
            await _init_vllm_state(engine, app, args, tasks)
            control = _open_control(config, engine)
            app.state.generation_gate = _generation_gate(config, engine)
            checker = BodyChecker(
                int(engine.vllm_config.model_config.max_model_len), reuse=config.kv_reuse
            )
            checker.start()
            app.state.body_checker = checker
            app.state.lgkv_config = config
            app.state.session_control = control
            collector = _register_metrics(control)
            watchdog = asyncio.create_task(_watch_engine(engine, app.state.server))
            try:
                async with vllm_lifespan(app):
                    yield
            finally:
                watchdog.cancel()
                checker.close()  # later large bodies: a worker thread
                _unregister_metrics(collector)
                if control is not None:
                    control.close()

    app.router.lifespan_context = lifespan
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    """404 in the server's error shape; unknown paths name the routes that generate."""
    detail = getattr(exc, "detail", None)
    if isinstance(detail, str) and detail != "Not Found":  # a route's own 404 message
        return error_response(404, detail)
    return error_response(
        404,
        f"{request.method} {request.url.path} is not served here; generate with "
        f"{served_summary()} (other vLLM routes are refused: they would bypass tenant "
        "isolation)",
    )


async def _watch_engine(engine: Any, server: Any, every_s: float = 5.0) -> None:
    """Stop serving when the engine core died (as ``vllm serve``'s watchdog does), so a
    supervisor restarts the server instead of it answering 500 forever."""
    while True:
        await asyncio.sleep(every_s)
        if engine.errored and not engine.is_running:
            log.error("the vLLM engine died; shutting the server down")
            server.should_exit = True
            return


async def _init_vllm_state(engine: Any, app: FastAPI, args: Any, tasks: tuple[str, ...]) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state

    await init_app_state(engine, app.state, args, tasks)


def _body_budget(config: ServerConfig) -> BodyBudget | None:
    """With several keys, each key's large-body bytes per second (:mod:`server.api.body_budget`);
    None with one tenant or ``--tenant-body-rate 0``."""
    if len(config.api_keys) < 2 or config.tenant_body_rate <= 0:
        return None
    return BodyBudget(config.tenant_body_rate, config.max_body_bytes)


def _call_budget(config: ServerConfig) -> CallBudget | None:
    """With several keys, each key's session API calls per second; None with one tenant or
    ``--tenant-session-rate 0``."""
    if len(config.api_keys) < 2 or config.tenant_session_rate <= 0:
        return None
    return CallBudget(config.tenant_session_rate)


def _generation_gate(config: ServerConfig, engine: Any) -> Any:
    """With several keys, each key's share of vLLM's batch (:mod:`server.api.fair_share`);
    None with one tenant or ``--tenant-generation-share 1``."""
    from server.api.fair_share import GenerationGate

    if len(config.api_keys) < 2 or config.tenant_generation_share >= 1:
        return None
    batch = int(engine.vllm_config.scheduler_config.max_num_seqs)
    limit = max(1, int(batch * config.tenant_generation_share))
    log.info("each key may run %d of the batch's %d generations at once", limit, batch)
    return GenerationGate(limit, max_waiting=10 * limit)


def _open_control(config: ServerConfig, engine: Any) -> Any:
    if not config.kv_offload:
        log.info("KV offload is off (--no-kv-offload): the session API answers 503")
        return None
    from server.connector_config import redis_namespace
    from server.engine import resolve_model
    from server.kv.registry.control import SessionControl
    from server.kv.registry.quotas import TenantQuotas

    config.cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    quotas = TenantQuotas(
        max_sessions=config.tenant_max_sessions,
        pin_share=config.tenant_pin_share,
        max_unleased_pins=config.tenant_max_unleased_pins,
        max_pin_lease_s=float(config.max_pin_lease or 0),
        tier_bytes={"ram": config.kv_ram_bytes, "disk": config.kv_disk_bytes},
    )
    control = SessionControl(
        config.cache_dir,
        default_ttl_s=config.kv_session_ttl,
        engine_client=engine,
        redis_url=config.kv_redis_url,
        namespace=redis_namespace(config, resolve_model(config)[1]),
        quotas=quotas,
    )
    control.watch_drops()  # sessions in Redis: other replicas' deletes wake this engine
    return control


def _register_metrics(control: Any) -> SessionMetricsCollector | None:
    if control is None:
        return None
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    collector = SessionMetricsCollector(control.metrics)
    get_prometheus_registry().register(collector)
    return collector


def _unregister_metrics(collector: SessionMetricsCollector | None) -> None:
    if collector is None:
        return
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    with suppress(KeyError):
        get_prometheus_registry().unregister(collector)
