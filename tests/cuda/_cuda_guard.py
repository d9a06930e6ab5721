# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Module-level skip for tests/cuda outside a vLLM 0.33 environment."""

from __future__ import annotations

import importlib.util

import pytest


def require_vllm033() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM 0.33 (.venv-vllm033: bash scripts/setup_vllm033.sh)",
                    allow_module_level=True)
    from importlib.metadata import version

    v = version("vllm")
    if not v.startswith("0.33."):
        pytest.skip(f"needs vLLM 0.33.x, this is {v} (.venv-vllm033: "
                    "bash scripts/setup_vllm033.sh)", allow_module_level=True)
