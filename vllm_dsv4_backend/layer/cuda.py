# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's DeepSeek-V4 layer on CUDA (vLLM 0.33): not built yet."""

from __future__ import annotations


def layer_cls() -> type:
    raise NotImplementedError(
        "vllm_dsv4_backend has no DeepSeek-V4 attention layer for platform 'cuda' yet "
        "(supported: cpu); set VLLM_DSV4_ATTN_IMPL=vllm to use vLLM's own layer"
    )
