# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Module-level skip for tests/cuda outside a vLLM 0.33 or 0.34 environment (each test
module calls :func:`require_vllm_cuda` before importing vLLM 0.33 / 0.34 names)."""

from __future__ import annotations

import importlib.util

import pytest

CUDA_MINORS = ("0.33", "0.34")


def vllm_minor() -> str:
    """``"0.33"`` or ``"0.34"``: the vLLM of this environment (after the guard)."""
    from importlib.metadata import version

    return ".".join(version("vllm").split(".")[:2])


def require_vllm_cuda() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM 0.33 or 0.34 (.venv-vllm033 / .venv-vllm034: "
                    "bash scripts/setup_vllm_cuda.sh 0.33|0.34)", allow_module_level=True)
    if vllm_minor() not in CUDA_MINORS:
        pytest.skip(f"needs vLLM 0.33.x or 0.34.x, this is {vllm_minor()} (.venv-vllm033 / "
                    ".venv-vllm034: bash scripts/setup_vllm_cuda.sh 0.33|0.34)",
                    allow_module_level=True)
