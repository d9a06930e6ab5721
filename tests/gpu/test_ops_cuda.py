# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's torch kernels on CUDA against their CPU results (skipped
without CUDA; run by scripts/gpu_check.sh on a lent GPU, where there is no
vLLM). These are the ops the tests/cuda doubles stand in for vLLM's CUDA
kernel objects with: indexer q RoPE + FP8/MXFP4 quantization and the local ->
global top-k mapping, written into caller-owned (workspace-like) buffers."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_backend.ops import indexer as indexer_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_indexer_q_rope_quant_cuda_matches_cpu(dtype: str) -> None:
    g = torch.Generator().manual_seed(0)
    t = 64
    q = torch.randn(t, 64, 128, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), generator=g)
    cos_sin = torch.randn(4096, 64, generator=g)
    w = torch.randn(t, 64, generator=g)
    kw = dict(softmax_scale=128**-0.5, head_scale=64**-0.5, dtype=dtype)
    ref = indexer_ops.indexer_q_rope_quant(q, pos, cos_sin, w, **kw)
    got = indexer_ops.indexer_q_rope_quant(q.cuda(), pos.cuda(), cos_sin.cuda(), w.cuda(), **kw)
    torch.cuda.synchronize()
    assert torch.equal(_bytes(got.q), _bytes(ref.q))
    if dtype == "mxfp4":
        assert torch.equal(_bytes(got.q_scale), _bytes(ref.q_scale))
    torch.testing.assert_close(got.weights.cpu(), ref.weights, rtol=0, atol=0)


def test_local_to_global_cuda_matches_cpu_into_leased_buffers() -> None:
    g = torch.Generator().manual_seed(1)
    t, k = 32, 512
    local = torch.randint(-1, 400, (t, k), generator=g, dtype=torch.int32)
    token_to_req = torch.randint(0, 4, (t,), generator=g, dtype=torch.int32)
    table = torch.randperm(256, generator=g)[:4 * 32].view(4, 32).to(torch.int32)
    valid = torch.rand(t, generator=g) > 0.1
    ref_i, ref_l = indexer_ops.local_to_global(local, token_to_req, table, 16,
                                               is_valid_token=valid)
    # Row slices of a larger buffer, as a workspace lease hands them out.
    buf_i = torch.full((64, k), -7, dtype=torch.int32, device="cuda")
    buf_l = torch.full((64,), -7, dtype=torch.int32, device="cuda")
    indexer_ops.local_to_global(local.cuda(), token_to_req.cuda(), table.cuda(), 16,
                                out_indices=buf_i[:t], out_lens=buf_l[:t],
                                is_valid_token=valid.cuda())
    torch.cuda.synchronize()
    assert torch.equal(buf_i[:t].cpu(), ref_i) and torch.equal(buf_l[:t].cpu(), ref_l)
    assert bool((buf_i[t:] == -7).all()) and bool((buf_l[t:] == -7).all())
