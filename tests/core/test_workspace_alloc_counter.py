# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""count_allocations(): counts what allocates, and nothing else."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_backend.workspace import count_allocations

A = torch.ones(4, 4)
B = torch.ones(4, 4)


def counted(fn) -> tuple[int, dict[str, int]]:
    with count_allocations() as c:
        fn()
    return c.count, dict(c.by_op)


@pytest.mark.parametrize(
    "name,fn,n",
    [
        ("a+b", lambda: A + B, 1),
        ("a+1", lambda: A + 1, 1),
        ("view", lambda: A.view(16), 0),
        ("slice", lambda: A[1:, :2], 0),
        ("transpose", lambda: A.t(), 0),
        ("split", lambda: A.split(2), 0),
        ("dtype view", lambda: A.view(torch.int32), 0),
        ("detach", lambda: A.detach(), 0),
        ("empty", lambda: torch.empty(3), 1),
        ("zeros", lambda: torch.zeros(3), 1),
        ("ones", lambda: torch.ones(3), 1),
        ("full", lambda: torch.full((3,), 2.0), 1),
        ("empty_strided", lambda: torch.empty_strided((2, 2), (1, 2)), 1),
        ("empty_like", lambda: torch.empty_like(A), 1),
        ("arange", lambda: torch.arange(5), 1),
        ("torch.tensor", lambda: torch.tensor([1, 2]), 1),
        ("clone", lambda: A.clone(), 1),
        ("contiguous (already)", lambda: A.contiguous(), 0),
        ("reshape non-contiguous", lambda: A.t().reshape(16), 1),
        ("matmul 3d", lambda: torch.ones(2, 3, 4) @ torch.ones(4, 5), 3),
        ("to same dtype", lambda: A.to(torch.float32), 0),
        ("to bf16", lambda: A.to(torch.bfloat16), 1),
        ("sum", lambda: A.sum(), 1),
        ("topk (values, indices)", lambda: A.topk(2), 2),
        ("cat", lambda: torch.cat([A, B]), 1),
    ],
)
def test_counts(name, fn, n):
    assert counted(fn)[0] == n, name


def test_out_and_inplace_count_zero():
    c_ = torch.empty(4, 4)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    vals = torch.empty(4, 2)

    def region():
        torch.add(A, B, out=c_)
        c_.add_(1)
        c_.fill_(0)
        c_.copy_(A)
        c_[1:].mul_(2)
        torch.topk(A, 2, out=(vals, idx))
        torch.sum(A, dim=0, out=c_[0])

    assert counted(region) == (0, {})


def test_by_op_and_bytes():
    with count_allocations() as c:
        _ = A + B
        _ = torch.empty(10, dtype=torch.uint8)
        _ = torch.zeros(2, 3, dtype=torch.bfloat16)
        _ = A.t().reshape(16)  # clone, then _unsafe_view shares its storage
    assert c.count == 4
    assert c.by_op == {"add": 1, "empty": 1, "zeros": 1, "clone": 1}
    assert c.nbytes == 64 + 10 + 12 + 64
    assert c.allocator_count is None


def test_counter_is_not_reentrant_and_nests():
    c = count_allocations()
    with c:
        with pytest.raises(RuntimeError, match="already active"):
            c.__enter__()
        with count_allocations() as inner:
            _ = A + B
        assert inner.count == 1
    assert c.count == 1  # the inner mode passes ops on to the outer one
