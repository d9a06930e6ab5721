# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Indexer K cache and indexer ops: exact oracles and cases (torch only), shared by
tests/core/test_indexer.py (the plugin's ops) and tests/vllm/test_indexer_vllm_kernels.py
(vLLM's C++ CPU kernels).

Exact ``Fraction`` arithmetic for the FP8 rules (e4m3 values enumerated from the bit
layout, RNE by explicit nearest search) and for the q-side RoPE (FMA rounding); cache
views over a NaN-poisoned backing; :class:`PagedCase`, requests with shuffled, partly
unallocated block tables and their float64 logits oracle.
"""

from __future__ import annotations

import bisect
import struct
from fractions import Fraction

import torch

from vllm_dsv4_backend.formats import indexer_cache as ic
from vllm_dsv4_backend.ops import indexer as ix

POISON = 0xFF  # e4m3 NaN, fp32 NaN (all-ones), and the MXFP4 NaN scale byte
F32_1EM4 = Fraction(struct.unpack("<f", struct.pack("<f", 1e-4))[0])


# ---------------------------------------------------------------------------
# exact oracles
# ---------------------------------------------------------------------------
def _e4m3_value(code: int) -> Fraction | None:
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return None  # NaN
    if e == 0:
        mag = Fraction(m, 8) * Fraction(2) ** -6  # subnormal
    else:
        mag = (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
    return -mag if s else mag


E4M3 = [_e4m3_value(c) for c in range(256)]
_POS_CODES = sorted(range(127), key=lambda c: E4M3[c])  # 0x00..0x7E, ascending
_POS_VALUES = [E4M3[c] for c in _POS_CODES]
E4M3_F64 = torch.tensor(
    [float("nan") if v is None else float(v) for v in E4M3], dtype=torch.float64
)


def oracle_e4m3(y: Fraction, negative: bool | None = None) -> int:
    """RNE to e4m3fn (ties to even code), |y| <= 448 assumed (clamped).

    ``negative`` carries the sign of zero inputs (a Fraction has no -0): the
    sign bit survives rounding to zero, as in vLLM's converters and torch's.
    """
    mag = min(abs(y), Fraction(448))
    i = bisect.bisect_left(_POS_VALUES, mag)
    cands = [c for c in (i - 1, i) if 0 <= c < len(_POS_VALUES)]
    best = min(cands, key=lambda c: (abs(_POS_VALUES[c] - mag), _POS_CODES[c] % 2))
    code = _POS_CODES[best]
    neg = y < 0 if negative is None else negative
    return code | (0x80 if neg else 0)


def round_fraction(fr: Fraction, sig_bits: int) -> Fraction:
    """Round to nearest even binary float with ``sig_bits`` significand bits."""
    if fr == 0:
        return Fraction(0)
    a = abs(fr)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    elif Fraction(2) ** (e + 1) <= a:
        e += 1
    e = max(e, -126)
    ulp = Fraction(2) ** (e - sig_bits + 1)
    n, rem = divmod(a, ulp)
    if 2 * rem > ulp or (2 * rem == ulp and n % 2 == 1):
        n += 1
    return (n * ulp) if fr > 0 else -(n * ulp)


def f32(fr: Fraction) -> Fraction:
    return round_fraction(fr, 24)


def bf16(fr: Fraction) -> Fraction:
    return round_fraction(fr, 8)


def fp8_exponent_oracle(amax: Fraction) -> int:
    a = max(amax, F32_1EM4)
    e = -30
    while a > 448 * Fraction(2) ** e:
        e += 1
    return e


def oracle_fp8_row(
    vals: list[Fraction], negative: list[bool] | None = None
) -> tuple[list[int], Fraction]:
    e = fp8_exponent_oracle(max(abs(v) for v in vals))
    s = Fraction(2) ** e
    neg = negative or [None] * len(vals)
    return [oracle_e4m3(v / s, n) for v, n in zip(vals, neg)], s


def oracle_rope_row(x: list[Fraction], cos: list[Fraction], sin: list[Fraction]) -> list[Fraction]:
    """GPT-J RoPE on the last 2*len(cos) dims with FMA rounding, then bf16."""
    half = len(cos)
    nope = len(x) - 2 * half
    out = list(x[:nope])
    for i in range(half):
        xe, xo = x[nope + 2 * i], x[nope + 2 * i + 1]
        re = f32(xe * cos[i] - f32(xo * sin[i]))
        ro = f32(xo * cos[i] + f32(xe * sin[i]))
        out += [bf16(re), bf16(ro)]
    return out


def fr_list(t: torch.Tensor) -> list[Fraction]:
    return [Fraction(v) for v in t.to(torch.float64).tolist()]


# ---------------------------------------------------------------------------
# cache helpers
# ---------------------------------------------------------------------------
def make_cache(dtype: str, nb: int, bs: int, pad: int = 0, four_d: bool = False):
    """A NaN-poisoned backing ``[nb, bs*E + pad]`` and the cache view on it."""
    eb = ic.entry_bytes(dtype)
    backing = torch.full((nb, bs * eb + pad), POISON, dtype=torch.uint8)
    cache = backing.as_strided((nb, bs, eb), (bs * eb + pad, eb, 1))
    if four_d:
        cache = backing.as_strided((nb, bs, 1, eb), (bs * eb + pad, eb, eb, 1))
    return backing, cache


def read_entry_bytes(backing: torch.Tensor, dtype: str, bs: int, slot: int):
    vb, sb = ic.value_bytes(dtype), ic.scale_bytes(dtype)
    b, o = divmod(slot, bs)
    vals = backing[b, o * vb : (o + 1) * vb]
    scl = backing[b, bs * vb + o * sb : bs * vb + (o + 1) * sb]
    return vals, scl


def decode_entry_f64(dtype: str, vals: torch.Tensor, scl: torch.Tensor) -> torch.Tensor:
    """Independent float64 decode of one stored entry."""
    if dtype == ic.FP8:
        s = struct.unpack("<f", bytes(scl.tolist()))[0]
        return E4M3_F64[vals.long()] * s
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    v = vals.long()
    nib = torch.stack([v & 0xF, v >> 4], dim=-1).reshape(-1)
    mag = grid[nib & 7]
    x = torch.where(nib & 8 != 0, -mag, mag)
    s = torch.tensor([2.0 ** (b - 127) if b != 255 else float("nan") for b in scl.tolist()],
                     dtype=torch.float64)
    return (x.view(-1, 32) * s[:, None]).reshape(-1)


def q_inputs(t: int, h: int, seed: int):
    """Indexer q-side inputs ``(q [t, h, 128] bf16, positions, cos_sin, weights)``."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, h, 128, generator=g) * torch.exp2(
        torch.randint(-6, 6, (t, h, 1), generator=g).float())).bfloat16()
    # Tiny (not zero: the Fraction oracle has no signed zero) values: the amax floor,
    # and a head whose scale comes from its NoPE dims only.
    q[0, 0] = q[0, 0].sign() * 1e-30
    if h > 1:
        q[0, 1, 64:] = q[0, 1, 64:].sign() * 1e-20
    pos = torch.tensor([0, 5, 1000, 77, 3, 12][:t], dtype=torch.int64)
    cos_sin = torch.randn(1024, 64, generator=g)
    w = torch.randn(t, h, generator=g).bfloat16()
    return q, pos, cos_sin, w


