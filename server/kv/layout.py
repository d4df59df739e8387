"""The KV layout vLLM hands the connector: whether the connector can serve it, and its manifest.

Both roles derive the same :class:`Manifest` from vLLM's config alone, so the scheduler side and
every worker agree on block size, layers and bytes without talking. Before that,
:func:`why_no_reuse` says whether reusing stored KV can be correct at all: where vLLM itself
disabled prefix caching (MLA on CPU, or ``--no-enable-prefix-caching``), or the KV layout is
one the connector does not know, a loaded block could be read wrongly, so the connector keeps
and offers nothing (a miss is slower, never wrong).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.kv.settings import ConnectorSettings
from server.kv.tiers.manifest import Manifest
from server.kv.weights import weights_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

SERVED_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec"})
"""vLLM KV cache spec classes (exact types) whose blocks the connector saves and loads whole:
paged attention K/V (or MLA's latent) of ``page_size_bytes`` per block and layer."""


CONNECTOR = "SessionKVConnector"
HYBRID_CONNECTOR = "HybridSessionKVConnector"
"""The connector's two classes (module ``server.kv.connector``): vLLM runs models with
recurrent-state layers (Mamba, linear attention next to attention) only with its hybrid KV
cache manager, which it keeps on only for a connector that declares ``SupportsHMA``."""
CONNECTOR_MODULE = "server.kv.connector"
"""The module vLLM imports the connector class from."""


def transfer_config(extra: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    """vLLM's KV transfer config selecting the session connector (the server's
    ``--kv-transfer-config``, and ``KVTransferConfig(**...)`` for offline engines): both roles
    in every process, ``extra`` as ``kv_connector_extra_config`` (keys: docs/configuration.md),
    the class :func:`connector_class_for` picks for ``model`` (without one, the plain class)."""
    return {
        "kv_connector": connector_class_for(model) if model else CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def connector_class_for(model: str) -> str:
    """The connector class to load for ``model`` (a local folder): :data:`HYBRID_CONNECTOR`
    where vLLM keeps several KV cache groups only for a connector that declares
    ``SupportsHMA``: an architecture vLLM's model registry says keeps a recurrent state
    (Qwen3-Next, Granite 4 hybrids, Jamba, Nemotron-H...: without the hybrid manager it does
    not start), or one whose config mixes sliding-window and global attention layers (Gemma
    2/3, gpt-oss, Cohere 2: the hybrid manager gives sliding layers only their window's
    blocks). :data:`CONNECTOR` otherwise, and for a folder without ``config.json`` (vLLM
    reports an unknown architecture itself)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        archs = config.get("architectures")
    except (OSError, ValueError, AttributeError):
        return CONNECTOR
    if _mixed_attention(config):
        return HYBRID_CONNECTOR
    from vllm.model_executor.models.registry import ModelRegistry

    for arch in archs or ():
        entry = ModelRegistry.models.get(arch)
        if entry is not None:
            info = entry.inspect_model_cls()
            return HYBRID_CONNECTOR if info.is_hybrid or info.has_inner_state else CONNECTOR
    return CONNECTOR


_INTERLEAVED_SLIDING = frozenset({"gemma2", "gemma3", "gemma3_text", "cohere2"})
"""``model_type`` values whose layers interleave sliding-window and global attention even
where the config lists no ``layer_types`` (older Gemma 2/3 and Cohere 2 configs)."""


def _mixed_attention(config: dict[str, Any]) -> bool:
    """True when the config (or its ``text_config``) has sliding-window and global attention
    layers side by side."""
    text = config.get("text_config")
    if isinstance(text, dict) and _mixed_attention(text):
        return True
    kinds = set(config.get("layer_types") or ())
    if "sliding_attention" in kinds and kinds - {"sliding_attention"}:
        return True
    return config.get("model_type") in _INTERLEAVED_SLIDING


def why_no_reuse(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str | None:
    """Why the connector must offer no stored KV for this engine, or None when it can.

    Several KV cache groups are served when every group is paged attention of one block size
    and one group holds every block (full attention or MLA, not a sliding window): a stored
    block then has every layer at its positions, and a sliding-window group's skipped blocks
    are vLLM's null block (:mod:`server.kv.groups`)."""
    if not vllm_config.cache_config.enable_prefix_caching:
        mla = vllm_config.model_config is not None and vllm_config.model_config.use_mla
        return (
            "vLLM disabled prefix caching for this model"
            + (" (MLA on this platform: vLLM cannot resume it from cached tokens)" if mla else "")
            + ", so a stored prefix could not be resumed correctly"
        )
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    other = next((k for k in kinds if k not in SERVED_SPECS), None)
    if other is not None:
        return f"its KV cache layout ({other}) is not one it can save and load"
    if len(groups) > 1:
        if len({int(g.kv_cache_spec.block_size) for g in groups}) != 1:
            return "its KV cache groups have different block sizes"
        if all(k == "SlidingWindowSpec" for k in kinds):
            return f"none of its {len(groups)} KV cache groups holds every block"
    return None


def build_manifest(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
) -> Manifest:
    """The layout both sides agree on, derived from vLLM's KV cache config alone (the spec
    describes one rank's shard: vLLM divides the KV heads between tensor-parallel ranks). Of
    several groups of paged attention, every layer of every group, group by group (the
    manifest records each layer's group); where :func:`why_no_reuse` turned the tiers off, the
    first group of a served kind, else the first (a recurrent state's spec has no one dtype)."""
    groups = kv_cache_config.kv_cache_groups
    served = [type(g.kv_cache_spec).__name__ in SERVED_SPECS for g in groups]
    group = groups[served.index(True)] if any(served) else groups[0]
    spec = group.kv_cache_spec
    layers = tuple(group.layer_names)
    layer_groups: tuple[int, ...] = ()
    if len(groups) > 1 and all(served):
        layers = tuple(name for g in groups for name in g.layer_names)
        layer_groups = tuple(i for i, g in enumerate(groups) for _ in g.layer_names)
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    return Manifest(
        model_id=settings.model_id or str(vllm_config.model_config.model),
        weights=weights_fingerprint(
            str(vllm_config.model_config.model), vllm_config.model_config.revision
        ),
        dtype=str(getattr(spec, "dtype", None) or getattr(spec, "dtypes", ("none",))[0]),
        block_size=int(spec.block_size),
        layers=layers,
        layer_block_bytes=tuple(int(spec.page_size_bytes) for _ in layers),
        groups=layer_groups,
        hash_scheme=f"{algo}:{hashlib.sha256(seed.encode()).hexdigest()[:16]}",
        offload_dtype=settings.offload_dtype,
        kv_heads=int(getattr(spec, "num_kv_heads", 1)),  # where int8/fp8 scales go
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
    )
