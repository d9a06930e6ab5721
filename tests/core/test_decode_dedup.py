# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The deduplicated (prefill-shaped) decode path vs the float64 oracle.

A prompt's rows share window and compressed slots; the torch path then
dequantizes each distinct slot once. Same semantics as the entry-wise path:
only -1 / positions past topk_length are invalid, unnamed slots are NaN and
must never leak, sinks at +-inf and finite.
"""

import pytest
import torch

from tests.support.oracle import assert_flashmla_close, sparse_decode_ref
from vllm_dsv4_backend import ops
from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.ops import torch_sparse_mla


def _poisoned_cache(num_blocks, block_size, named, g):
    cache = fp8_ds_mla.allocate_cache(num_blocks, block_size, "cpu")
    nan_kv = torch.full((num_blocks * block_size, 512), float("nan"), dtype=torch.bfloat16)
    fp8_ds_mla.quantize_and_insert(nan_kv, cache, torch.arange(num_blocks * block_size))
    kv = (torch.randn(len(named), 512, generator=g) / 3).bfloat16()
    fp8_ds_mla.quantize_and_insert(kv, cache, named)
    return cache


@pytest.mark.parametrize("sink", ["finite", "+inf", "-inf"])
def test_prefill_shaped_decode_matches_oracle(monkeypatch, sink):
    g = torch.Generator().manual_seed(0)
    t, h, window, bs = 160, 8, 32, 16
    # Window rows: a sliding window over contiguous positions (heavy overlap).
    pos = torch.arange(t)
    local = (pos.view(-1, 1) - window + 1 + torch.arange(window)).clamp(min=-1)
    win = torch.where(local >= 0, local + 7, torch.full_like(local, -1)).int()  # slots 7..
    win_named = torch.unique(win[win >= 0])
    # Compressed: a few entries, some rows empty, lengths shorter than the width.
    comp = torch.randint(0, 12, (t, 64), generator=g).int() + 3
    comp_lens = torch.randint(0, 20, (t,), generator=g).int()
    comp[5] = -1
    comp_named = torch.unique(comp[:, :20][torch.arange(20) < comp_lens.view(-1, 1)])
    c1 = _poisoned_cache(20, bs, win_named.long(), g)
    c2 = _poisoned_cache(2, bs, comp_named.long(), g)
    q = torch.randn(t, 1, h, 512, generator=g).bfloat16()
    s = {"finite": torch.randn(h, generator=g), "+inf": torch.full((h,), float("inf")),
         "-inf": torch.full((h,), float("-inf"))}[sink]
    s[0] = 0.5
    win_lens = torch.full((t,), window, dtype=torch.int32)

    monkeypatch.setattr(torch_sparse_mla, "DEDUP_MIN_ENTRIES", 1)
    calls = []
    orig = torch_sparse_mla._decode_deduplicated
    monkeypatch.setattr(torch_sparse_mla, "_decode_deduplicated",
                        lambda *a, **k: calls.append(1) or orig(*a, **k))
    out, lse = ops.sparse_mla_decode(q, c1, win.view(t, 1, window), win_lens, s, 512**-0.5,
                                     c2, comp.view(t, 1, 64), comp_lens)
    assert calls, "the deduplicated path did not run"
    ref_out, ref_lse = sparse_decode_ref(
        q, [(c1, win.view(t, 1, window), win_lens), (c2, comp.view(t, 1, 64), comp_lens)],
        s, 512**-0.5,
    )
    assert_flashmla_close(out, ref_out, abs_tol=1e-3, rel_tol=2.01 / 128, cos_tol=5e-6,
                          name="out")
    assert_flashmla_close(lse, ref_lse, abs_tol=1e-5, rel_tol=8.01 / 65536, cos_tol=1e-6,
                          name="lse")
    assert not out.isnan().any()
