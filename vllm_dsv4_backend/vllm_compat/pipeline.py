# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline parallel on vLLM 0.32's CPU build: two fixes of vLLM's own code.

**A stage's KV cache holds only its own layers** (``pp_stage_kv_cache``).
vLLM plans the KV cache groups for the whole model, then projects them onto
each pipeline stage (``kv_cache_utils._project_kv_cache_groups_to_worker``).
A group none of whose layers is on a stage stays in that stage's list (group
ids are global) with no layer names, but, when its spec is a
``UniformTypeKVCacheSpecs``, with the spec unprojected: it still maps the
other stage's layer names to their specs. ``get_kv_cache_config_from_groups``
lays out a ``UniformTypeKVCacheSpecs`` group from its spec's layers, not from
``group.layer_names``, so that stage gets a ``KVCacheTensor`` for a layer it
does not have, and the worker's ``allocate_kv_cache`` (``next(...)`` over the
stage's groups) dies with ``StopIteration``. DeepSeek-V4 hits it at
``--pipeline-parallel-size 2`` with every attention layer (vLLM's and the
plugin's): all its groups are ``UniformTypeKVCacheSpecs``, and the tiny
model's only C128 layer (layer 2) puts the C128 compressor-state group (block
size 8) on stage 1 alone. Models whose group specs are plain (a Llama) take
the ``elif group.layer_names`` branch, which lays out nothing for an empty
group. :func:`own_layer_tensors` drops exactly those tensors; nothing else of
the plan moves (each group's tensors start at byte 0, the groups alias each
other; bytes per block and block counts come from ``group.layer_names``).

**A later stage has its receive buffer** (``pp_intermediate_buffer``). A
stage after the first copies the previous stage's hidden states into
``GPUModelRunner.intermediate_tensors``, a buffer ``_dummy_run`` allocates
(``model.make_empty_intermediate_tensors(max_num_tokens)``).
On CPU the only dummy run is the compile warm-up, which ``CPUWorker`` skips
under ``--enforce-eager`` with an explicit KV cache size
(``VLLM_CPU_KVCACHE_SPACE``): the first request then fails
``assert self.intermediate_tensors is not None`` in
``sync_and_gather_intermediate_tensors`` on stage 1 (any model). The wrapper
allocates the buffer there, with ``_dummy_run``'s arguments, when it is
missing.

Both are no-ops without pipeline parallelism (a config without a foreign
tensor is returned as is; a first stage never calls the gather), so one
process and every other model are untouched. Registered in :mod:`.patches`.
Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dsv4_backend._logging import init_logger
from vllm_dsv4_backend.vllm_compat import hooks

__all__ = [
    "KV_CACHE_MODULE",
    "KV_CACHE_SYMBOL",
    "RUNNER_MODULE",
    "RUNNER_SYMBOL",
    "install_intermediate_buffer",
    "install_stage_kv_cache",
    "own_layer_tensors",
]

logger = init_logger(__name__)

KV_CACHE_MODULE = "vllm.v1.core.kv_cache_utils"
KV_CACHE_SYMBOL = "get_kv_cache_config_from_groups"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER_SYMBOL = "GPUModelRunner.sync_and_gather_intermediate_tensors"


def own_layer_tensors(config: Any) -> tuple[Any, list[str]]:
    """``(config, dropped)``: ``config`` without the KV cache tensors that name
    only layers none of its groups holds (another pipeline stage's), and the
    names of those layers.

    ``config`` is a ``KVCacheConfig``; returned as is (same object) when every
    tensor names the stage's own layers. A tensor mixing own and foreign
    layers cannot come from vLLM's planner (a group with any of the stage's
    layers is projected to exactly those), so it is kept unchanged and
    ``allocate_kv_cache`` reports it as vLLM would.
    """
    own = {name for group in config.kv_cache_groups for name in group.layer_names}
    kept, dropped = [], []
    for tensor in config.kv_cache_tensors:
        if tensor.layers and not own.intersection(tensor.layers):
            dropped.extend(tensor.layers)
        else:
            kept.append(tensor)
    if not dropped:
        return config, []
    return dataclasses.replace(config, kv_cache_tensors=kept), dropped


def install_stage_kv_cache(module: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """Wrap ``kv_cache_utils.get_kv_cache_config_from_groups`` (checked
    signature, ``hooks.mark_port`` marker); False if already wrapped.

    ``get_kv_cache_configs`` and the auto-fit of ``max_model_len`` call it
    through the module global, and the model runners import it at call time,
    so rebinding it there reaches every call that plans a stage's KV cache.
    """
    _, _, original = hooks.resolve(module, KV_CACHE_SYMBOL)
    if hooks.is_port(original):
        return False
    # Probe the two KVCacheConfig fields the filter reads and replaces.
    config_cls = hooks.resolve(module, "KVCacheConfig")[2]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    missing = {"kv_cache_tensors", "kv_cache_groups"} - fields
    if missing:
        raise hooks.fail(f"{KV_CACHE_MODULE}.KVCacheConfig", f"no fields {sorted(missing)}")

    @functools.wraps(original)
    def get_kv_cache_config_from_groups(vllm_config: Any, kv_cache_groups: Any,
                                        available_memory: int) -> Any:
        config = original(vllm_config, kv_cache_groups, available_memory)
        config, dropped = own_layer_tensors(config)
        if dropped:
            logger.debug("KV cache of this pipeline stage: no tensors for other stages' "
                         "layers %s", dropped)
        return config

    hooks.replace_attr(module, KV_CACHE_SYMBOL, get_kv_cache_config_from_groups,
                       expected_params=("vllm_config", "kv_cache_groups", "available_memory"))
    on_applied(f"pipeline:{KV_CACHE_MODULE}.{KV_CACHE_SYMBOL} lays out the stage's own layers")
    return True


def install_intermediate_buffer(module: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """Wrap ``GPUModelRunner.sync_and_gather_intermediate_tensors`` (which
    ``CPUModelRunner`` inherits; checked signature, ``hooks.mark_port``
    marker) to allocate the receive buffer first when no dummy run did; False
    if already wrapped. Armed on CPU only; where a dummy run allocated the
    buffer (every other runner) the wrapper only calls vLLM's method."""
    _, _, original = hooks.resolve(module, RUNNER_SYMBOL)
    if hooks.is_port(original):
        return False

    @functools.wraps(original)
    def sync_and_gather_intermediate_tensors(self: Any, num_tokens: int,
                                             intermediate_tensors: Any,
                                             sync_self: bool) -> Any:
        if getattr(self, "intermediate_tensors", None) is None:
            # GPUModelRunner._dummy_run's allocation, which the CPU worker skips
            # under --enforce-eager with an explicit KV cache size.
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype,
                device=self.device)
            logger.debug("pipeline stage receive buffer: %d tokens", self.max_num_tokens)
        return original(self, num_tokens, intermediate_tensors, sync_self)

    hooks.replace_attr(module, RUNNER_SYMBOL, sync_and_gather_intermediate_tensors,
                       expected_params=("num_tokens", "intermediate_tensors", "sync_self"))
    on_applied(f"pipeline:{RUNNER_MODULE}.{RUNNER_SYMBOL} allocates the stage's receive buffer")
    return True
