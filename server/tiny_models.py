"""Tiny random-weight models of other architectures than Llama, for tests and benchmarks.

Each is a 2-layer model with SmolLM2's tokenizer and chat template, saved in float32 with
weights drawn at a standard deviation of 0.1 (``initializer_range``): large enough that the
generated text depends on the context, so a wrong KV shows up as different tokens. (vLLM's
``--load-format dummy`` gives text that ignores the context: never prove reuse with it.)

``python -m server.tiny_models ARCH [--out DIR]`` builds one; :data:`ARCHS` lists them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from server.model import _atomic_folder, _ensure_chat_template, default_cache_dir

STD = 0.1
"""Standard deviation of the random weights."""

_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 4096,
    "initializer_range": STD,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # MLA: one latent vector (kv_lora_rank + rope dims) per token, no heads; dense MLPs.
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 512,  # latent 512 + rope 64 = 576: what the CPU MLA kernel takes
            "q_lora_rank": None,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64,
            "v_head_dim": 32,
            "head_dim": 32,
            "first_k_dense_replace": 2,  # both layers dense (the experts are never built)
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "tie_word_embeddings": False,  # vLLM's DeepseekV2 reads its own lm_head
        },
    ),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 32}),
    # Every layer a 256-token sliding window (one KV cache group: vLLM turns its hybrid
    # manager off for the plain connector class and allocates such layers at full length).
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "head_dim": 32, "sliding_window": 256}),
    # Mixture of experts: 4 experts, 2 per token.
    "mixtral": (
        "MixtralConfig",
        {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # Sliding-window and global attention layers side by side (Gemma 3's pattern): with the
    # hybrid KV cache manager they are two KV cache groups, the sliding one holding only the
    # blocks inside its 256-token window.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "num_key_value_heads": 2,
            "head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 256,
            # its own output head: Gemma scales the input embeddings by sqrt(hidden_size), so
            # with tied ones every step would repeat its input token
            "tie_word_embeddings": False,
            # long enough for benchmarks/models.py to show the window's memory saving
            "max_position_embeddings": 32768,
        },
    ),
    # Hybrids that need vLLM's hybrid KV cache manager (several KV cache groups): a Mamba-2
    # layer and an attention layer; a gated-delta-net (linear attention) layer and a full one.
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            "num_key_value_heads": 2,
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 8,
            "mamba_d_head": 32,  # 8 x 32 = mamba_expand (2) x hidden_size
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "num_local_experts": 4,
            "shared_intermediate_size": 256,
        },
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            "num_key_value_heads": 2,
            "head_dim": 32,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        },
    ),
}
"""Architecture name -> (transformers config class, settings beyond :data:`_COMMON`)."""


def _ready(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "lgkv_tiny.json").is_file()


def build_tiny_arch(arch: str, tokenizer_from: Path, out: Path | None = None) -> Path:
    """Build (once) the tiny ``arch`` model into ``out`` (default: the user cache)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHS)}")
    out = Path(out) if out else default_cache_dir() / "models" / f"tiny-{arch}"
    if _ready(out):
        return out

    def build(tmp: Path) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_from)
        class_name, extra = ARCHS[arch]
        config = getattr(transformers, class_name)(
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            **{**_COMMON, **extra},
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
        with torch.no_grad():  # every weight matrix at STD, norms left at one
            for name, param in model.named_parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, STD)
                elif "norm" not in name:
                    param.zero_()
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _ensure_chat_template(tmp, tok)
        (tmp / "lgkv_tiny.json").write_text(
            json.dumps({"random_weights": True, "seed": 0, "arch": arch, "std": STD})
        )

    return _atomic_folder(out, build, _ready)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.tiny_models", description=__doc__)
    p.add_argument("arch", choices=sorted(ARCHS))
    p.add_argument("--out", type=Path, default=None, help="target folder")
    args = p.parse_args(argv)
    from server.model import build_default_model

    print(build_tiny_arch(args.arch, build_default_model(), args.out))


if __name__ == "__main__":
    main()
