"""What the server writes into a generation request's JSON body, and what it refuses there.

:class:`server.api.chat.SessionRequestMiddleware` reads the body, then :func:`rewrite_body`
names the session and the tenant in ``vllm_xargs`` (where vLLM copies them into
``SamplingParams.extra_args`` for the connector) and salts keyed tenants' KV;
:func:`check_responses_body` refuses what the Responses API would store. Plain functions on a
parsed body: no I/O, no vLLM.
"""

from __future__ import annotations

from typing import Any

from langgraph_kvcache.contract import (
    REUSE_EXACT,
    REUSE_MODES,
    REUSE_SHIFTED,
    XARG_OP,
    XARG_REUSE,
    XARG_SESSION,
    XARG_TENANT,
)
from server.api.protocol import APIError, check_session_id

__all__ = [
    "RESPONSES_PATH",
    "SALT_PREFIX",
    "SERVER_OWNED_FIELDS",
    "SERVER_OWNED_XARGS",
    "SHIFTED_SALT_PREFIX",
    "check_responses_body",
    "rewrite_body",
]

SALT_PREFIX = "lgkv-"
"""``cache_salt`` of a keyed tenant's requests: ``lgkv-<tenant>``."""
SHIFTED_SALT_PREFIX = "lgkvs-"
"""``cache_salt`` of requests with shifted reuse: ``lgkvs-<tenant>`` (keyed or not)."""
RESPONSES_PATH = "/v1/responses"
SERVER_OWNED_FIELDS = ("kv_transfer_params",)
"""Body fields only the server sets; a request that sends one gets 400."""
SERVER_OWNED_XARGS = (XARG_OP, "kv_transfer_params")
"""``vllm_xargs`` keys only the server sets (vLLM copies ``vllm_xargs`` into
``SamplingParams.extra_args``, where the connector reads its control ops and vLLM its transfer
parameters); a request that sends one gets 400."""


def check_responses_body(body: dict[str, Any]) -> None:
    """400 for what this server does not keep for the Responses API: stored responses
    (``previous_response_id``; ``background``, which needs one). vLLM's store is one process's
    memory shared by every tenant; resend the conversation instead: its KV is cached, so
    resending costs little."""
    for field in ("previous_response_id", "background"):
        if body.get(field):
            raise APIError(
                400,
                f"{field} is not supported by this server (no stored responses): send the "
                "whole conversation as input with a prompt_cache_key; its KV is cached, so "
                "the history costs little",
            )


def rewrite_body(
    body: dict[str, Any], tenant: str, *, salted: bool, reuse: str = REUSE_EXACT
) -> dict[str, Any]:
    """Move the session named by ``prompt_cache_key``/``session_id``/``vllm_xargs.session_id``
    into ``vllm_xargs`` with the tenant, and salt the KV of keyed tenants.

    The tenant always comes from the caller's key (``vllm_xargs.tenant`` in the body is
    replaced). With ``salted`` the ``cache_salt`` is ``lgkv-<tenant>``, followed by
    ``|<client salt>`` when the body sends one: a client may partition its own KV further,
    never reach another tenant's. A request with shifted reuse (``vllm_xargs.lgkv_reuse``, else
    ``reuse``, the server's ``--kv-reuse``) always gets the salt ``lgkvs-<tenant>`` (then the
    client's): its approximate KV is never found by a request that did not ask for it.

    Raises:
        APIError: 400 when the names disagree, a session id is malformed, ``vllm_xargs`` is
            not an object, ``cache_salt`` is not a string, ``vllm_xargs.lgkv_reuse`` is not a
            known mode, or the body sets a field only the server sets
            (``kv_transfer_params``, and in ``vllm_xargs`` also ``lgkv_op``).
    """
    out = dict(body)
    for owned in SERVER_OWNED_FIELDS:
        if out.get(owned) is not None:
            raise APIError(400, f"{owned} is set by the server; remove it from the request")
    xargs = out.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    elif not isinstance(xargs, dict):
        raise APIError(400, "vllm_xargs must be a JSON object")
    xargs = dict(xargs)
    for owned in SERVER_OWNED_XARGS:
        if owned in xargs:
            raise APIError(400, f"vllm_xargs.{owned} is set by the server; remove it")
    named: dict[str, object] = {}
    for field in ("prompt_cache_key", "session_id"):
        value = out.pop(field, None)
        if value is not None:
            named[field] = value
    if xargs.get(XARG_SESSION) is not None:
        named[f"vllm_xargs.{XARG_SESSION}"] = xargs[XARG_SESSION]
    for field, value in named.items():
        check_session_id(value, field=field)
    if len(set(named.values())) > 1:
        listed = ", ".join(f"{k}={v!r}" for k, v in named.items())
        raise APIError(400, f"the request names two different sessions ({listed}); send one")
    if named:
        xargs[XARG_SESSION] = next(iter(named.values()))
    xargs[XARG_TENANT] = tenant
    mode = xargs.pop(XARG_REUSE, None) or reuse
    if mode not in REUSE_MODES:
        raise APIError(
            400, f"vllm_xargs.{XARG_REUSE} must be one of {', '.join(REUSE_MODES)}, got {mode!r}"
        )
    if mode == REUSE_SHIFTED:
        xargs[XARG_REUSE] = mode
    out["vllm_xargs"] = xargs
    if salted or mode == REUSE_SHIFTED:
        client_salt = out.pop("cache_salt", None)
        if client_salt is not None and not isinstance(client_salt, str):
            raise APIError(400, "cache_salt must be a string")
        salt = (SHIFTED_SALT_PREFIX if mode == REUSE_SHIFTED else SALT_PREFIX) + tenant
        out["cache_salt"] = f"{salt}|{client_salt}" if client_salt else salt
    return out
