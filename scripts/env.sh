# SPDX-License-Identifier: Apache-2.0
# Sourced by the scripts: offline, CPU-sized defaults, and scratch space inside
# the repo so engine starts do not litter the system temp dir with IPC sockets.
_dsv4_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export DSV4_SCRATCH=${DSV4_SCRATCH:-$_dsv4_root/.scratch}
mkdir -p "$DSV4_SCRATCH/tmp" "$DSV4_SCRATCH/cache/vllm"
export TMPDIR=${TMPDIR_OVERRIDE:-$DSV4_SCRATCH/tmp}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$DSV4_SCRATCH/cache/vllm}
export PATH="$_dsv4_root/.venv/bin:$PATH"
