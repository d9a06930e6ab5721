#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run a command as on an AVX2-only CPU (see scripts/avx2_emulation/sitecustomize.py):
# vLLM's AVX2 kernel library, the plugin's torch fallbacks for the DeepSeek-V4 C++ ops,
# torch/oneDNN/MKL capped at AVX2. On an AVX512-BF16/AMX machine this is how the AVX2
# half of the suite and the AVX2 benchmark figures are produced, e.g.
#   bash scripts/as_avx2.sh bash scripts/test.sh
#   bash scripts/as_avx2.sh .venv/bin/vllm-dsv4-bench layer-ab
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$here/avx2_emulation${PYTHONPATH:+:$PYTHONPATH}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
exec "$@"
