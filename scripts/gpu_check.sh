#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# GPU check for a single CUDA machine whose image has torch + CUDA but no vLLM and no
# network (e.g. one H200, torch 2.11), in one call under 8 minutes: the CUDA-graph harness (the
# plugin's CUDA layer under vLLM's own control flow, cut from the wheel into the stand-in
# packages build/vllm_stub/<ver>, pre-generated here: carry build/vllm_stub) in every mode,
# eager / breakable PIECEWISE / FULL, pytest tests/gpu, and real FlashMLA sparse decode
# (vLLM 0.34's _flashmla_C.abi3.so carried in the bundle, tools/gpu_flashmla/check.py:
# does it load on the box's torch, eager / CUDA graph / side stream against the plugin's
# torch reference, a TORCH_CUDA_SANITIZER pass); writes one JSON, $OUT/gpu_check.json,
# and prints a summary table last.
#
#   bash scripts/gpu_check.sh                  # on the GPU box; results in $OUT (or --out)
#   bash scripts/gpu_check.sh --dry-run        # here: the same steps on CPU, with
#                                              # `import vllm` blocked like on the box
#   bash scripts/gpu_check.sh --make-bundle    # here, before: build the stubs (from
#                                              # .venv-vllm033/.venv-vllm034 or the wheels),
#                                              # copy pytest & co. (pure Python) into
#                                              # .scratch/gpu_bundle and vLLM's FlashMLA into
#                                              # .scratch/gpu_bundle/flashmla; carry
#                                              # build/vllm_stub and .scratch/gpu_bundle
#
# Nothing is installed: the package is torch-only and runs from the checkout
# (PYTHONPATH=repo). If the box's Python has no pytest, the bundle made by --make-bundle
# (default .scratch/gpu_bundle, or --bundle DIR) is put on PYTHONPATH; without either the
# tests are reported as NOT RUN and the harness still runs.
#
# Environment: PYTHON (default python3, else python; in --dry-run .venv/bin/python, else
# .venv-vllm034/bin/python, else python3), OUT (results dir; default .scratch/gpu_check),
# GPU_CHECK_TESTS (pytest paths; default "tests/gpu"), TEST_TIMEOUT (s, default 100),
# HARNESS_TIMEOUT (s, default 170; HARNESS_VERSION_TIMEOUT, default 80, per vLLM version),
# GPU_CHECK_HARNESS=0 (skip the harness), GPU_CHECK_SANITIZER=0 (skip its second pass:
# cuda-eager and the served schedule under TORCH_CUDA_SANITIZER=1, SANITIZER_TIMEOUT s,
# default 50), FLASHMLA_TIMEOUT (s, default 150;
# FLASHMLA_SANITIZER_TIMEOUT, default 90, its sanitizer pass), GPU_CHECK_FLASHMLA=0 (skip
# it). The timeouts add up to under 8 minutes. (The layer benchmark step is gone with the
# unserved layer benchmark; the bench commands need vLLM.)
# Exit code: 0 when every step passed, 1 otherwise. The dry run builds the stubs when a
# vLLM venv or wheel is there, runs the harness for one step, and does not fail for want
# of a stub; on the box a missing stub fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DRY=0
BUNDLE=""
MAKE_BUNDLE=""
OUT_DIR=${OUT:-$ROOT/.scratch/gpu_check}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT_DIR=$2; shift ;;
    --bundle) BUNDLE=$2; shift ;;
    --make-bundle)
      if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then MAKE_BUNDLE=$2; shift
      else MAKE_BUNDLE=$ROOT/.scratch/gpu_bundle; fi ;;
    -h|--help) sed -n '4,41p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# Here (dry run): the CPU venv, else a vLLM CUDA venv (torch + pytest; vLLM is blocked
