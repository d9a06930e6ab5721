# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Indexer K cache formats and indexer ops against independent oracles.

Oracles (tests.support.indexer): exact ``Fraction`` arithmetic for the FP8 rules
(e4m3 values enumerated from the bit layout, RNE by explicit nearest search) and for
the q-side RoPE (FMA rounding), float64 math over bytes read back by hand for the
logits; here, Python sorting for top-k, Python loops for the slot mapping. The
comparisons with vLLM's C++ CPU kernels (``torch.ops._C.*_cpu``) live in
tests/vllm/test_indexer_vllm_kernels.py (tests/core stays torch-only); they build
their cases with the same support module.
"""

from __future__ import annotations

import heapq
import struct
from fractions import Fraction

import pytest
import torch

from tests.support.indexer import (
    POISON,
    PagedCase,
    decode_entry_f64,
    f32,
    fr_list,
    make_cache,
    oracle_fp8_row,
    oracle_rope_row,
    q_inputs,
    read_entry_bytes,
)
from vllm_dsv4_backend.formats import indexer_cache as ic
from vllm_dsv4_backend.formats import mxfp4
from vllm_dsv4_backend.ops import indexer as ix


# ---------------------------------------------------------------------------
# formats.indexer_cache
# ---------------------------------------------------------------------------
def test_entry_sizes():
    assert ic.entry_bytes("fp8") == 132 and ic.entry_bytes("mxfp4") == 68
    assert (ic.value_bytes("fp8"), ic.scale_bytes("fp8")) == (128, 4)
    assert (ic.value_bytes("mxfp4"), ic.scale_bytes("mxfp4")) == (64, 4)
    for bad in ("fp4", "bf16", None):
        with pytest.raises(ValueError, match="dtype"):
            ic.entry_bytes(bad)


def _fp8_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(24, 128, generator=g) * torch.exp2(
        torch.randint(-30, 12, (24, 1), generator=g).float()
    )
    rows[0] = 0.0  # floor: scale 2**-22, zero bytes
    rows[1] = 1e-7  # below the floor: tiny values into e4m3 subnormals / zero
    rows[2, :] = 0.001
    rows[2, 5] = 448.0 * 2.0**-3  # amax exactly on a power-of-two boundary
    rows[3, :] = torch.linspace(-3, 3, 128)
    rows[3, 7] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))  # 1 ulp above
    rows[4, :64] = -0.0
    return rows


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_fp8_rows_match_exact_oracle(in_dtype):
    rows = _fp8_rows().to(in_dtype)
    vals, scl = ic.quantize_rows(rows, "fp8")
    assert vals.shape == (24, 128) and scl.shape == (24, 4)
    assert vals.dtype == torch.uint8 and scl.dtype == torch.uint8
    for r in range(rows.shape[0]):
        want_b, want_s = oracle_fp8_row(fr_list(rows[r].float()),
                                        torch.signbit(rows[r]).tolist())
        assert vals[r].tolist() == want_b, r
        assert Fraction(struct.unpack("<f", bytes(scl[r].tolist()))[0]) == want_s, r
    assert struct.unpack("<f", bytes(scl[0].tolist()))[0] == 2.0**-22
    assert struct.unpack("<f", bytes(scl[2].tolist()))[0] == 2.0**-3
    assert struct.unpack("<f", bytes(scl[3].tolist()))[0] == (2.0 if in_dtype == torch.float32
                                                             else 1.0)


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
@pytest.mark.parametrize("form", ["3d", "4d", "padded"])
def test_block_split_layout_and_untouched_bytes(dtype, form):
    nb, bs = 5, 4
    pad = 36 if form == "padded" else 0
    backing, cache = make_cache(dtype, nb, bs, pad, four_d=form == "4d")
    g = torch.Generator().manual_seed(5)
    k = torch.randn(7, 128, generator=g).bfloat16()
    slots = torch.tensor([0, 3, -1, 7, 19, 12, -1], dtype=torch.int32)
    ic.quantize_and_insert(k, cache, slots, dtype)
    want_v, want_s = ic.quantize_rows(k, dtype)
    if dtype == "mxfp4":
        p, s = mxfp4.quantize(k)
        assert torch.equal(want_v, p) and torch.equal(want_s, s)
    touched = torch.zeros_like(backing, dtype=torch.bool)
    vb, sb = ic.value_bytes(dtype), ic.scale_bytes(dtype)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, bs)
        # values of entry o at o*vb, scales after all bs values at bs*vb + o*sb
        assert torch.equal(backing[b, o * vb : (o + 1) * vb], want_v[i])
        assert torch.equal(backing[b, bs * vb + o * sb : bs * vb + (o + 1) * sb], want_s[i])
        touched[b, o * vb : (o + 1) * vb] = True
        touched[b, bs * vb + o * sb : bs * vb + (o + 1) * sb] = True
    assert (backing[~touched] == POISON).all()


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
@pytest.mark.parametrize("pad", [24, 20, 1])  # block strides gathered as int64 / int32 / bytes
def test_dequantize_and_gather(dtype, pad):
    nb, bs = 6, 8
    backing, cache = make_cache(dtype, nb, bs, pad=pad)
    g = torch.Generator().manual_seed(9)
    k = torch.randn(20, 128, generator=g) * 3
    slots = torch.randperm(nb * bs, generator=g)[:20]
    ic.quantize_and_insert(k, cache, slots, dtype)
    query = torch.cat([slots[:10], torch.tensor([-1]), slots[10:]]).long()
    out = torch.full((21, 128), 7.0)
    got = ic.dequantize_and_gather(cache, query, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    for i, s in enumerate(query.tolist()):
        if s < 0:
            # nothing is read for a skipped slot, so the poison cannot leak
            assert (got[i] == 0).all()
            continue
        want = decode_entry_f64(dtype, *read_entry_bytes(backing, dtype, bs, s))
        assert torch.equal(got[i].double(), want), i
    # error bounds relative to the row max: FP8 half-ulp of e4m3 (2**-4 of 448 * scale,
    # scale < 2 * amax / 448); MXFP4 half the widest grid gap (1 of 6 * scale,
    # scale < 2 * block amax / 6)
    deq = ic.dequantize_and_gather(cache, slots, dtype)
    err = (deq - k).abs().amax(dim=1) / k.abs().amax(dim=1)
    assert (err <= (1 / 8 if dtype == "fp8" else 1 / 3)).all()


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_non_finite_rows_dequantize_to_nan(dtype):
    _, cache = make_cache(dtype, 2, 4)
    k = torch.randn(3, 128)
    k[0, 3] = float("nan")
    k[1, 100] = float("inf")
    ic.quantize_and_insert(k, cache, torch.tensor([0, 1, 2]), dtype)
    got = ic.dequantize_and_gather(cache, torch.tensor([0, 1, 2]), dtype)
    if dtype == "fp8":
        assert torch.isnan(got[0]).all()
        assert torch.isnan(got[1]).all()
    else:
        assert torch.isnan(got[0, :32]).all() and not torch.isnan(got[0, 32:]).any()
        assert got[1, 100].item() == float("inf")
    assert torch.isfinite(got[2]).all()


def test_format_bad_inputs():
    _, cache = make_cache("fp8", 2, 4)
    k = torch.randn(2, 128)
    with pytest.raises(ValueError, match="'cache'"):
        ic.quantize_and_insert(k, cache, torch.tensor([0, 1]), "mxfp4")  # 132 B rows
    with pytest.raises(ValueError, match="'cache'"):
        ic.quantize_and_insert(k, cache.float(), torch.tensor([0, 1]), "fp8")
    with pytest.raises(ValueError, match="'cache'"):
        ic.quantize_and_insert(k, cache[:, ::2], torch.tensor([0, 1]), "fp8")
    with pytest.raises(ValueError, match="'k'"):
        ic.quantize_and_insert(torch.randn(2, 64), cache, torch.tensor([0, 1]), "fp8")
    with pytest.raises(ValueError, match="'k'"):
        ic.quantize_and_insert(k.double(), cache, torch.tensor([0, 1]), "fp8")
    with pytest.raises(ValueError, match="'slots'"):
        ic.quantize_and_insert(k, cache, torch.tensor([0.0, 1.0]), "fp8")
    with pytest.raises(ValueError, match="'slots'"):
        ic.quantize_and_insert(k, cache, torch.tensor([0, 1, 2]), "fp8")
    with pytest.raises(ValueError, match="< num_blocks"):
        ic.quantize_and_insert(k, cache, torch.tensor([0, 8]), "fp8")
    with pytest.raises(ValueError, match="< num_blocks"):
        ic.dequantize_and_gather(cache, torch.tensor([9]), "fp8")
    with pytest.raises(ValueError, match="'out'"):
        ic.dequantize_and_gather(cache, torch.tensor([1]), "fp8", out=torch.empty(2, 128))
    with pytest.raises(ValueError, match="dtype"):
        ic.dequantize_and_gather(cache, torch.tensor([1]), "e4m3")


# ---------------------------------------------------------------------------
# ops.indexer.indexer_q_rope_quant
# ---------------------------------------------------------------------------
def _rope_oracle(q, pos, cos_sin):
    rows = {}
    for t in range(q.shape[0]):
        cs = cos_sin[int(pos[t])]
        c, s = fr_list(cs[:32]), fr_list(cs[32:])
        for h in range(q.shape[1]):
            rows[t, h] = oracle_rope_row(fr_list(q[t, h].float()), c, s)
    return rows


def test_q_rope_quant_fp8_exact():
    t, h = 3, 4
    q, pos, cos_sin, w = q_inputs(t, h, 1)
    ss, hs = 128**-0.5, 64**-0.5
    res = ix.indexer_q_rope_quant(q, pos, cos_sin, w, softmax_scale=ss, head_scale=hs,
                                  dtype="fp8")
    assert res.q.dtype == torch.float8_e4m3fn and res.q.shape == (t, h, 128)
    assert res.q_scale is None and res.weights.dtype == torch.float32
    roped = _rope_oracle(q, pos, cos_sin)
    qb = res.q.view(torch.uint8)
    for (ti, hi), row in roped.items():
        want_b, want_s = oracle_fp8_row(row)
        assert qb[ti, hi].tolist() == want_b, (ti, hi)
        ww = f32(f32(f32(Fraction(float(w[ti, hi])) * want_s) * f32(Fraction(ss)))
                 * f32(Fraction(hs)))
        assert Fraction(res.weights[ti, hi].item()) == ww, (ti, hi)


def test_q_rope_quant_mxfp4_exact():
    t, h = 3, 4
    q, pos, cos_sin, w = q_inputs(t, h, 2)
    ss, hs = 0.0883883, 0.125
    res = ix.indexer_q_rope_quant(q, pos, cos_sin, w, softmax_scale=ss, head_scale=hs,
                                  dtype="mxfp4")
    assert res.q.shape == (t, h, 64) and res.q_scale.shape == (t, h, 4)
    roped = _rope_oracle(q, pos, cos_sin)
    for (ti, hi), row in roped.items():
        p, s = mxfp4.quantize(torch.tensor([float(x) for x in row], dtype=torch.float32))
        assert torch.equal(res.q[ti, hi], p) and torch.equal(res.q_scale[ti, hi], s)
        ww = f32(f32(Fraction(float(w[ti, hi])) * f32(Fraction(ss))) * f32(Fraction(hs)))
        assert Fraction(res.weights[ti, hi].item()) == ww


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_q_rope_is_gptj_on_last_64_and_out_buffers(dtype):
    """Real shapes: rotation = complex multiply of (even, odd) pairs of dims 64..127."""
    t, h = 6, 64
    q, pos, _, w = q_inputs(t, h, 3)
    inv_freq = 1.0 / (160000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ang = torch.arange(2048, dtype=torch.float64)[:, None] * inv_freq
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).float()
    if dtype == "fp8":
        out = (torch.empty(t, h, 128, dtype=torch.float8_e4m3fn), None, torch.empty(t, h))
    else:
        out = (torch.empty(t, h, 64, dtype=torch.uint8), torch.empty(t, h, 4, dtype=torch.uint8),
               torch.empty(t, h))
    res = ix.indexer_q_rope_quant(q, pos.int(), cos_sin, w, softmax_scale=1.0, head_scale=1.0,
                                  dtype=dtype, out=out)
    assert res.q.data_ptr() == out[0].data_ptr() and res.weights.data_ptr() == out[2].data_ptr()
    x = q.double()
    z = torch.view_as_complex(x[..., 64:].reshape(t, h, 32, 2).contiguous())
    rot = z * torch.polar(torch.ones_like(ang[pos]), ang[pos])[:, None, :]
    want = torch.cat([x[..., :64], torch.view_as_real(rot).reshape(t, h, 64)], dim=-1)
    if dtype == "fp8":
        scale = (res.weights.double() / w.double()).unsqueeze(-1)
        deq = res.q.double() * scale
        tol = scale * 448 / 16  # e4m3 half ulp at the row scale, + bf16 rounding
    else:
        deq = mxfp4.dequantize(res.q, res.q_scale).double()
        s = torch.exp2(res.q_scale.double() - 127).repeat_interleave(32, dim=-1)
        tol = s * 1.0 + want.abs() * 2**-8
        assert torch.equal(res.weights, w.float())
    assert ((deq - want).abs() <= tol).all()


# (x_even, x_odd, cos, sin) float32 bit patterns where the FMA rounding of vLLM's C++
# kernel and plain float32 mul/sub give different bf16 results (found by search).
FMA_CASES = [
    (0xBFCB0000, 0xBFA20000, 0x3F1FADD0, 0x3F4818B8),
    (0xBFFA0000, 0xBEBD0000, 0xBE3E4224, 0xBF7B8ADF),
    (0x3E590000, 0x3EB10000, 0x3F04DE02, 0xBF5AD1FC),
    (0x3F110000, 0x3F960000, 0xBF0DC0BF, 0x3F552BEB),
    (0xBE8F0000, 0x3D760000, 0xBE56FBB9, 0x3F7A4B6B),
    (0xBE210000, 0xBF400000, 0x3F7A8BA1, 0x3E5241AB),
    (0x3E3B0000, 0xBF9D0000, 0xBF7D3714, 0x3E16A150),
    (0xBF670000, 0xBF9D0000, 0x3F17ACBF, 0xBF4E3AD9),
]


def test_rope_uses_fma_rounding():
    from vllm_dsv4_backend.ops import rope

    bits = torch.tensor(FMA_CASES, dtype=torch.int64).to(torch.int32).view(torch.float32)
    xe, xo, c, s = bits.unbind(1)
    x = torch.stack([xe, xo], dim=-1).reshape(len(FMA_CASES), 1, 2)
    got = x.clone()
    rope.gptj_rope_fma_(got, c[:, None, None], s[:, None, None])
    got = got.bfloat16().float().reshape(-1, 2)
    plain = torch.stack([xe * c - xo * s, xo * c + xe * s], dim=-1).bfloat16().float()
    assert not torch.equal(got, plain)  # the cases do discriminate
    for i in range(len(FMA_CASES)):
        want = oracle_rope_row(fr_list(x[i, 0]), fr_list(c[i : i + 1]), fr_list(s[i : i + 1]))
        assert [Fraction(v) for v in got[i].tolist()] == want, i


def test_q_rope_quant_bad_inputs():
    q, pos, cos_sin, w = q_inputs(2, 4, 4)
    kw = dict(softmax_scale=1.0, head_scale=1.0)
    with pytest.raises(ValueError, match="'q'"):
        ix.indexer_q_rope_quant(q[0], pos, cos_sin, w, dtype="fp8", **kw)
    with pytest.raises(ValueError, match="'positions'"):
        ix.indexer_q_rope_quant(q, pos.float(), cos_sin, w, dtype="fp8", **kw)
    with pytest.raises(ValueError, match="'weights'"):
        ix.indexer_q_rope_quant(q, pos, cos_sin, w[:, :3], dtype="fp8", **kw)
    with pytest.raises(ValueError, match="'positions'"):
        ix.indexer_q_rope_quant(q, pos + 1024, cos_sin, w, dtype="fp8", **kw)
    with pytest.raises(ValueError, match="RoPE"):
        ix.indexer_q_rope_quant(q, pos, cos_sin[:, :63], w, dtype="fp8", **kw)
    with pytest.raises(ValueError, match="dtype"):
        ix.indexer_q_rope_quant(q, pos, cos_sin, w, dtype="int8", **kw)
    with pytest.raises(ValueError, match="out.q_scale"):
        ix.indexer_q_rope_quant(
            q, pos, cos_sin, w, dtype="fp8", **kw,
            out=(torch.empty(2, 4, 128, dtype=torch.float8_e4m3fn),
                 torch.empty(2, 4, 4, dtype=torch.uint8), torch.empty(2, 4)))
    with pytest.raises(ValueError, match="out.q"):
        ix.indexer_q_rope_quant(
            q, pos, cos_sin, w, dtype="mxfp4", **kw,
            out=(torch.empty(2, 4, 128, dtype=torch.uint8),
                 torch.empty(2, 4, 4, dtype=torch.uint8), torch.empty(2, 4)))


# ---------------------------------------------------------------------------
# ops.indexer.indexer_logits
# ---------------------------------------------------------------------------
def _assert_logits_close(got: torch.Tensor, want: torch.Tensor):
    assert got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    scale = want[fin].abs().max().clamp(min=1e-30)
    assert ((got.double()[fin] - want[fin]).abs() <= 1e-5 * want[fin].abs() + 1e-6 * scale).all()


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_logits_match_float64_oracle(dtype):
    case = PagedCase(dtype, seed=11)
    want = case.oracle()
    # row whose seq_len runs past the allocated blocks (-1 in the table)
    assert torch.isneginf(want[3, 8:]).all() and torch.isfinite(want[3, :8]).all()
    assert torch.isfinite(want[6]).all() and torch.isneginf(want[0]).all()
    got = ix.indexer_logits(case.q.q, case.q.q_scale, case.q.weights, case.cache,
                            case.seq_lens, case.block_table, dtype=dtype,
                            token_to_req=case.token_to_req)
    _assert_logits_close(got, want)
    # per-token page tables (the fp8_paged_mqa_logits_cpu convention), int32 q_scale view,
    # tiny chunks, a wider NaN-filled out buffer whose extra columns stay untouched
    pages = case.block_table[case.token_to_req]
    qs = None if case.q.q_scale is None else case.q.q_scale.view(torch.int32).squeeze(-1)
    out = torch.full((want.shape[0], want.shape[1] + 5), float("nan"))
    got2 = ix.indexer_logits(case.q.q, qs, case.q.weights, case.cache, case.seq_lens.long(),
                             pages, dtype=dtype, out=out, max_seq_len=want.shape[1],
                             max_chunk_elems=64 * 8)
    assert got2.data_ptr() == out.data_ptr()
    assert torch.isnan(out[:, want.shape[1]:]).all()
    _assert_logits_close(got2, want)
    torch.testing.assert_close(got2, got, rtol=1e-6, atol=1e-6 * float(got[got.isfinite()]
                                                                       .abs().max()))
    # chunks of two tokens: some hold one request only (the shared-K GEMM path on CPU)
    got3 = ix.indexer_logits(case.q.q, case.q.q_scale, case.q.weights, case.cache,
                             case.seq_lens, case.block_table, dtype=dtype,
                             token_to_req=case.token_to_req,
                             max_chunk_elems=2 * 64 * want.shape[1])
    _assert_logits_close(got3, want)
    # a prefill of one request only (every chunk shared)
    rows = torch.tensor([6, 7, 8])
    qs3 = None if case.q.q_scale is None else case.q.q_scale[rows]
    got4 = ix.indexer_logits(case.q.q[rows], qs3, case.q.weights[rows], case.cache,
                             case.seq_lens[rows], case.block_table, dtype=dtype,
                             token_to_req=case.token_to_req[rows])
    _assert_logits_close(got4, want[rows])
    # the format follows from q's dtype when not named
    got5 = ix.indexer_logits(case.q.q, case.q.q_scale, case.q.weights, case.cache,
                             case.seq_lens, case.block_table, token_to_req=case.token_to_req)
    assert torch.equal(got5, got)


def test_logits_empty_and_degenerate():
    case = PagedCase("fp8", seed=12, heads=64)
    t = case.q.weights.shape[0]
    zeros = torch.zeros(t, dtype=torch.int32)
    got = ix.indexer_logits(case.q.q, None, case.q.weights, case.cache, zeros,
                            case.block_table, dtype="fp8", token_to_req=case.token_to_req,
                            max_seq_len=16)
    assert got.shape == (t, 16) and torch.isneginf(got).all()
    none = ix.indexer_logits(case.q.q[:0], None, case.q.weights[:0], case.cache, zeros[:0],
                             case.block_table, dtype="fp8", token_to_req=case.token_to_req[:0])
    assert none.shape == (0, 0)


def test_logits_bad_inputs():
    case = PagedCase("fp8", seed=13, heads=64)
    q, w = case.q.q, case.q.weights
    args = (case.cache, case.seq_lens, case.block_table)
    kw = dict(dtype="fp8", token_to_req=case.token_to_req)
    with pytest.raises(ValueError, match="'q'"):
        ix.indexer_logits(q.view(torch.uint8), None, w, *args, **kw)
    with pytest.raises(ValueError, match="'q_scale'"):
        ix.indexer_logits(q, torch.zeros(1), w, *args, **kw)
    with pytest.raises(ValueError, match="'weights'"):
        ix.indexer_logits(q, None, w.bfloat16(), *args, **kw)
    with pytest.raises(ValueError, match="'seq_lens'"):
        ix.indexer_logits(q, None, w, case.cache, case.seq_lens[:3], case.block_table, **kw)
    with pytest.raises(ValueError, match="'block_table'"):
        ix.indexer_logits(q, None, w, case.cache, case.seq_lens, case.block_table, dtype="fp8")
    with pytest.raises(ValueError, match="'cache'"):
        ix.indexer_logits(q, None, w, *args, dtype="mxfp4", token_to_req=case.token_to_req)
    with pytest.raises(ValueError, match="'out'"):
        ix.indexer_logits(q, None, w, *args, **kw, out=torch.empty(10, 3), max_seq_len=70)


# ---------------------------------------------------------------------------
# ops.indexer.indexer_topk
# ---------------------------------------------------------------------------
def topk_oracle(logits: torch.Tensor, n: list[int], topk: int) -> list[list[int]]:
    """A literal run of vLLM's C++ streaming min-heap (``topk_transform_512_cpu``).

    The first ``topk`` entries fill the heap; a later entry replaces the minimum
    only if strictly greater; the minimum evicted is the lowest-indexed of the
    minimal scores (``heapq`` on ``(score, index)`` pops exactly that one). The
    kept set is then listed by score descending, equal scores by index.
    """
    rows = []
    for i, ni in enumerate(n):
        if ni <= topk:
            rows.append(list(range(ni)) + [-1] * (topk - ni))
            continue
        vals = logits[i, :ni].tolist()
        key = [float("-inf") if v != v else v + 0.0 for v in vals]  # NaN ranks as -inf
        heap = [(key[j], j) for j in range(topk)]
        heapq.heapify(heap)
        for j in range(topk, ni):
            if key[j] > heap[0][0]:
                heapq.heapreplace(heap, (key[j], j))
        rows.append(sorted((j for _, j in heap), key=lambda j: (-key[j], j)))
    return rows


@pytest.mark.parametrize("topk", [4, 16])
def test_topk_matches_oracle_with_ties_nan_and_garbage(topk):
    g = torch.Generator().manual_seed(21)
    width = 40
    positions = torch.tensor([0, 3, 15, 16, 17, 67, 68, 100, 159, 163, 400, 70, 71, 72],
                             dtype=torch.int64)
    t = len(positions)
    # few distinct values -> many ties; signed zeros; NaN and -inf inside the valid range
    logits = (torch.randint(-3, 4, (t, width), generator=g).float() * 0.5)
    logits[:, ::5] = -0.0
    logits[5, 3] = float("nan")
    logits[6, :] = float("-inf")
    logits[7, 2] = float("inf")
    n = ((positions + 1) // 4).clamp(max=width).tolist()
    for i, ni in enumerate(n):  # garbage beyond the visible range must be ignored
        logits[i, ni:] = float("inf") if i % 2 else float("nan")
    got = ix.indexer_topk(logits, positions, topk)
    assert got.dtype == torch.int32 and got.shape == (t, topk)
    assert got.tolist() == topk_oracle(logits, n, topk)
    out = torch.full((t, topk), 99, dtype=torch.int32)
    got2 = ix.indexer_topk(logits, None, topk, seq_lens=torch.tensor(n, dtype=torch.int32),
                           out=out, max_chunk_elems=width * 3)
    assert got2.data_ptr() == out.data_ptr() and torch.equal(got2, got)


def test_topk_wider_than_logits_and_empty():
    logits = torch.randn(3, 5)
    got = ix.indexer_topk(logits, torch.tensor([3, 11, 400]), 8)
    assert got.tolist() == [[0, -1, -1, -1, -1, -1, -1, -1],
                            [0, 1, 2, -1, -1, -1, -1, -1],
                            [0, 1, 2, 3, 4, -1, -1, -1]]
    assert ix.indexer_topk(torch.randn(0, 5), torch.zeros(0, dtype=torch.long), 8).shape == (0, 8)


def test_topk_bad_inputs():
    with pytest.raises(ValueError, match="'logits'"):
        ix.indexer_topk(torch.randn(4), torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="'positions'"):
        ix.indexer_topk(torch.randn(4, 8), torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="'topk'"):
        ix.indexer_topk(torch.randn(4, 8), torch.zeros(4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="'out'"):
        ix.indexer_topk(torch.randn(4, 8), torch.zeros(4, dtype=torch.long), 2,
                        out=torch.empty(4, 2, dtype=torch.int64))


# ---------------------------------------------------------------------------
# ops.indexer.local_to_global
# ---------------------------------------------------------------------------
def mapping_oracle(local, req, bt, bs, valid_tok=None):
    glob, lens = [], []
    for i, row in enumerate(local.tolist()):
        r = int(req[i])
        out = []
        for j in row:
            if j < 0 or j // bs >= bt.shape[1] or int(bt[r, j // bs]) < 0:
                out.append(-1)
            else:
                out.append(int(bt[r, j // bs]) * bs + j % bs)
        glob.append(out)
        cnt = sum(1 for j in row if j >= 0)
        lens.append(cnt if valid_tok is None or bool(valid_tok[i]) else 0)
    return glob, lens


@pytest.mark.parametrize("bs", [1, 2, 64])
def test_local_to_global_matches_oracle(bs):
    g = torch.Generator().manual_seed(41 + bs)
    r, max_blocks, t, k = 4, 6, 9, 12
    bt = torch.randint(0, 50, (r, max_blocks), generator=g).int()
    bt[1, 3:] = -1  # unallocated tail
    bt[2, 0] = -1  # unallocated hole
    local = torch.randint(0, max_blocks * bs + bs, (t, k), generator=g)  # some past the table
    local[:, 8:] = -1
    local[4] = -1  # empty row
    req = torch.randint(0, r, (t,), generator=g)
    valid_tok = torch.ones(t, dtype=torch.bool)
    valid_tok[7] = False
    gi, gl = ix.local_to_global(local, req, bt, bs, is_valid_token=valid_tok)
    want_g, want_l = mapping_oracle(local, req, bt, bs, valid_tok)
    assert gi.dtype == torch.int32 and gl.dtype == torch.int32
    assert gi.tolist() == want_g and gl.tolist() == want_l
    # in place over an int32 local buffer, with caller-owned lens
    buf = local.int().clone()
    lens = torch.full((t,), 77, dtype=torch.int32)
    gi2, gl2 = ix.local_to_global(buf, req.int(), bt.long(), bs, buf, lens)
    assert gi2.data_ptr() == buf.data_ptr() and gl2.data_ptr() == lens.data_ptr()
    assert gi2.tolist() == want_g
    assert gl2.tolist() == mapping_oracle(local, req, bt, bs)[1]


def test_local_to_global_bad_inputs():
    local = torch.zeros(3, 4, dtype=torch.int32)
    req = torch.zeros(3, dtype=torch.int32)
    bt = torch.zeros(2, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="'block_size'"):
        ix.local_to_global(local, req, bt, 0)
    with pytest.raises(ValueError, match="'token_to_req'"):
        ix.local_to_global(local, req[:2], bt, 4)
    with pytest.raises(ValueError, match="'out_indices'"):
        ix.local_to_global(local, req, bt, 4, torch.empty(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="'out_lens'"):
        ix.local_to_global(local, req, bt, 4, None, torch.empty(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="'block_table'"):
        ix.local_to_global(local, req, bt.float(), 4)


# ---------------------------------------------------------------------------
# whole step: nothing allocated by factory ops once buffers are given
# ---------------------------------------------------------------------------
_FACTORY = {"empty", "empty_strided", "empty_like", "zeros", "zeros_like", "ones", "ones_like",
            "full", "full_like", "arange", "new_empty", "new_zeros", "new_full", "new_ones",
            "new_empty_strided", "scalar_tensor", "lift_fresh", "randn", "rand", "linspace"}


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_step_with_buffers_calls_no_factory_op(dtype):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    case = PagedCase(dtype, seed=51)
    t, h = case.q.weights.shape
    g = torch.Generator().manual_seed(52)
    qin = torch.randn(t, h, 128, generator=g).bfloat16()
    cos_sin = torch.randn(512, 64, generator=g)
    w = torch.randn(t, h, generator=g).bfloat16()
    bufs = ((torch.empty(t, h, 128, dtype=torch.float8_e4m3fn), None, torch.empty(t, h))
            if dtype == "fp8" else
            (torch.empty(t, h, 64, dtype=torch.uint8), torch.empty(t, h, 4, dtype=torch.uint8),
             torch.empty(t, h)))
    width = 80
    logits = torch.empty(t, width)
    local = torch.empty(t, 8, dtype=torch.int32)
    glob = torch.empty(t, 8, dtype=torch.int32)
    lens = torch.empty(t, dtype=torch.int32)

    def step():
        qq = ix.indexer_q_rope_quant(qin, case.positions, cos_sin, w, softmax_scale=0.1,
                                     head_scale=0.125, dtype=dtype, out=bufs)
        ix.indexer_logits(qq.q, qq.q_scale, qq.weights, case.cache, case.seq_lens,
                          case.block_table, dtype=dtype, token_to_req=case.token_to_req,
                          out=logits)
        ix.indexer_topk(logits, case.positions, 8, out=local)
        ix.local_to_global(local, case.token_to_req, case.block_table, case.bs, glob, lens)

    step()  # warm-up builds the cached constants
    spy = Spy()
    with spy:
        step()
    assert not _FACTORY.intersection(spy.seen), sorted(_FACTORY.intersection(spy.seen))
    want = mapping_oracle(local, case.token_to_req, case.block_table, case.bs)
    assert glob.tolist() == want[0] and lens.tolist() == want[1]
