#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's test command: sets up .venv if anything is missing, then runs
# the whole suite (real-vLLM engine/server, lm_eval, safety case; GPU tests skip on CPU).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/core -k mxfp4`.
# Without arguments it runs every directory but tests/core, then tests/core with
# `import vllm` blocked (vllm_dsv4_backend/testing/no_vllm.py: the proof that core is
# torch-only, and core's only run: with vLLM importable it runs the same tests). Beside
# them, in the background at nice 15 (it takes the CPU the engines leave idle: their
# start-up compiles on one thread), one chain: the vLLM 0.33 and 0.34 venvs, tests/cuda in
# both at once (one thread each; the CUDA-graph harness is one Python thread), the
# lifetime mutation suite (two mutants at once) after the shorter 0.33 suite. Its logs
# print when the foreground runs are done. The script fails if any run fails (the first
# run's exit code wins). The main run prints its 25 slowest tests (--durations): a
# measurement for the CI time budget, never a check. The slow, repeating variants are
# behind the switches of docs/usage.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -ra "$@"
fi
logs="$DSV4_SCRATCH/test-logs"
mkdir -p "$logs"
# tests/cuda: vLLM 0.33's and 0.34's real CUDA classes imported on CPU, each in its own
# venv (.venv-vllm033 / .venv-vllm034, built when missing by scripts/setup_vllm_cuda.sh;
# no CUDA kernel runs). The lifetime mutants of the CUDA layer and the workspace
# (tools/mutants/mutants.py) need the 0.34 venv: each is applied to a copy of the tree and
# must turn a check red by the bug's symptom; the runner prints the mutation score.
background() {
  renice -n 15 -p "$BASHPID" > /dev/null
  local minor
  for minor in 0.33 0.34; do
    if ! bash scripts/setup_vllm_cuda.sh "$minor" >> "$logs/setup-cuda.log" 2>&1; then
      echo 1 > "$logs/cuda.rc"; echo 1 > "$logs/mutants.rc"; return
    fi
  done
  # tests/cuda in both venvs at once; the mutants start when the shorter 0.33 suite is
  # done, beside the 0.34 one (two mutants at a time).
  (
    rc=0
    OMP_NUM_THREADS=1 .venv-vllm033/bin/python -m pytest -ra tests/cuda \
      > "$logs/cuda-0.33.log" 2>&1 || rc=$?
    echo "$rc" > "$logs/cuda-0.33.rc"
    rc=0
    OMP_NUM_THREADS=1 .venv/bin/python tools/mutants/run.py --jobs 2 > "$logs/mutants.log" 2>&1 \
      || rc=$?
    echo "$rc" > "$logs/mutants.rc"
  ) &
  local first=$!
  local rc=0
  OMP_NUM_THREADS=1 .venv-vllm034/bin/python -m pytest -ra tests/cuda \
    > "$logs/cuda-0.34.log" 2>&1 || rc=$?
  wait "$first" || true
  if [ "$rc" -eq 0 ]; then rc=$(cat "$logs/cuda-0.33.rc" 2> /dev/null || echo 1); fi
  echo "$rc" > "$logs/cuda.rc"
}
rm -f "$logs"/setup-cuda.log "$logs"/cuda-0.3?.* "$logs"/cuda.rc "$logs"/mutants.*
background &
background_pid=$!
rc=0
.venv/bin/python -m pytest -ra --durations=25 tests --ignore=tests/core || rc=$?
core_rc=0
echo "== tests/core with import vllm blocked (DSV4_CORE_NO_VLLM=1)"
DSV4_CORE_NO_VLLM=1 .venv/bin/python -m pytest -ra -p vllm_dsv4_backend.testing.no_vllm tests/core \
  || core_rc=$?
echo "== waiting for the background chain (the vLLM 0.33 and 0.34 venvs, tests/cuda, mutants)"
wait "$background_pid" || true
echo "== the vLLM 0.33 and 0.34 venvs ($logs/setup-cuda.log)"
cat "$logs/setup-cuda.log"
for minor in 0.33 0.34; do
  echo "== tests/cuda in .venv-vllm${minor/./} (vLLM $minor.0 --no-deps on a CPU torch)"
  cat "$logs/cuda-$minor.log" 2> /dev/null || echo "(not run: the venv was not built)"
done
echo "== lifetime mutants (tools/mutants/run.py)"
cat "$logs/mutants.log" 2> /dev/null || echo "(not run: the venv was not built)"
cuda_rc=$(cat "$logs/cuda.rc" 2> /dev/null || echo 1)
mut_rc=$(cat "$logs/mutants.rc" 2> /dev/null || echo 1)
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
if [ "$core_rc" -ne 0 ]; then exit "$core_rc"; fi
if [ "$cuda_rc" -ne 0 ]; then exit "$cuda_rc"; fi
exit "$mut_rc"
