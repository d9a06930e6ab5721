#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Usage: bash scripts/setup_vllm_cuda.sh 0.33|0.34
#
# Builds .venv-vllm0XY: the REAL vLLM 0.XY.0 (the CUDA wheel, installed with
# --no-deps) on a CPU torch, plus the pure-Python modules its DeepSeek-V4 import
# chain loads (scripts/vllm0XY-cpu-pins.txt), this project (editable, --no-deps)
# and pytest. tests/cuda/ runs in each: that vLLM's own classes imported on CPU.
#
# Nothing here runs a CUDA kernel: vLLM's compiled extensions are never loaded
# (FlashMLA's import fails on a machine without libcuda and vLLM then installs
# its RuntimeError stubs), and the CPU torch has no CUDA at all.
#
# torch: the CPU build 2.13.0+cpu (the same one .venv runs; this machine has
# it in its local wheel directory). Where it cannot be had, the exact pin of
# the 0.33 / 0.34 wheels, torch==2.14.0 from PyPI, with its CUDA runtime wheels
# (larger, still never runs a kernel: torch.cuda.is_available() is False).
# Override with DSV4_VLLM_CUDA_TORCH="torch==X".
#
# Idempotent: a stamp keyed on this script, the pins and pyproject.toml skips
# the work when nothing changed. Prints the time it took.
set -euo pipefail
cd "$(dirname "$0")/.."
MINOR=${1:?usage: setup_vllm_cuda.sh 0.33|0.34}
case "$MINOR" in
  0.33|0.34) ;;
  *) echo "setup_vllm_cuda.sh: vLLM $MINOR: supported 0.33, 0.34" >&2; exit 2 ;;
esac
TAG=${MINOR/./}
ROOT=$(pwd)
VENV=$ROOT/.venv-vllm$TAG
PY=${PYTHON:-python3}
PINS=scripts/vllm$TAG-cpu-pins.txt
STAMP=$VENV/.dsv4-setup-stamp
L="[setup-$MINOR]"

probe="import vllm, torch, vllm_dsv4_backend, pytest
assert vllm.__version__.startswith('$MINOR.'), vllm.__version__
import vllm.models.deepseek_v4.nvidia.model"

source scripts/setup_stamp.sh
setup_begin "$L" scripts/setup_vllm_cuda.sh "$PINS" pyproject.toml -- \
  env VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "$probe"
PIP_CMD="$VENV/bin/python -m pip --disable-pip-version-check"
# pip, without the per-package notes about this machine's local index folders.
PIP() {
  $PIP_CMD "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

echo "$L installing the pinned pure-Python import chain ($(grep -c . "$PINS") packages)"
PIP install -q --no-deps -r "$PINS"

if [ -n "${DSV4_VLLM_CUDA_TORCH:-}" ]; then
  echo "$L installing ${DSV4_VLLM_CUDA_TORCH} (from DSV4_VLLM_CUDA_TORCH)"
  PIP install -q "${DSV4_VLLM_CUDA_TORCH}" -c "$PINS"
elif PIP install -q --no-deps "torch==2.13.0+cpu" 2>/dev/null; then
  echo "$L installed torch 2.13.0+cpu"
else
  echo "$L torch 2.13.0+cpu not available here; installing torch==2.14.0 from PyPI (with its CUDA runtime wheels, ~4 GB)"
  PIP install -q "torch==2.14.0" -c "$PINS"
fi
# torch declares fsspec (imported lazily by a few torch modules); tiny, pure Python.
PIP install -q --no-deps fsspec

echo "$L installing vllm==$MINOR.0 --no-deps (the CUDA wheel; its CUDA deps are NOT installed)"
PIP install -q --no-deps "vllm==$MINOR.0"

echo "$L installing vllm-dsv4-backend (editable, --no-deps) and pytest"
PIP install -q --no-deps -e .
PIP install -q "pytest>=8" -c "$PINS"

VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "$probe
print('$L vllm', vllm.__version__, '| torch', torch.__version__,
      '| cuda available:', torch.cuda.is_available())"
setup_end "$L"
