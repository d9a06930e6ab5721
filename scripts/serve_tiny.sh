#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's main job: set up .venv (scripts/setup.sh), then serve the tiny
# DeepSeek-V4 (configs/tiny-dsv4, seeded dummy weights) through vLLM with this
# plugin on CPU at http://127.0.0.1:${PORT:-8000}/v1 (model name "tiny-dsv4").
#
#   bash scripts/serve_tiny.sh                       # foreground; Ctrl-C stops it
#   PORT=8011 bash scripts/serve_tiny.sh --max-num-seqs 4   # extra args go to vllm serve
#
# Then e.g.:
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#     -d '{"model":"tiny-dsv4","prompt":"Hello","max_tokens":16,"temperature":0}'
#
# Environment: HF_HUB_OFFLINE=1 (no hub access), VLLM_CPU_KVCACHE_SPACE=1 (GiB
# of KV cache), and TMPDIR / VLLM_CACHE_ROOT under the ignored .scratch/ so
# engine starts do not leave IPC sockets and caches in the system dirs.
# VLLM_DSV4_ATTN_IMPL=vllm|plugin|auto picks the attention layer (see
# vllm_dsv4_backend/envs.py).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

bash scripts/setup.sh

export HF_HUB_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
SCRATCH=${DSV4_SCRATCH:-$ROOT/.scratch}
mkdir -p "$SCRATCH/tmp" "$SCRATCH/cache/vllm"
export TMPDIR=$SCRATCH/tmp
export VLLM_CACHE_ROOT=$SCRATCH/cache/vllm

exec "$ROOT/.venv/bin/vllm" serve "$ROOT/configs/tiny-dsv4" \
  --attention-backend FLASHMLA_SPARSE_DSV4 \
  --kv-cache-dtype fp8 \
  --load-format dummy \
  --tokenizer-mode hf \
  --max-model-len 4096 \
  --enforce-eager \
  --host 127.0.0.1 \
  --port "${PORT:-8000}" \
  --served-model-name tiny-dsv4 \
  --generation-config vllm \
  "$@"
