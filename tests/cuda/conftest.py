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
from typing import Any

import pytest


def _vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


if (_vllm_version() or "").startswith(("0.33.", "0.34.")):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# Each test module starts with support.cuda_guard.require_vllm_cuda() (a module-level
# skip), because the modules import vLLM 0.33 / 0.34 names at import time.


@pytest.fixture
def simulated_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's current platform answering as CUDA (no GPU, nothing launched);
    the plugin's process state and vLLM's module global restored afterwards.
    Returns the platform. (Imports vLLM when used: a test module that asks for it
    has passed ``require_vllm_cuda`` already.)"""
    import vllm.models.deepseek_v4.nvidia.model as nvm
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
    from vllm.platforms import current_platform

    from vllm_dsv4_backend import plugin
    from vllm_dsv4_backend.vllm_compat import attention

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False, raising=False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True, raising=False)
    monkeypatch.setattr(nvm, "DeepseekV4FlashMLAAttention", DeepseekV4FlashMLAAttention)
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setattr(plugin, "_state", {"applied": []})
    monkeypatch.setattr(attention, "_installed", {})
    monkeypatch.delenv("VLLM_DSV4_ATTN_IMPL", raising=False)
    return current_platform
