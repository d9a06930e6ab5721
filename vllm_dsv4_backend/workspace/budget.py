# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many bytes the workspace may reserve at load (torch only).

``WorkspaceManager.reserve(budget_bytes=...)`` refuses the ``private`` policy
(one set of buffers per layer: 24 GiB for DeepSeek-V4-Flash at 8192 batched
tokens) when it exceeds a budget. The budget is a plain argument; this module
derives the usual one from the device, for the layers to pass in.
"""

from __future__ import annotations

import torch


def reserve_budget_bytes(
    device: torch.device | str, memory_utilization: float | None = None
) -> int | None:
    """Bytes the workspace may reserve on ``device`` now; ``None`` when unknown.

    * CUDA: ``free - (1 - memory_utilization) * total`` from
      ``torch.cuda.mem_get_info(device)``: what remains of vLLM's
      ``gpu_memory_utilization`` share of the device for the KV cache and
      activations (call after the weights are loaded, as ``reserve()`` is);
      ``memory_utilization=None``: the free memory. Never below 0.
    * CPU: the system's available memory (``psutil.virtual_memory().available``);
      ``None`` without psutil. ``memory_utilization`` is not used (vLLM's CPU
      KV cache has its own setting, ``VLLM_CPU_KVCACHE_SPACE``).
    * Any other device: ``None`` (no check).

    Raises:
        ValueError: ``memory_utilization`` outside ``(0, 1]``.
    """
    if memory_utilization is not None and not (
        isinstance(memory_utilization, (int, float))
        and not isinstance(memory_utilization, bool)
        and 0 < memory_utilization <= 1
    ):
        raise ValueError(
            f"memory_utilization: expected a float in (0, 1] (vLLM's "
            f"--gpu-memory-utilization) or None, got {memory_utilization!r}"
        )
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        if memory_utilization is None:
            return int(free)
        return max(0, int(free - (1.0 - float(memory_utilization)) * total))
    if dev.type == "cpu":
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().available)
    return None
