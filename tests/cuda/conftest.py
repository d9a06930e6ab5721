# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tests/cuda: vLLM 0.33's and 0.34's real CUDA classes, imported on CPU
(.venv-vllm033, .venv-vllm034).

Build the environments with ``bash scripts/setup_vllm_cuda.sh 0.33|0.34``;
``scripts/test.sh`` does it when one is missing and runs this directory in each.
Under any other vLLM (the 0.32 CPU build in .venv) or without vLLM the whole
directory is skipped.

``VLLM_TARGET_DEVICE=cpu`` is set before vLLM is imported: vLLM then picks its
CPU platform (the plugin registers its config hooks for cpu and cuda only),
and the ``nvidia`` modules still import directly. Nothing here runs a CUDA
kernel: vLLM's CUDA kernel objects are replaced by the plugin's torch ops
where a test executes the layer's code.
"""

from __future__ import annotations

import os
from importlib import metadata


def _vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


if (_vllm_version() or "").startswith(("0.33.", "0.34.")):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# Each test module starts with support.cuda_guard.require_vllm_cuda() (a module-level
# skip), because the modules import vLLM 0.33 / 0.34 names at import time.
