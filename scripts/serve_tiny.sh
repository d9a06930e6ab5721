#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's main job: set up .venv (scripts/setup.sh), then serve the tiny
# DeepSeek-V4 (configs/tiny-dsv4, seeded dummy weights) through vLLM with this
# plugin on CPU at http://127.0.0.1:${PORT:-8000}/v1 (model name "tiny-dsv4").
# What is served is configs/serve/tiny-dsv4-cpu.yaml (FLASHMLA_SPARSE_DSV4, fp8
# KV cache, seeded dummy weights, eager, seed 0).
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

# The one tiny-server definition (also used by vllm-dsv4-run and the tests);
# its model path is relative to the repo root, where this script runs.
exec "$ROOT/.venv/bin/vllm" serve --config "$ROOT/configs/serve/tiny-dsv4-cpu.yaml" \
  --host 127.0.0.1 \
  --port "${PORT:-8000}" \
  "$@"
