# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workspace reservation under vLLM's sleep-mode memory pool (patch registry entry
``sleep_mode_workspace_pool``).

vLLM 0.33 and 0.34 build their own workspace manager
(``vllm/v1/worker/workspace.py``) with an ``alloc_context`` factory: the GPU worker
passes ``lambda: self._maybe_get_memory_pool_context("workspace")``
(``gpu_worker.py: _init_workspace_and_model_runner``, "Scratch holds no state
across steps: discard it on sleep"). With the cuMem allocator on
(``--enable-sleep-mode``) that context is ``CuMemAllocator.use_memory_pool(tag=
"workspace")``; the sleep backend offloads only ``weights``, ``runtime`` and
``cudagraph`` (0.34: ``CuMemBackend.suspend``; 0.33: the same plus ``weights``
only at level 1), so ``workspace`` allocations are unmapped without a CPU copy on
sleep, and, not being a deferrable tag (``DEFERRABLE_TAGS = ("weights",
"kv_cache")``), mapped back at the same virtual addresses on every wake-up. Without
the plugin's part the plugin's reservation, made while the model loads, lands in the
``weights`` pool: backed up to host memory on sleep like a weight.

:func:`reservation_context` returns the context vLLM's own workspace allocates in,
read from vLLM's live manager (``current_workspace_manager()._alloc_context``),
so every condition vLLM applies (CUDA without the cuMem allocator, CPU: no pool)
is vLLM's; the plugin's CUDA layer reserves inside it
(:func:`vllm_dsv4_backend.layer.core.reserve_and_report`). Nothing of vLLM is
replaced. A hook point that differs (a patch release) is one ERROR line and a plain
reservation (the old behaviour), or a startup error under
``VLLM_DSV4_ATTN_IMPL=plugin``. Addresses after wake-up are the ones leased before
(cuMem maps back at the reserved virtual address); that the bytes are freed on
sleep is the GPU check's to show.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from vllm_dsv4_backend import envs
from vllm_dsv4_backend._logging import init_logger
from vllm_dsv4_backend.vllm_compat import hooks

__all__ = ["MODULE", "PATCH", "TAG", "reservation_context"]

logger = init_logger(__name__)

PATCH = "sleep_mode_workspace_pool"
MODULE = "vllm.v1.worker.workspace"
TAG = "workspace"  # the tag vLLM's gpu_worker passes for its own workspace


def _vllm_alloc_context() -> Callable[[], AbstractContextManager[Any]] | None:
    """vLLM's workspace ``alloc_context`` factory (``None``: vLLM built no manager
    in this process), after checking the hook points."""
    ws = importlib.import_module(MODULE)
    hooks.check_accepts_keyword(f"{MODULE}.init_workspace_manager", ws.init_workspace_manager,
                                "alloc_context")
    hooks.check_accepts_keyword(f"{MODULE}.WorkspaceManager.__init__",
                                ws.WorkspaceManager.__init__, "alloc_context")
    if not ws.is_workspace_manager_initialized():
        return None
    factory = getattr(ws.current_workspace_manager(), "_alloc_context", None)
    if not callable(factory):
        raise hooks.fail(f"{MODULE}.WorkspaceManager._alloc_context",
                         "vLLM's workspace manager keeps no alloc_context factory")
    return factory


def reservation_context() -> AbstractContextManager[Any]:
    """The context vLLM 0.33 / 0.34 allocate their own workspace in (the
    ``workspace`` sleep-mode pool under ``--enable-sleep-mode``, else no pool);
    a null context where vLLM has no workspace manager or the hook point moved
    (logged; raised under ``VLLM_DSV4_ATTN_IMPL=plugin``). Outside vLLM (a
    process that never imported it: the torch-only tests) a null context."""
    if "vllm" not in sys.modules:
        return contextlib.nullcontext()
    try:
        factory = _vllm_alloc_context()
        return factory() if factory is not None else contextlib.nullcontext()
    except Exception as e:  # noqa: BLE001 - a moved hook point must not stop vLLM
        strict = envs.VLLM_DSV4_ATTN_IMPL == "plugin"
        err = hooks.patch_failed(PATCH, MODULE, e, strict=strict,
                                 kept="the workspace reserved outside vLLM's sleep-mode pool")
        if strict:
            raise err from e
        return contextlib.nullcontext()
