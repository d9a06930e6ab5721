# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""guards.tp_shape_problems: the tensor-parallel sizes DeepSeek-V4's per-rank
shapes cannot take are named, with the ones that work (vllm#40955:
DeepSeek-V4-Pro at TP 16, shared expert 3072 / 16 = 192 not a multiple of the
128-wide fp8 block)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dsv4_backend.vllm_compat.guards import tp_shape_problems

FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
# Attention and MoE widths per the published configs (shared/reference/).
FLASH = SimpleNamespace(num_attention_heads=64, o_groups=8, moe_intermediate_size=2048,
                        n_shared_experts=1, quantization_config=FP8)
PRO = SimpleNamespace(num_attention_heads=128, o_groups=16, moe_intermediate_size=3072,
                      n_shared_experts=1, quantization_config=FP8)
TINY = SimpleNamespace(num_attention_heads=8, o_groups=2, moe_intermediate_size=128,
                       n_shared_experts=1, quantization_config=None)


@pytest.mark.parametrize("cfg,tp", [(FLASH, 1), (FLASH, 4), (FLASH, 8), (PRO, 8), (TINY, 2)])
def test_supported_tp_sizes_pass(cfg, tp):
    assert tp_shape_problems(cfg, tp) == []
    assert tp_shape_problems(cfg, tp, expert_parallel=True) == []


def test_pro_at_tp16_names_the_shared_expert_and_the_sizes_that_work():
    problems = tp_shape_problems(PRO, 16, expert_parallel=True)
    assert problems[0] == ("moe_intermediate_size x n_shared_experts 3072 / 16 = 192 per rank "
                           "is not a multiple of the 128-wide fp8 block")
    assert problems[-1] == "tensor-parallel sizes that work for this model: [1, 2, 4, 8]"


def test_flash_at_tp16_names_o_groups():
    problems = tp_shape_problems(FLASH, 16)
    assert any(p.startswith("o_groups 8 / 16 = 0.5 per rank") for p in problems)
    assert "[1, 2, 4, 8]" in problems[-1]


def test_tp_not_dividing_the_heads():
    problems = tp_shape_problems(TINY, 3)
    assert problems[0] == "num_attention_heads 8 / 3 = 2.66667 per rank is not a whole number"
    # without expert parallel the routed experts must divide too
    assert any(p.startswith("moe_intermediate_size 128 / 3") for p in problems)
    assert not any(p.startswith("moe_intermediate_size 128 / 3")
                   for p in tp_shape_problems(TINY, 3, expert_parallel=True))
    assert "[1, 2]" in problems[-1] and "--enable-expert-parallel" in problems[-1]
