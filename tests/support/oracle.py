# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Independent float64 oracles for the fp8_ds_mla format and sparse MLA, plus FlashMLA's
tolerance rule. Written from the published semantics (flashmla-and-formats.md §2.2, §5.1,
§5.4), sharing no code with ``vllm_dsv4_backend``: bytes are decoded from their bit fields,
values are rounded to e4m3 by searching the 256-value grid, and attention is plain float64
math on explicitly masked tensors. Usable by any test (``from tests.support.oracle import ...``).
"""

from __future__ import annotations

import math

import torch

NOPE, ROPE, D = 448, 64, 512
TOKEN_BYTES, DATA_BYTES = 584, 576


# --------------------------------------------------------------------------------------------
# e4m3fn / ue8m0 from bit fields
# --------------------------------------------------------------------------------------------
def e4m3_table() -> torch.Tensor:
    """float64 ``[256]``: value of each e4m3fn byte (bias 7, no inf, 0x7F/0xFF NaN)."""
    vals = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            vals.append(math.nan)
        elif e == 0:
            vals.append(sign * m * 2.0**-9)
        else:
            vals.append(sign * (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


_E4M3 = e4m3_table()


def ue8m0_value(byte: torch.Tensor) -> torch.Tensor:
    """float64 ``2**(byte - 127)`` (255 -> NaN)."""
    v = torch.pow(torch.tensor(2.0, dtype=torch.float64), byte.to(torch.float64) - 127.0)
    return torch.where(byte == 255, torch.full_like(v, math.nan), v)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Bytes of ``x`` (float64, |x| <= 448) rounded to nearest e4m3, ties to the even byte."""
    pos_bytes = torch.arange(0, 0x7F, dtype=torch.int64)  # 0x00..0x7E, ascending values
    grid = _E4M3[pos_bytes]
    a = x.abs().reshape(-1)
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo = (a - grid[lo]).abs()
    d_hi = (grid[hi] - a).abs()
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (pos_bytes[hi] % 2 == 0))
    mag = torch.where(pick_hi, pos_bytes[hi], pos_bytes[lo])
    neg = torch.signbit(x.reshape(-1))
    return (mag | (neg.to(torch.int64) << 7)).to(torch.uint8).reshape(x.shape)


def quantize_ref(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Oracle quantizer: ``[N, 512]`` -> (nope bytes ``[N, 448]``, scale bytes ``[N, 7]``,
    rope bf16 ``[N, 64]``), vLLM's amax-floor rule, exact float64 math."""
    x = kv.to(torch.bfloat16).to(torch.float64)
    n = x.shape[0]
    tiles = x[:, :NOPE].reshape(n, 7, 64)
    amax = tiles.abs().amax(-1)
    exps = torch.tensor(
        [[math.ceil(math.log2(max(float(a), 1e-4) / 448.0)) for a in row] for row in amax],
        dtype=torch.float64,
    ).reshape(n, 7)
    scaled = tiles / torch.pow(2.0, exps).unsqueeze(-1)
    nope = round_to_e4m3(scaled.clamp(-448, 448)).reshape(n, NOPE)
    scale = (exps + 127).clamp(0, 255).to(torch.uint8)
    return nope, scale, x[:, NOPE:].to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# cache access by raw byte offsets
# --------------------------------------------------------------------------------------------
def storage_bytes(cache: torch.Tensor) -> torch.Tensor:
    """uint8 1-D view of the whole storage under ``cache`` (offset 0)."""
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage())


