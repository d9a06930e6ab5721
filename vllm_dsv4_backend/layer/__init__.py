# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's DeepSeek-V4 attention layers: vLLM's own layer for each
platform plus the plugin's workspace.

* :mod:`.cpu`: vLLM 0.32's ``DeepseekV4CPUAttention`` (the same ``_C`` ops in
  the same order) with the eager region's output buffers leased from the
  workspace, and the plugin's torch ops for the MXFP4 indexer cache.
* :mod:`.cuda`: vLLM 0.33's ``DeepseekV4FlashMLAAttention`` with the buffers
  of its eager region that a kernel can write into leased from the workspace.

Each submodule imports vLLM's DeepSeek-V4 classes, so nothing is imported
until :func:`get_attention_layer_cls` asks for a platform.
"""

from __future__ import annotations

import importlib

__all__ = ["PLATFORMS", "get_attention_layer_cls"]

# platform -> (module, factory)
PLATFORMS: dict[str, str] = {"cpu": "cpu", "cuda": "cuda"}


def get_attention_layer_cls(platform: str) -> type:
    """The plugin's DeepSeek-V4 attention layer class for ``platform``.

    Raises:
        ValueError: ``platform`` is not one of :data:`PLATFORMS`.
        NotImplementedError: the installed vLLM has no such layer to extend
            (the message names the version needed).
    """
    if platform not in PLATFORMS:
        raise ValueError(
            f"vllm_dsv4_backend has no DeepSeek-V4 attention layer for platform {platform!r}; "
            f"supported: {sorted(PLATFORMS)}"
        )
    module = importlib.import_module(f"{__name__}.{PLATFORMS[platform]}")
    return module.layer_cls()
