"""A fingerprint of a model's weights, so KV saved with other weights is never reused.

The disk manifest and the Redis key prefix name the model, its dtype and its KV layout. A
retrained checkpoint put in place of the old one (same folder, same ``config.json``) has all
of those unchanged and different KV: without the weights in the key, the old blocks would be
loaded and the answers would be wrong. :func:`weights_fingerprint` is cheap enough to run at
every start: file names and sizes, whole small files (``config.json``, ``*.index.json``),
safetensors headers and the first 4 KiB of every tensor (any retraining or merge changes
those), and 64 KiB samples at 16 offsets of other weight files. It reads a few MiB, however
large the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
"""Files that hold weights."""
WHOLE_FILES = ("config.json",)
"""Small files hashed whole (besides ``*.index.json``)."""
_TENSOR_SAMPLE = 4096
_FILE_SAMPLES = 16
_FILE_SAMPLE = 64 << 10


def weights_fingerprint(model: str, revision: str | None = None) -> str:
    """16 hex chars that change when the weights (or ``config.json``) of ``model`` change.

    ``model`` is a local folder, a single weight file, or a Hugging Face id (looked up in the
    local hub cache; when it is not there the fingerprint is its name and revision).
    """
    target = _local_path(model, revision)
    digest = hashlib.sha256()
    if target is None:
        digest.update(f"name:{model}@{revision}".encode())
        return digest.hexdigest()[:16]
    files = [target] if target.is_file() else sorted(p for p in target.iterdir() if _hashed(p))
    for path in files:
        try:
            digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
            _hash_file(path, digest)
        except OSError as e:  # unreadable: the name and a marker still change the print
            log.warning("cannot read %s for the weights fingerprint: %s", path, e)
            digest.update(b"unreadable\n")
    return digest.hexdigest()[:16]


def _hashed(path: Path) -> bool:
    name = path.name
    return path.is_file() and (
        name.endswith(WEIGHT_SUFFIXES) or name in WHOLE_FILES or name.endswith(".index.json")
    )


def _local_path(model: str, revision: str | None) -> Path | None:
    path = Path(model).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, or not downloaded: fall back to the name
        return None


def _hash_file(path: Path, digest: hashlib._Hash) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if path.name.endswith(".json"):
            digest.update(f.read())
        elif path.name.endswith(".safetensors") and _hash_safetensors(f, size, digest):
            return
        else:
            step = max(1, size // _FILE_SAMPLES)
            for i in range(_FILE_SAMPLES):
                f.seek(min(i * step, max(0, size - _FILE_SAMPLE)))
                digest.update(f.read(_FILE_SAMPLE))


def _hash_safetensors(f, size: int, digest: hashlib._Hash) -> bool:  # type: ignore[no-untyped-def]
    """Header plus the first bytes of every tensor; False if the header is not safetensors."""
    head = f.read(8)
    if len(head) != 8:
        return False
    (length,) = struct.unpack("<Q", head)
    if length > min(size - 8, 100 << 20):
        return False
    raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        return False
    digest.update(raw)
    base = 8 + length
    for name in sorted(k for k in header if k != "__metadata__"):
        begin, end = header[name].get("data_offsets", (0, 0))
        f.seek(base + int(begin))
        digest.update(f.read(min(_TENSOR_SAMPLE, int(end) - int(begin))))
    return True
