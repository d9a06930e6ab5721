#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's test command: sets up .venv if anything is missing, then runs
# the whole suite (core, real-vLLM engine/server, lm_eval; GPU tests skip on CPU).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/core -k mxfp4`.
# Without arguments it then runs tests/core again with `import vllm` blocked
# (vllm_dsv4_backend/testing/no_vllm.py), the proof that core is torch-only,
# tests/cuda in the vLLM 0.33 and 0.34 venvs, and the lifetime mutation suite;
# the script fails if any run fails (the first run's exit code wins). The main run
# prints its 25 slowest tests (--durations): a measurement for the CI time budget, never
# a check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -ra "$@"
fi
rc=0
.venv/bin/python -m pytest -ra --durations=25 tests || rc=$?
core_rc=0
echo "== tests/core again with import vllm blocked (DSV4_CORE_NO_VLLM=1)"
DSV4_CORE_NO_VLLM=1 .venv/bin/python -m pytest -ra -p vllm_dsv4_backend.testing.no_vllm tests/core \
  || core_rc=$?
# tests/cuda: vLLM 0.33's and 0.34's real CUDA classes imported on CPU, each in
# its own venv (.venv-vllm033 / .venv-vllm034, built when missing by
# scripts/setup_vllm_cuda.sh; no CUDA kernel runs).
cuda_rc=0
for minor in 0.33 0.34; do
  echo "== tests/cuda in .venv-vllm${minor/./} (vLLM $minor.0 --no-deps on a CPU torch)"
  bash scripts/setup_vllm_cuda.sh "$minor" \
    && ".venv-vllm${minor/./}/bin/python" -m pytest -ra tests/cuda || cuda_rc=$?
done
# Lifetime mutants of the CUDA layer and the workspace (tools/mutants/mutants.py): each
# applied to a copy of the tree, each must turn a check red; prints the mutation score.
mut_rc=0
echo "== lifetime mutants (tools/mutants/run.py)"
.venv/bin/python tools/mutants/run.py || mut_rc=$?
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
if [ "$core_rc" -ne 0 ]; then exit "$core_rc"; fi
if [ "$cuda_rc" -ne 0 ]; then exit "$cuda_rc"; fi
exit "$mut_rc"