# ---------------------------------------------------------------------------
# ops.indexer.indexer_logits
# ---------------------------------------------------------------------------
class PagedCase:
    """Requests with shuffled, partly unallocated (-1) block tables."""

    def __init__(self, dtype: str, seed: int, bs: int = 8, heads: int = 64):
        g = torch.Generator().manual_seed(seed)
        self.dtype, self.bs = dtype, bs
        req_lens = [0, 5, 8, 37, 71]  # compressed entries per request (0: empty)
        max_blocks = 10
        nb = 24
        self.backing, self.cache = make_cache(dtype, nb, bs, pad=24)  # NaN-poisoned
        perm = torch.randperm(nb, generator=g).tolist()
        bt = torch.full((len(req_lens), max_blocks), -1, dtype=torch.int32)
        for r, n in enumerate(req_lens):
            for b in range((n + bs - 1) // bs):
                bt[r, b] = perm.pop()
            if n:
                slots = bt[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                k = torch.randn(n, 128, generator=g).bfloat16()
                ic.quantize_and_insert(k, self.cache, slots, dtype)
        self.block_table = bt
        # tokens: causal positions inside each request, decode and prefill mixed
        # (2, 47) sees 12 entries but request 2 only has one block of 8: the rest of its
        # table is -1 (unallocated) and must come out -inf, never read.
        toks = [(0, 2), (1, 19), (1, 21), (2, 47), (3, 150), (3, 148), (4, 283), (4, 7),
                (4, 200), (2, 3)]
        self.token_to_req = torch.tensor([r for r, _ in toks], dtype=torch.int64)
        self.positions = torch.tensor([p for _, p in toks], dtype=torch.int64)
        self.seq_lens = ((self.positions + 1) // 4).int()
        t = len(toks)
        qin = torch.randn(t, heads, 128, generator=g).bfloat16()
        cos_sin = torch.randn(512, 64, generator=g)
        w = torch.randn(t, heads, generator=g).bfloat16()
        self.q = ix.indexer_q_rope_quant(qin, self.positions, cos_sin, w,
                                         softmax_scale=128**-0.5, head_scale=heads**-0.5,
                                         dtype=dtype)

    def oracle(self) -> torch.Tensor:
        t = self.q.weights.shape[0]
        width = int(self.seq_lens.max())
        res = torch.full((t, width), float("-inf"), dtype=torch.float64)
        if self.dtype == "fp8":
            qd = E4M3_F64[self.q.q.view(torch.uint8).long()]
        else:
            qd = torch.stack([
                torch.stack([decode_entry_f64("mxfp4", self.q.q[i, hh], self.q.q_scale[i, hh])
                             for hh in range(self.q.q.shape[1])])
                for i in range(t)])
        for i in range(t):
            r = int(self.token_to_req[i])
            for j in range(int(self.seq_lens[i])):
                blk = int(self.block_table[r, j // self.bs])
                if blk < 0:
                    continue
                k = decode_entry_f64(self.dtype,
                                     *read_entry_bytes(self.backing, self.dtype, self.bs,
                                                       blk * self.bs + j % self.bs))
                res[i, j] = (self.q.weights[i].double() * (qd[i] @ k).clamp(min=0)).sum()
        return res