def token_offsets(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offsets in the storage of each slot's data (576 B) and scale (8 B) fields."""
    nb, bs = cache.shape[0], cache.shape[1]
    stride0 = cache.stride(0) if nb > 1 else TOKEN_BYTES * bs
    s = slots.to(torch.int64)
    blk, t = s // bs, s % bs
    base = cache.storage_offset() + blk * stride0
    return base + DATA_BYTES * t, base + DATA_BYTES * bs + 8 * t


def read_token_bytes(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(nope ``[M, 448]`` u8, rope ``[M, 64]`` bf16, scale ``[M, 7]`` u8, pad ``[M]`` u8)."""
    flat = storage_bytes(cache)
    d_off, s_off = token_offsets(cache, slots)
    data = flat[d_off.unsqueeze(-1) + torch.arange(DATA_BYTES)]
    scl = flat[s_off.unsqueeze(-1) + torch.arange(8)]
    rope = data[:, NOPE:].contiguous().view(torch.bfloat16)
    return data[:, :NOPE].contiguous(), rope, scl[:, :7].contiguous(), scl[:, 7].contiguous()


def dequant_slots_f64(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, 512]`` value of each slot, decoded from its bytes."""
    nope, rope, scl, _ = read_token_bytes(cache, slots)
    m = slots.shape[0]
    vals = _E4M3[nope.to(torch.int64)].reshape(m, 7, 64) * ue8m0_value(scl).unsqueeze(-1)
    return torch.cat([vals.reshape(m, NOPE), rope.to(torch.float64)], dim=-1)


# --------------------------------------------------------------------------------------------
# attention oracles
# --------------------------------------------------------------------------------------------
def _softmax_with_sink(scores: torch.Tensor, valid: torch.Tensor, v: torch.Tensor,
                       sink: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """scores ``[..., h, K]`` float64, valid ``[..., 1, K]``, v ``[..., K, 512]``.

    Returns (out ``[..., h, 512]``, lse ``[..., h]``, max ``[..., h]``) in float64.
    """
    s = scores.masked_fill(~valid, -math.inf)
    mx = s.amax(-1)
    lse = torch.logsumexp(s, -1)
    empty = torch.isneginf(lse)
    lse_safe = torch.where(empty, torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe.unsqueeze(-1))
    p = torch.where(valid, p, torch.zeros_like(p))
    out = p @ v
    if sink is not None:
        # out *= e^lse / (e^lse + e^sink) = 1 / (1 + e^(sink - lse))
        factor = 1.0 / (1.0 + torch.exp(sink.to(torch.float64) - lse_safe))
        out = out * factor.unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    return out, lse, mx


def sparse_decode_ref(
    q: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    attn_sink: torch.Tensor | None,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA sparse decode in float64.

    Args:
        q: ``[b, s_q, h, 512]``.
        caches: list of ``(cache, indices [b, s_q, topk], topk_length [b] or None)``; all
            index sets share one softmax. Only ``-1`` (or a position ``>= topk_length``) is
            invalid; invalid entries are never decoded.

    Returns:
        out ``[b, s_q, h, 512]`` float64, lse ``[b, h, s_q]`` float64.
    """
    b, s_q, h, _ = q.shape
    ks, valids = [], []
    for cache, idx, lens in caches:
        topk = idx.shape[-1]
        valid = idx != -1
        if lens is not None:
            valid &= torch.arange(topk).view(1, 1, topk) < lens.view(b, 1, 1).to(torch.int64)
        k = torch.zeros(b, s_q, topk, D, dtype=torch.float64)
        if valid.any():
            k[valid] = dequant_slots_f64(cache, idx[valid])
        ks.append(k)
        valids.append(valid)
    k = torch.cat(ks, dim=2)
    valid = torch.cat(valids, dim=2)
    scores = torch.einsum("bshd,bskd->bshk", q.to(torch.float64), k) * softmax_scale
    out, lse, _ = _softmax_with_sink(scores, valid.unsqueeze(2), k, attn_sink)
    return out, lse.transpose(1, 2)


def sparse_prefill_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    index_list: tuple[torch.Tensor, torch.Tensor | None],
    attn_sink: torch.Tensor | None,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA sparse prefill in float64 (indices ``< 0`` or ``>= s_kv`` invalid).

    ``index_list``: ``(indices [s_q, 1, topk], topk_length [s_q] or None)``, an index list
    with its lengths as in each of :func:`sparse_decode_ref`'s caches.

    Returns out ``[s_q, h, 512]``, max_logits ``[s_q, h]`` (-inf when empty), lse ``[s_q, h]``
    (+inf when empty), all float64.
    """
    indices, topk_length = index_list
    s_q = q.shape[0]
    s_kv = kv.shape[0]
    idx = indices[:, 0, :].to(torch.int64)
    topk = idx.shape[-1]
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(topk).view(1, topk) < topk_length.view(s_q, 1).to(torch.int64)
    k = torch.zeros(s_q, topk, D, dtype=torch.float64)
    k[valid] = kv[:, 0, :].to(torch.float64)[idx[valid]]
    scores = torch.einsum("shd,skd->shk", q.to(torch.float64), k) * sm_scale
    out, lse, mx = _softmax_with_sink(scores, valid.unsqueeze(1), k, attn_sink)
    return out, mx, lse


# --------------------------------------------------------------------------------------------
# FlashMLA's comparison rule (kernelkit/compare.py: check_is_allclose)
# --------------------------------------------------------------------------------------------
DECODE_OUT_TOL = {"abs_tol": 1e-3, "rel_tol": 2.01 / 128, "cos_tol": 5e-6}
DECODE_LSE_TOL = {"abs_tol": 1e-6, "rel_tol": 8.01 / 65536, "cos_tol": 5e-6}
PREFILL_OUT_TOL = {"abs_tol": 8e-4, "rel_tol": 3.01 / 128, "cos_tol": 7e-6}
PREFILL_LSE_TOL = {"abs_tol": 1e-6, "rel_tol": 2.01 / 65536, "cos_tol": 7e-6}


def assert_flashmla_close(actual: torch.Tensor, ref: torch.Tensor, *, abs_tol: float,
                          rel_tol: float, cos_tol: float, name: str) -> None:
    """FlashMLA's rule: +-inf and NaN positions match exactly; every finite element passes
    ``|a-r| <= abs_tol`` or ``|a-r|/(|r|+1e-6) <= rel_tol``; and the cosine distance
    ``1 - 2 sum(a r) / sum(a^2 + r^2) <= cos_tol``."""
    a = actual.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != reference {tuple(r.shape)}"
    for what, fa, fr in (
        ("NaN", torch.isnan(a), torch.isnan(r)),
        ("+inf", torch.isposinf(a), torch.isposinf(r)),
        ("-inf", torch.isneginf(a), torch.isneginf(r)),
    ):
        if not torch.equal(fa, fr):
            pos = (fa != fr).nonzero()[:5].tolist()
            raise AssertionError(f"{name}: {what} positions differ at {pos}")
    fin = torch.isfinite(r)
    a, r = a[fin], r[fin]
    if a.numel() == 0:
        return
    err = (a - r).abs()
    rel = err / (r.abs() + 1e-6)
    bad = (err > abs_tol) & (rel > rel_tol)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} element(s) out of tolerance (abs {abs_tol}, rel "
            f"{rel_tol}); first: actual {float(a[i])!r} vs ref {float(r[i])!r}"
        )
    denom = float((a * a + r * r).sum())
    cos_diff = 1.0 - 2.0 * float((a * r).sum()) / denom if denom > 0 else 0.0
    if cos_diff > cos_tol:
        raise AssertionError(f"{name}: cosine distance {cos_diff:.3e} > {cos_tol:.1e}")
