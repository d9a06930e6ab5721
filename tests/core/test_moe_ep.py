# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Expert parallel on the CPU build: global -> local expert ids for cpu_fused_moe.

vLLM 0.32's ``CPUUnquantizedExperts.apply`` ignores ``expert_map`` and passes
global ids to ``cpu_fused_moe``, which indexes past the rank's local weights
(SIGSEGV on the first request under ``--enable-expert-parallel``).
``moe_ep.local_expert_ids`` must make each rank compute exactly its own experts'
share, so that the all-reduce over ranks equals the unsharded MoE.
"""

import pytest
import torch

from vllm_dsv4_backend.vllm_compat.moe_ep import local_expert_ids

E, RANKS, T, K, D = 8, 2, 16, 3, 4


def _moe(x, weights, ids, experts):
    # A stand-in for cpu_fused_moe: sum_k w[t, k] * experts[ids[t, k]] @ x[t].
    return torch.einsum("tk,tkij,tj->ti", weights, experts[ids.long()], x)


def _expert_map(rank: int) -> torch.Tensor:
    m = torch.full((E,), -1, dtype=torch.int32)
    per = E // RANKS
    m[rank * per:(rank + 1) * per] = torch.arange(per, dtype=torch.int32)
    return m


def test_ranks_sum_to_the_unsharded_moe():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    experts = torch.randn(E, D, D, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    weights = torch.rand(T, K, generator=g, dtype=torch.float64)
    full = _moe(x, weights, ids, experts)
    total = torch.zeros_like(full)
    per = E // RANKS
    for rank in range(RANKS):
        local_ids, local_w = local_expert_ids(ids, weights, _expert_map(rank))
        assert local_ids.dtype == ids.dtype
        assert int(local_ids.min()) >= 0 and int(local_ids.max()) < per  # never out of range
        total += _moe(x, local_w, local_ids, experts[rank * per:(rank + 1) * per])
    torch.testing.assert_close(total, full, rtol=0, atol=1e-12)
    # The unpatched call (global ids into local weights) reads out of range.
    assert int(ids.max()) >= per


def test_remote_experts_get_zero_weight():
    ids = torch.tensor([[0, 5], [7, 1]], dtype=torch.int32)
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    local_ids, local_w = local_expert_ids(ids, w, _expert_map(0))
    assert local_ids.tolist() == [[0, 0], [0, 1]]
    assert local_w.tolist() == [[0.25, 0.0], [0.0, 0.5]]


@pytest.mark.parametrize("bad", [-1, E])
def test_out_of_range_ids_raise(bad):
    ids = torch.tensor([[0, bad]], dtype=torch.int32)
    with pytest.raises(ValueError, match="global expert ids"):
        local_expert_ids(ids, torch.ones(1, 2), _expert_map(0))
