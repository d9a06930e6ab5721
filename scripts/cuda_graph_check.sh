#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The plugin's unmodified CUDA layer driven by vLLM's own control flow (cut verbatim from
# an installed vLLM into a stand-in package), eager / breakable PIECEWISE / FULL, compared
# bit for bit with a serial reference; see tools/cuda_graph/harness.py.
#
#   bash scripts/cuda_graph_check.sh [--json FILE] [--vllm 0.33|0.34|both] [--no-build]
#                                     [--steps N] [--modes M,...] [--where cpu,sim,cuda]
#
# For each version: builds build/vllm_stub/<ver> (ignored, never committed) from
# .venv-vllm0XX's vLLM, else from a wheel in $WHEELS (default /tmp/wheels), else uses an
# existing build/vllm_stub/<ver> (the GPU box: carried in build/); then runs the harness with
# PYTHONPATH=build/vllm_stub/<ver>:. under $PYTHON (default .venv/bin/python, else python3);
# the stub's `vllm` shadows any installed vLLM (checked). CUDA modes run when
# torch.cuda.is_available(). Default --vllm: every version with a venv, wheel or stub.
# --json FILE: one JSON with a report per version (written even when one fails or times
# out: HARNESS_VERSION_TIMEOUT s per version, default 1200). Exit 1 if any mode differs
# from its reference or a negative control is not detected; 2 on usage or build errors.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

JSON=""
WANT=""
BUILD=1
HARNESS_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --json) JSON=$2; shift ;;
    --vllm) WANT=$2; shift ;;
    --no-build) BUILD=0 ;;
    --steps|--modes|--device|--where) HARNESS_ARGS+=("$1" "$2"); shift ;;
    -h|--help) sed -n '4,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "cuda_graph_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
elif command -v python3 >/dev/null 2>&1; then PY=python3
else PY=python; fi
WHEELS=${WHEELS:-/tmp/wheels}

venv_of() { echo "$ROOT/.venv-vllm0${1#0.}"; }
wheel_of() { ls "$WHEELS"/vllm-"$1".*.whl 2>/dev/null | head -n 1; }
available() {
  [ -x "$(venv_of "$1")/bin/python" ] || [ -n "$(wheel_of "$1")" ] || \
    [ -f "$ROOT/build/vllm_stub/$1/vllm/__init__.py" ]
}

case "$WANT" in
  ""|both) VERSIONS=""; for v in 0.33 0.34; do available $v && VERSIONS="$VERSIONS $v"; done
           if [ -z "$VERSIONS" ]; then
             echo "cuda_graph_check: no vLLM 0.33/0.34 venv, wheel or stub found" >&2; exit 2
           fi ;;
  0.33|0.34) VERSIONS=$WANT ;;
  *) echo "cuda_graph_check: --vllm expects 0.33, 0.34 or both, got $WANT" >&2; exit 2 ;;
esac

OUTDIR=$(mktemp -d)
trap 'rm -rf "$OUTDIR"' EXIT
STATUS=0
for v in $VERSIONS; do
  STUB=$ROOT/build/vllm_stub/$v
  if [ $BUILD = 1 ]; then
    VENV=$(venv_of "$v")
    WHEEL=$(wheel_of "$v")
    if [ -x "$VENV/bin/python" ]; then
      # find_spec: where `import vllm` would load from, without importing it.
      SRC=$(env -u PYTHONPATH "$VENV/bin/python" -c \
        'import importlib.util,os;print(os.path.dirname(importlib.util.find_spec("vllm").origin))')
      echo "== build stub $v from $SRC"
      "$PY" tools/cuda_graph/build_stub.py --vllm-src "$SRC" --out "$STUB" || exit 2
    elif [ -n "$WHEEL" ]; then
      echo "== build stub $v from $WHEEL"
      "$PY" tools/cuda_graph/build_stub.py --wheel "$WHEEL" --out "$STUB" || exit 2
    elif [ -f "$STUB/vllm/__init__.py" ]; then
      echo "== stub $v: using the pre-generated $STUB"
    else
      echo "cuda_graph_check: no source for vLLM $v" >&2; exit 2
    fi
  fi
  # The stub must shadow any installed vLLM: PYTHONPATH precedes site-packages.
  if ! PYTHONPATH=$STUB:$ROOT${PYTHONPATH:+:$PYTHONPATH} "$PY" -c \
      'import vllm, sys; sys.exit(0 if getattr(vllm, "HARNESS_STUB", False) else 1)'; then
    echo "cuda_graph_check: import vllm does not resolve to $STUB" >&2; exit 2
  fi
  echo "== harness, vLLM $v stub ($PY)"
  PYTHONPATH=$STUB:$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONDONTWRITEBYTECODE=1 \
    timeout "${HARNESS_VERSION_TIMEOUT:-1200}" "$PY" tools/cuda_graph/harness.py \
    --json "$OUTDIR/$v.json" ${HARNESS_ARGS[@]+"${HARNESS_ARGS[@]}"}
  rc=$?
  [ $rc = 124 ] && echo "cuda_graph_check: vLLM $v harness timed out" \
    "(HARNESS_VERSION_TIMEOUT=${HARNESS_VERSION_TIMEOUT:-1200} s); its JSON holds the modes done"
  [ $rc = 0 ] || STATUS=1
done

if [ -n "$JSON" ]; then
  "$PY" - "$JSON" "$OUTDIR" $VERSIONS <<'EOF'
import json, os, sys
out, d, versions = sys.argv[1], sys.argv[2], sys.argv[3:]
reports = {}
for v in versions:
    p = os.path.join(d, f"{v}.json")
    try:
        with open(p) as f:
            reports[v] = json.load(f)
    except (OSError, ValueError):
        reports[v] = {"ok": False, "error": "no report (the harness crashed before writing)"}
doc = {"ok": all(r.get("ok") for r in reports.values()), "versions": reports}
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
print(f"cuda_graph_check: wrote {out}")
EOF
fi
echo "cuda_graph_check: $( [ $STATUS = 0 ] && echo OK || echo FAILED ) ($VERSIONS )"
exit $STATUS