# below); on the box: its own python3 (venvs built here carry a CPU torch).
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ $DRY = 1 ] && [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
elif [ $DRY = 1 ] && [ -x "$ROOT/.venv-vllm034/bin/python" ]; then
  PY=$ROOT/.venv-vllm034/bin/python
elif command -v python3 >/dev/null 2>&1; then PY=python3
else PY=python; fi

if [ -n "$MAKE_BUNDLE" ]; then
  # The harness's stand-in vLLM packages (ignored by git; small): build/vllm_stub/<ver>.
  for v in 0.33 0.34; do
    if bash scripts/cuda_graph_check.sh --vllm $v --steps 1 >/dev/null 2>&1; then
      echo "gpu_check: stub build/vllm_stub/$v built and checked on CPU"
    else
      echo "gpu_check: no stub for vLLM $v (no .venv-vllm0${v#0.} or wheel, or its CPU run failed)"
    fi
  done
  # Pure-Python test dependencies from this interpreter's site-packages. Compiled
  # extensions are left out (PyYAML then uses its pure-Python loader), so the bundle works
  # with any Python 3 version on the box.
  mkdir -p "$MAKE_BUNDLE"
  "$PY" - "$MAKE_BUNDLE" <<'EOF'
import importlib.util, os, shutil, sys
dest = sys.argv[1]
for name in ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py", "pygments", "yaml",
             "typing_extensions", "tomli", "exceptiongroup"):
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        print(f"gpu_check: {name} not found in {sys.executable}, skipped")
        continue
    src = os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
    dst = os.path.join(dest, os.path.basename(src))
    if os.path.isdir(src):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(
            "__pycache__", "*.so", "*.pyd", "*.dylib"))
    else:
        shutil.copy2(src, dst)
    print(f"gpu_check: bundled {name} from {src}")
# Python < 3.11 boxes need these two backports; fetch the pure-Python wheels if this
# interpreter (3.11+) has none to copy.
import glob, subprocess, tempfile, zipfile
for name in ("tomli", "exceptiongroup"):
    if os.path.exists(os.path.join(dest, name)):
        continue
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--only-binary", ":all:", "--platform", "any",
                            "--implementation", "py", "--python-version", "3.10",
                            "--dest", tmp, name],
                           capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if r.returncode or not wheels:
            print(f"gpu_check: could not download {name} (only Python < 3.11 needs it)")
            continue
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(dest, [m for m in z.namelist() if m.startswith(name + "/")])
        print(f"gpu_check: bundled {name} from {os.path.basename(wheels[0])}")
EOF
  # vLLM's FlashMLA (the .so and its interface, rewired to load without vLLM).
  if "$PY" tools/gpu_flashmla/bundle.py --dest "$MAKE_BUNDLE/flashmla"; then :
  else echo "gpu_check: no FlashMLA bundle (needs .venv-vllm034: scripts/setup_vllm_cuda.sh 0.34)"
  fi
  echo "gpu_check: bundle in $MAKE_BUNDLE (carry it to the GPU box; found automatically" \
       "at .scratch/gpu_bundle)"
  exit 0
fi

mkdir -p "$OUT_DIR"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
TESTS=${GPU_CHECK_TESTS:-tests/gpu}
if [ $DRY = 1 ]; then
  # Like the GPU box: no vLLM importable (a stub package that raises ImportError shadows
  # the installed one), CPU device, tiny sizes.
  STUB=$OUT_DIR/.novllm
  mkdir -p "$STUB/vllm"
  echo 'raise ImportError("vllm is blocked by scripts/gpu_check.sh --dry-run (GPU box has none)")' \
    > "$STUB/vllm/__init__.py"
  export PYTHONPATH=$STUB:$PYTHONPATH
fi

echo "== gpu_check: $(date -u +%FT%TZ), repo $ROOT, results $OUT_DIR, dry-run $DRY"
"$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda "
      f"{torch.version.cuda}, cuda available {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)} "
          f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB")
try:
    import vllm  # noqa: F401
    print("vllm importable (not needed)")
except Exception as e:  # noqa: BLE001
    print(f"vllm not importable (expected on the GPU box): {e}")
