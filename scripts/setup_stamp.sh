# SPDX-License-Identifier: Apache-2.0
# Sourced by the setup scripts (setup.sh, setup_vllm_cuda.sh): what makes them
# idempotent. A stamp in the venv holds a hash of the files the venv is built
# from; a matching stamp and a passing import probe skip the whole build.
# Expects VENV, PY and STAMP; setup_begin sets want and t0 for setup_end.

# setup_begin LABEL FILE... -- PROBE...: exit 0 when $STAMP holds the hash of
# the FILEs (this helper included) and the PROBE command succeeds; otherwise
# start the clock and create $VENV when it has no python yet.
setup_begin() {
  local label=$1
  shift
  local files=("${BASH_SOURCE[0]}")
  while [ "$1" != "--" ]; do
    files+=("$1")
    shift
  done
  shift
  want=$(cat "${files[@]}" | sha256sum | cut -c1-16)
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$@" 2>/dev/null; then
    echo "$label $VENV is up to date"
    exit 0
  fi
  t0=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    echo "$label creating $VENV"
    "$PY" -m venv "$VENV"
  fi
}

# setup_end LABEL: record the stamp (the build is complete) and the time it took.
setup_end() {
  echo "$want" > "$STAMP"
  echo "$1 done in $(( $(date +%s) - t0 )) s"
}
