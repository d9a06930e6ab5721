# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Version-guarded runtime patches of vLLM, applied by ``plugin.register()``.

* :mod:`.version` — the 0.32.x (CPU) / 0.33.x (CUDA) gate.
* :mod:`.kernels` — CPU: Triton metadata kernels T1–T8 -> torch ports, bug B1.
* :mod:`.loader` — ``--load-format dummy`` hook for seeded fan-in weights.
* :mod:`.attention` — :func:`install_attention_layer`, the hook point that
  swaps DeepSeek-V4's attention layer class (CPU module global
  ``DeepseekV4CPUAttention``; CUDA ``_select_dsv4_attn_cls``).
* :mod:`.hooks` — post-import hooks, signature checks, :class:`PatchError`.

Patches are armed in every process and applied when vLLM imports their
target module; each checks the hook point first and raises
:class:`PatchError` (naming the vLLM version and symbol) if it is missing or
changed. Nothing here imports vLLM at module level.
"""

from __future__ import annotations

from vllm_dsv4_backend.vllm_compat.attention import (
    find_plugin_layer,
    install_attention_layer,
    installed_attention_layer,
)
from vllm_dsv4_backend.vllm_compat.hooks import PatchError, pending
from vllm_dsv4_backend.vllm_compat.version import (
    SUPPORTED_VLLM,
    check_vllm_version,
    supported_versions_text,
)

__all__ = [
    "SUPPORTED_VLLM",
    "PatchError",
    "check_vllm_version",
    "find_plugin_layer",
    "install_attention_layer",
    "installed_attention_layer",
    "pending",
    "supported_versions_text",
]