EOF
if [ $DRY = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
then
  echo "gpu_check: torch.cuda.is_available() is False; use --dry-run off GPU" >&2
  exit 1
fi

# pytest: the interpreter's own, else the bundle.
if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
  for b in "$BUNDLE" "$ROOT/.scratch/gpu_bundle"; do
    if [ -n "$b" ] && [ -d "$b" ]; then export PYTHONPATH=$PYTHONPATH:$b; break; fi
  done
fi

T0=$SECONDS
TEST_STATUS="NOT RUN"; TEST_DETAIL="pytest unavailable (make a bundle: --make-bundle)"
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  echo "== pytest -q -x $TESTS (timeout ${TEST_TIMEOUT:-100} s)"
  # The FlashMLA tests are the FlashMLA step's cases (run once, there, with the fuller
  # report; under -x a numeric miss there would also stop the workspace tests).
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-100}" "$PY" -m pytest -q -x -p no:cacheprovider $TESTS \
    --ignore tests/gpu/test_flashmla_sparse_decode.py \
    --junitxml "$OUT_DIR/pytest.xml" 2>&1 | tee "$OUT_DIR/pytest.log"
  rc=${PIPESTATUS[0]}
  TEST_DETAIL=$(grep -E "(passed|failed|skipped|error|no tests ran)" "$OUT_DIR/pytest.log" \
                | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
  case $rc in
    0) TEST_STATUS=PASS ;;
    124) TEST_STATUS=TIMEOUT ;;
    *) TEST_STATUS="FAIL($rc)" ;;
  esac
fi
T1=$SECONDS

HARNESS_STATUS="NOT RUN"; HARNESS_DETAIL="no stub in build/vllm_stub (make them: --make-bundle)"
# Here (dry run): build the stubs from a venv or wheel if any, one step; on the box: use the
# pre-generated ones, every mode.
# The emulated (sim-*) modes are CPU CI's; the box runs the real-CUDA ones.
HARNESS_FLAGS=(--no-build --where cpu,cuda)
[ $DRY = 1 ] && HARNESS_FLAGS=(--steps 1 --where cpu)
if [ "${GPU_CHECK_HARNESS:-1}" = 0 ]; then
  HARNESS_STATUS=SKIPPED; HARNESS_DETAIL="GPU_CHECK_HARNESS=0"
