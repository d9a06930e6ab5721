# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every runtime patch of vLLM, in one registry, applied by ``plugin.register()``.

The registry is :data:`.patches.PATCHES`: per patch why, how, the upstream
code it replaces and when it can be removed (``python -m
vllm_dsv4_backend.vllm_compat.patches`` prints it all). One mechanism for
all of them: armed in every process as post-import hooks and applied when
vLLM imports the target module; the hook point is checked first (signature
or probe; a missing or changed one raises :class:`PatchError` naming the
vLLM version and symbol); one idempotency marker (``hooks.mark_port``).

The patches (a test checks this list covers the registry):

CPU only, vLLM 0.32 without Triton:

* ``T1``, ``T2``, ``T3``, ``T4``, ``T5``, ``T6``, ``T7``, ``T8`` — the
  DeepSeek-V4 metadata builders' Triton kernels, swapped for the torch ports
  of :mod:`vllm_dsv4_backend.ops.metadata` (Triton has no CPU backend).
  T1–T3 are read on CPU (T3 past 2051 tokens), T6 only with DSpark; T4, T5,
  T7 and T8 are not read by vLLM 0.32's CPU path (ported so a builder that
  starts reading them gets correct values).
* ``B1`` — a vLLM 0.32 bug: the CPU SWA builder's ``build_tile_scheduler``
  omits the ``c1a``/``c2a`` keys the shared ``build()`` reads (``KeyError``).
* ``cpu_op_fallbacks`` — torch versions of the DeepSeek-V4 ``_C`` ops that
  only vLLM's AVX512-BF16 library has, registered only where they are missing.
* ``router_expert_counts`` — vLLM 0.32's AVX512 routing kernels take only 64 or
  more experts; the torch router serves the shapes they refuse (one WARNING each).
* ``moe_expert_map`` — vLLM 0.32's CPU experts ignore ``expert_map`` under
  expert parallel and segfault in ``cpu_fused_moe``; global ids become local
  slots, another rank's experts weight 0.
* ``pp_stage_kv_cache``, ``pp_intermediate_buffer`` — pipeline parallel:
  a stage's KV cache plan names another stage's layer when a whole
  ``UniformTypeKVCacheSpecs`` group is on the other stage (``StopIteration``
  in ``allocate_kv_cache``; those tensors are dropped), and a later stage
  lacks its receive buffer when no warm-up step ran (allocated on first use)
  (:mod:`.pipeline`).
* ``dp_collectives`` — data parallel: the MoE's ``all_gatherv`` and
  ``reduce_scatterv``, which vLLM's CPU communicator lacks (HTTP 500 on every
  request), on gloo (:mod:`.collectives`).
* ``swa_unread_kernels`` — the plugin's CPU SWA metadata builder skips
  two vLLM kernels whose outputs no CPU layer reads (bound to a no-op during
  each build, restored after).
* ``mxfp4_indexer_cache`` — lifts vLLM's Blackwell-only check on
  ``indexer_kv_dtype='mxfp4'`` (applied by the plugin's CPU layer, which
  computes MXFP4 in torch).

Every platform:

* ``dummy_init_loader`` — seeded fan-in weights under ``--load-format dummy``
  for models whose ``config.json`` asks for them (the tiny test model).
* ``attention_config_json``, ``attention_config_init``,
  ``llm_attention_config`` — accept ``use_fp4_indexer_cache``, the spelling
  of the published serve commands, which vLLM >= 0.32 rejects.
* ``architecture_check`` — refuse ``FLASHMLA_SPARSE_DSV4`` for models that
  are not DeepSeek-V4 (vLLM's CPU platform would silently ignore it).
* ``attention_layer`` — make DeepSeek-V4 build the plugin's layer (the model
  picks its layer class itself); installed by
  :func:`~.attention.install_attention_layer` per ``VLLM_DSV4_ATTN_IMPL``.
* ``sleep_mode_workspace_pool`` — the workspace is reserved inside the context
  vLLM allocates its own workspace in: under ``--enable-sleep-mode`` (CUDA,
  0.33 / 0.34) the ``workspace`` cuMem pool, discarded on sleep and mapped back
  on wake-up, instead of the ``weights`` pool; no pool on CPU (:mod:`.sleep_mode`).

Modules:

* :mod:`.patches` — the registry and its mechanism (``arm``, ``apply``).
* :mod:`.hooks` — post-import hooks, the marker, signature checks, :class:`PatchError`.
* :mod:`.version` — the 0.32.x (CPU) / 0.33.x and 0.34.x (CUDA) gate.
* :mod:`.kernels` — the T1–T8 table and B1; :mod:`.loader` — the dummy loader;
  :mod:`.pipeline` — the pipeline-parallel fixes; :mod:`.collectives` — the DP ones;
  :mod:`.cpu_ops` — the ``_C`` fallbacks; :mod:`.attention` — the layer hook
  point; :mod:`.fingerprints` — drift checks of the vLLM bodies the layers repeat.
* :mod:`.attention_config` — the ``use_fp4_indexer_cache`` hooks; :mod:`.guards` —
  the startup checks; :mod:`.dummy_init` — the seeded weights the dummy loader writes.

Nothing here imports vLLM at module level.
"""

from __future__ import annotations

from vllm_dsv4_backend.vllm_compat.attention import install_attention_layer
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
    "install_attention_layer",
    "pending",
    "supported_versions_text",
]
