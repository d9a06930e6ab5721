# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""q/kv preparation and output de-rotation vs float64 math."""

import math

import pytest
import torch

from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.ops.rope import inverse_rope_, qnorm_rope_kv_insert

R = 64


def _cos_sin_cache(max_pos=300, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([f.cos(), f.sin()], -1).float()


def _rope64(x, pos, cache, sign=1.0):
    # Scalar-order float64 oracle of GPT-J RoPE on the last 64 dims.
    x = x.double().clone()
    base = x.shape[-1] - R
    for t in range(x.shape[0]):
        for i in range(R // 2):
            c, s = float(cache[pos[t], i]), sign * float(cache[pos[t], R // 2 + i])
            e, o = x[t, ..., base + 2 * i].clone(), x[t, ..., base + 2 * i + 1].clone()
            x[t, ..., base + 2 * i] = e * c - o * s
            x[t, ..., base + 2 * i + 1] = o * c + e * s
    return x


@pytest.mark.parametrize("heads,padded", [(8, 8), (3, 64)])
def test_qnorm_rope_kv_insert(heads, padded):
    torch.manual_seed(0)
    t, bs = 5, 61
    cache_tab = _cos_sin_cache()
    q = torch.randn(t, heads, 512).bfloat16()
    kv = torch.randn(t, 512).bfloat16()
    pos = torch.tensor([0, 1, 127, 128, 299])
    cache = fp8_ds_mla.allocate_cache(3, bs, "cpu")
    cache.view(torch.uint8).fill_(0xAB)
    slots = torch.tensor([5, -1, 60, 61, 150])
    out = torch.full((t + 2, padded, 512), float("nan"), dtype=torch.bfloat16)
    res = qnorm_rope_kv_insert(q, kv, pos, cache, slots, cache_tab, 1e-6, out_q=out)
    assert res.data_ptr() == out.data_ptr()

    qd = q.double()
    qd = qd / torch.sqrt(qd.square().mean(-1, keepdim=True) + 1e-6)
    ref_q = _rope64(qd, pos, cache_tab)
    torch.testing.assert_close(out[:t, :heads].double(), ref_q, atol=2e-2, rtol=1e-2)
    assert (out[:t, heads:] == 0).all()
    assert out[t:].isnan().all()  # rows past T untouched

    ref_kv = _rope64(kv.double()[:, None], pos, cache_tab)[:, 0].bfloat16()
    valid = slots >= 0
    got = fp8_ds_mla.dequantize_and_gather(cache, slots[valid].int())
    fresh = _fresh_insert(ref_kv[valid], bs)
    want = fp8_ds_mla.dequantize_and_gather(fresh, torch.arange(int(valid.sum())).int())
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0)


def _fresh_insert(kv, bs):
    c = fp8_ds_mla.allocate_cache(math.ceil(len(kv) / bs), bs, "cpu")
    fp8_ds_mla.quantize_and_insert(kv, c, torch.arange(len(kv)))
    return c


def test_inverse_rope_undoes_rope():
    torch.manual_seed(1)
    cache_tab = _cos_sin_cache()
    o = torch.randn(4, 2, 512)
    pos = torch.tensor([3, 77, 200, 299])
    rotated = _rope64(o, pos, cache_tab).float()
    back = inverse_rope_(rotated, pos, cache_tab)
    torch.testing.assert_close(back, o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back.double(), _rope64(rotated, pos, cache_tab, sign=-1.0),
                               atol=1e-5, rtol=1e-5)