elif [ $DRY = 1 ] || ls "$ROOT"/build/vllm_stub/*/vllm/__init__.py >/dev/null 2>&1; then
  echo "== cuda_graph_check ${HARNESS_FLAGS[*]} (timeout ${HARNESS_TIMEOUT:-170} s)"
  PYTHON=$PY HARNESS_VERSION_TIMEOUT=${HARNESS_VERSION_TIMEOUT:-80} \
    timeout "${HARNESS_TIMEOUT:-170}" bash scripts/cuda_graph_check.sh \
    "${HARNESS_FLAGS[@]}" --json "$OUT_DIR/cuda_graph.json" 2>&1 | tee "$OUT_DIR/cuda_graph.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) HARNESS_STATUS=PASS ;;
    124) HARNESS_STATUS=TIMEOUT ;;
    2) if [ $DRY = 1 ]; then HARNESS_STATUS="NOT RUN"; else HARNESS_STATUS="FAIL(2)"; fi ;;
    *) HARNESS_STATUS="FAIL($rc)" ;;
  esac
  HARNESS_DETAIL=$(tail -n 1 "$OUT_DIR/cuda_graph.log")
  if [ $DRY = 0 ] && [ "${GPU_CHECK_SANITIZER:-1}" = 1 ]; then
    # The served schedule (FULL / PIECEWISE / eager steps, micro-batches on and off, one
    # workspace and one graph pool) and the eager layer again under PyTorch's CUDA
    # sanitizer on real streams: any unsynchronised access raises in the harness.
    echo "== the same under TORCH_CUDA_SANITIZER=1 (timeout ${SANITIZER_TIMEOUT:-50} s)"
    TORCH_CUDA_SANITIZER=1 PYTHON=$PY HARNESS_VERSION_TIMEOUT=${SANITIZER_TIMEOUT:-50} \
      timeout "${SANITIZER_TIMEOUT:-50}" bash scripts/cuda_graph_check.sh --no-build \
      --vllm 0.34 --modes cuda-eager,cuda-serve,cuda-serve-mxfp4 \
      --json "$OUT_DIR/cuda_graph_sanitizer.json" > "$OUT_DIR/cuda_graph_sanitizer.log" 2>&1
    src=$?
    [ $src -ne 0 ] && HARNESS_STATUS="FAIL(sanitizer $src)"
    HARNESS_DETAIL="$HARNESS_DETAIL; sanitizer: $(tail -n 1 "$OUT_DIR/cuda_graph_sanitizer.log")"
  fi
fi
T2=$SECONDS

# Real FlashMLA sparse decode from the carried bundle (tools/gpu_flashmla). Here (dry run):
# the bundle is built when missing and a vLLM venv has the .so; the load is reported (it
# fails on a CPU torch) and the check runs over a CPU stand-in op.
FM_BUNDLE=${BUNDLE:-$ROOT/.scratch/gpu_bundle}/flashmla
FM_STATUS="NOT RUN"; FM_DETAIL="no FlashMLA bundle in $FM_BUNDLE (make it: --make-bundle)"
if [ "${GPU_CHECK_FLASHMLA:-1}" = 0 ]; then
  FM_STATUS=SKIPPED; FM_DETAIL="GPU_CHECK_FLASHMLA=0"
else
  if [ $DRY = 1 ] && [ ! -f "$FM_BUNDLE/manifest.json" ]; then
    "$PY" tools/gpu_flashmla/bundle.py --dest "$FM_BUNDLE" || true
  fi
  if [ -f "$FM_BUNDLE/manifest.json" ]; then
    FM_FLAGS=(--bundle "$FM_BUNDLE" --out "$OUT_DIR/flashmla_check.json"
              --sanitizer-timeout "${FLASHMLA_SANITIZER_TIMEOUT:-90}")
    [ $DRY = 1 ] && FM_FLAGS+=(--dry-run)
    echo "== flashmla check ${FM_FLAGS[*]} (timeout ${FLASHMLA_TIMEOUT:-150} s)"
    PYTHONUNBUFFERED=1 timeout "${FLASHMLA_TIMEOUT:-150}" "$PY" tools/gpu_flashmla/check.py \
      "${FM_FLAGS[@]}" 2>&1 | tee "$OUT_DIR/flashmla_check.log"
    rc=${PIPESTATUS[0]}
    case $rc in
      0) FM_STATUS=PASS ;;
      124) FM_STATUS=TIMEOUT ;;
      *) FM_STATUS="FAIL($rc)" ;;
    esac
    FM_DETAIL=$(tail -n 1 "$OUT_DIR/flashmla_check.log")
  fi
fi
T3=$SECONDS


echo
echo "== gpu_check summary ($( [ $DRY = 1 ] && echo 'dry run, CPU' || echo CUDA ))"
printf '%-8s %-10s %6s  %s\n' step status seconds detail
printf '%-8s %-10s %6s  %s\n' pytest "$TEST_STATUS" $((T1 - T0)) "$TEST_DETAIL"
printf '%-8s %-10s %6s  %s\n' harness "$HARNESS_STATUS" $((T2 - T1)) "$HARNESS_DETAIL"
printf '%-8s %-10s %6s  %s\n' flashmla "$FM_STATUS" $((T3 - T2)) "$FM_DETAIL"
# One JSON with everything: the steps and the harness reports.
"$PY" - "$OUT_DIR" "$DRY" "$TEST_STATUS" "$TEST_DETAIL" "$HARNESS_STATUS" \
  $((T1 - T0)) $((T2 - T1)) "$FM_STATUS" $((T3 - T2)) <<'EOF'
import json, os, platform, sys
import torch
out, dry, ts, td, hs, t_test, t_h, fs, t_f = sys.argv[1:]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
doc = {
    "dry_run": dry == "1",
    "python": platform.python_version(), "torch": torch.__version__,
    "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "steps": {
        "pytest": {"status": ts, "detail": td, "seconds": int(t_test)},
        "harness": {"status": hs, "seconds": int(t_h)},
        "flashmla": {"status": fs, "seconds": int(t_f)},
    },
    "harness": load("cuda_graph.json"),
    "flashmla": load("flashmla_check.json"),
}
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(doc, f, indent=1)
print(f"gpu_check: wrote {os.path.join(out, 'gpu_check.json')}")
EOF
HARNESS_OK=0
case "$HARNESS_STATUS" in
  PASS|SKIPPED) HARNESS_OK=1 ;;
  "NOT RUN") [ $DRY = 1 ] && HARNESS_OK=1 ;;
esac
FM_OK=0
case "$FM_STATUS" in
  PASS|SKIPPED) FM_OK=1 ;;
  "NOT RUN") [ $DRY = 1 ] && FM_OK=1 ;;
esac
if [ "$TEST_STATUS" = PASS ] && [ $HARNESS_OK = 1 ] && [ $FM_OK = 1 ]; then
  exit 0
fi
exit 1
