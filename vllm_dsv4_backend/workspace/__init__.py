# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-layer workspace manager for an attention eager region (torch only).

The mechanism: slots, leases, fences and counters. It names no model's
buffers: a caller declares its families and layer kinds in a
``WorkspaceConfig`` (DeepSeek-V4's: ``vllm_dsv4_backend.layer.plan``).

* ``sizing``: ``WorkspaceConfig``, ``FamilySpec``, slot layouts, bytes per policy.
* ``manager``: ``WorkspaceManager`` (reserve at load, per-layer leases with
  stable addresses, stream-fenced sharing, stats) and its errors.
* ``streams``: the ``StreamBackend`` protocol, CUDA / no-stream / simulated.
* ``alloc_counter``: ``count_allocations()`` for any device.
* ``budget``: ``reserve_budget_bytes()``, the memory ``private`` may reserve.

Never imports vLLM. See docs/workspace.md.
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy: importing one submodule does not import the others.
_EXPORTS: dict[str, str] = {
    "AllocationCounter": "alloc_counter",
    "count_allocations": "alloc_counter",
    "ENV_DEBUG": "manager",
    "ENV_POLICY": "manager",
    "Lease": "lease",
    "WorkspaceBudgetError": "lease",
    "WorkspaceCapacityError": "lease",
    "WorkspaceLeaseError": "lease",
    "WorkspaceManager": "manager",
    "resolve_policy": "manager",
    "POLICIES": "sizing",
    "BufferSpec": "sizing",
    "FamilySpec": "sizing",
    "WorkspaceBytes": "sizing",
    "WorkspaceConfig": "sizing",
    "plan_layout": "sizing",
    "private_fit_tokens": "sizing",
    "workspace_bytes": "sizing",
    "reserve_budget_bytes": "budget",
    "CudaStreamBackend": "streams",
    "NullStreamBackend": "streams",
    "SimStreamBackend": "streams",
    "StreamBackend": "streams",
    "default_backend": "streams",
}


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = [
    "ENV_DEBUG",
    "ENV_POLICY",
    "POLICIES",
    "AllocationCounter",
    "BufferSpec",
    "FamilySpec",
    "CudaStreamBackend",
    "Lease",
    "NullStreamBackend",
    "SimStreamBackend",
    "StreamBackend",
    "WorkspaceBudgetError",
    "WorkspaceBytes",
    "WorkspaceCapacityError",
    "WorkspaceConfig",
    "WorkspaceLeaseError",
    "WorkspaceManager",
    "count_allocations",
    "default_backend",
    "plan_layout",
    "private_fit_tokens",
    "reserve_budget_bytes",
    "resolve_policy",
    "workspace_bytes",
]
