#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's test command: sets up .venv if anything is missing, then runs
# the whole suite (real-vLLM engine/server, lm_eval, safety case; GPU tests skip on CPU).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/core -k mxfp4`.
# Without arguments it runs, in order: every directory but tests/core; tests/core with
# `import vllm` blocked (vllm_dsv4_backend/testing/no_vllm.py: the proof that core is
# torch-only, and core's only run: with vLLM importable it runs the same tests);
# tests/cuda in the vLLM 0.33 and 0.34 venvs (built in the background during the main
# run), the two at once, one thread each (the CUDA-graph harness is one Python thread);
# the lifetime mutation suite, two mutants at once. The script fails if any run fails
# (the first run's exit code wins). The main run prints its 25 slowest tests
# (--durations): a measurement for the CI time budget, never a check. The slow,
# repeating variants are behind the switches of docs/usage.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -ra "$@"
fi
logs="$DSV4_SCRATCH/test-logs"
mkdir -p "$logs"
# tests/cuda: vLLM 0.33's and 0.34's real CUDA classes imported on CPU, each in
# its own venv (.venv-vllm033 / .venv-vllm034, built when missing by
# scripts/setup_vllm_cuda.sh; no CUDA kernel runs). The venvs are built in the
# background while the main run goes (mostly downloads and unpacking, at a low CPU
# priority: the main run's engines come first); both suites then run at once, and
# each prints when it is done.
( for minor in 0.33 0.34; do nice -n 15 bash scripts/setup_vllm_cuda.sh "$minor" || exit 1; done ) \
  > "$logs/setup-cuda.log" 2>&1 &
setup_pid=$!
rc=0
.venv/bin/python -m pytest -ra --durations=25 tests --ignore=tests/core || rc=$?
core_rc=0
echo "== tests/core with import vllm blocked (DSV4_CORE_NO_VLLM=1)"
DSV4_CORE_NO_VLLM=1 .venv/bin/python -m pytest -ra -p vllm_dsv4_backend.testing.no_vllm tests/core \
  || core_rc=$?
cuda_rc=0
echo "== the vLLM 0.33 and 0.34 venvs (built in the background; $logs/setup-cuda.log)"
wait "$setup_pid" || cuda_rc=$?
cat "$logs/setup-cuda.log"
pids=()
for minor in 0.33 0.34; do
  OMP_NUM_THREADS=1 ".venv-vllm${minor/./}/bin/python" -m pytest -ra tests/cuda \
    > "$logs/cuda-$minor.log" 2>&1 &
  pids+=("$!")
done
echo "== tests/cuda in .venv-vllm033 and .venv-vllm034 at once (logs: $logs/cuda-0.3x.log)"
for i in 0 1; do
  minor=$([ "$i" -eq 0 ] && echo 0.33 || echo 0.34)
  wait "${pids[$i]}" || cuda_rc=$?
  echo "== tests/cuda in .venv-vllm${minor/./} (vLLM $minor.0 --no-deps on a CPU torch)"
  cat "$logs/cuda-$minor.log"
done
# Lifetime mutants of the CUDA layer and the workspace (tools/mutants/mutants.py): each
# applied to a copy of the tree, each must turn a check red; prints the mutation score.
mut_rc=0
echo "== lifetime mutants (tools/mutants/run.py)"
OMP_NUM_THREADS=1 .venv/bin/python tools/mutants/run.py --jobs 2 || mut_rc=$?
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
if [ "$core_rc" -ne 0 ]; then exit "$core_rc"; fi
if [ "$cuda_rc" -ne 0 ]; then exit "$cuda_rc"; fi
exit "$mut_rc"
