# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``pp_stage_kv_cache`` patch on vLLM 0.32's real KV cache planner, without an engine.

Two pipeline stages, two ``UniformTypeKVCacheSpecs`` groups as DeepSeek-V4 has them: group
A has a layer on each stage, group B only one on stage 1 (the tiny model's C128
compressor state). vLLM's own projection (``_project_kv_cache_groups_to_worker``) and
planner (``get_kv_cache_config_from_groups``) give stage 0 a tensor for stage 1's layer
and vLLM's ``allocate_kv_cache`` raises ``StopIteration`` (the bug, reproduced); through the
patch's wrapper (installed on a stand-in module, vLLM's modules untouched) stage 0's plan
names only its layer, allocates, and every other number of the plan is vLLM's. Stage 1,
whose groups all hold its layers, gets vLLM's plan object unchanged.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from vllm_dsv4_backend.vllm_compat import pipeline  # noqa: E402

pytestmark = pytest.mark.vllm

LAYOUT = KVCacheLayout.BLHNC  # what vLLM resolves for DeepSeek-V4 on CPU
# vLLM's own planner, also when an earlier test in this process let the plugin
# patch kv_cache_utils (the patch keeps it as __wrapped__).
VLLM_PLANNER = inspect.unwrap(kcu.get_kv_cache_config_from_groups)


def _vllm_config() -> Any:
    """The fields ``get_kv_cache_config_from_groups`` reads."""
    cache = types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: LAYOUT,
                                  num_gpu_blocks_override=None,
                                  prefix_cache_retention_interval=None)
    return types.SimpleNamespace(cache_config=cache,
                                 attention_config=types.SimpleNamespace(hisparse_config=None))


def _plan() -> tuple[list[KVCacheGroupSpec], list[dict[str, Any]]]:
    a = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    b = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    groups = [
        KVCacheGroupSpec(["s0.a", "s1.a"],
                         UniformTypeKVCacheSpecs(block_size=16,
                                                 kv_cache_specs={"s0.a": a, "s1.a": a})),
        KVCacheGroupSpec(["s1.b"], UniformTypeKVCacheSpecs(block_size=8,
                                                            kv_cache_specs={"s1.b": b})),
    ]
    return groups, [{"s0.a": a}, {"s1.a": a, "s1.b": b}]


def _patched() -> Any:
    """vLLM's planner behind the patch's wrapper, on a stand-in module."""
    module = types.ModuleType("stand_in_kv_cache_utils")
    module.get_kv_cache_config_from_groups = VLLM_PLANNER
    module.KVCacheConfig = kcu.KVCacheConfig
    applied: list[str] = []
    assert pipeline.install_stage_kv_cache(module, applied.append) is True
    assert applied and pipeline.install_stage_kv_cache(module, applied.append) is False
    return module.get_kv_cache_config_from_groups


def test_vllm_gives_stage_0_a_tensor_of_stage_1() -> None:
    groups, stages = _plan()
    stage0 = kcu._project_kv_cache_groups_to_worker(groups, stages[0])
    assert stage0[1].layer_names == []  # group B has no layer on stage 0 ...
    config = VLLM_PLANNER(_vllm_config(), stage0, 1 << 20)
    named = [name for t in config.kv_cache_tensors for name in t.layers]
    assert "s1.b" in named  # ... but vLLM lays out its spec's layer there
    with pytest.raises(StopIteration):
        allocate_kv_cache(config, torch.device("cpu"), LAYOUT)


def test_patched_stage_0_holds_only_its_layers() -> None:
    groups, stages = _plan()
    stage0 = kcu._project_kv_cache_groups_to_worker(groups, stages[0])
    vllm_config = VLLM_PLANNER(_vllm_config(), stage0, 1 << 20)
    config = _patched()(_vllm_config(), stage0, 1 << 20)
    assert [t.layers for t in config.kv_cache_tensors] == [["s0.a"]]
    # Everything else is vLLM's plan: the same blocks, groups and tensor geometry.
    assert config.num_blocks == vllm_config.num_blocks
    assert config.kv_cache_groups == vllm_config.kv_cache_groups
    assert config.kv_cache_tensors[0] == vllm_config.kv_cache_tensors[0]
    caches = allocate_kv_cache(config, torch.device("cpu"), LAYOUT)
    assert set(caches) == {"s0.a"}


def test_stage_with_every_group_keeps_vllms_plan() -> None:
    groups, stages = _plan()
    stage1 = kcu._project_kv_cache_groups_to_worker(groups, stages[1])
    original = VLLM_PLANNER(_vllm_config(), stage1, 1 << 20)
    config, dropped = pipeline.own_layer_tensors(original)
    assert config is original and dropped == []
    assert set(allocate_kv_cache(config, torch.device("cpu"), LAYOUT)) == {"s1.a", "s1.b"}
