# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MXFP4 (e2m1 + ue8m0 per 32) bit-exactness against a scalar exact oracle.

The oracle works on Python ``Fraction``s: it picks the block exponent as the
smallest ``e`` with ``amax <= 6 * 2**e`` and rounds each value to the nearest
e2m1 magnitude by explicit distance comparison (ties to the even code), with
no thresholds shared with the implementation.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from vllm_dsv4_backend.formats import mxfp4

GRID = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
# RNE winner (code) at each midpoint: the neighbour with the even code.
MIDPOINT_CODES = [0, 2, 2, 4, 4, 6, 6]


def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def oracle_exponent(amax: float) -> int:
    if math.isinf(amax):
        return 127
    a = Fraction(max(amax, 6 * 2.0**-126))
    e = math.ceil(math.log2(a / 6))
    while a > 6 * Fraction(2) ** e:
        e += 1
    while a <= 6 * Fraction(2) ** (e - 1):
        e -= 1
    return max(-127, min(127, e))


def oracle_code(y: Fraction) -> int:
    """Nearest e2m1 magnitude code of |y| (ties to even code, saturate at 6)."""
    mag = abs(y)
    if mag >= 6:
        return 7
    best = min(range(8), key=lambda c: (abs(GRID[c] - mag), c % 2))
    return best


def oracle_block(vals: list[float]) -> tuple[list[int], int]:
    """Nibbles and scale byte for one 32-value block (no NaN)."""
    amax = max(abs(v) for v in vals)
    e = oracle_exponent(amax)
    scale = Fraction(2) ** e
    nibbles = []
    for v in vals:
        code = 7 if math.isinf(v) else oracle_code(Fraction(v) / scale)
        sign = 8 if math.copysign(1.0, v) < 0 else 0
        nibbles.append(sign | code)
    return nibbles, e + 127


def oracle_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.to(torch.float32).reshape(-1, 32).tolist()
    packed, scales = [], []
    for blk in flat:
        nib, sb = oracle_block(blk)
        packed.extend(nib[2 * i] | (nib[2 * i + 1] << 4) for i in range(16))
        scales.append(sb)
    lead = tuple(x.shape[:-1])
    return (
        torch.tensor(packed, dtype=torch.uint8).reshape(*lead, x.shape[-1] // 2),
        torch.tensor(scales, dtype=torch.uint8).reshape(*lead, x.shape[-1] // 32),
    )


def oracle_dequantize_value(nibble: int, scale_byte: int) -> float:
    if scale_byte == 255:
        return math.nan
    mag = float(GRID[nibble & 7])
    v = mag * 2.0 ** (scale_byte - 127)
    return -v if nibble & 8 else v


def _block_with(values: list[float], anchor: float = 6.0) -> torch.Tensor:
    """A 32-value block holding ``values`` plus ``anchor`` (fixes the scale)."""
    vals = list(values) + [anchor]
    vals += [0.0] * (32 - len(vals))
    return torch.tensor(vals, dtype=torch.float32)


def _nibbles(packed: torch.Tensor) -> list[int]:
    out = []
    for b in packed.reshape(-1).tolist():
        out += [b & 0xF, b >> 4]
    return out


def test_every_grid_point_exact():
    vals = [float(g) for g in GRID] + [-float(g) for g in GRID]
    x = _block_with(vals)  # amax 6 -> scale 2**0
    packed, scale = mxfp4.quantize(x)
    assert scale.tolist() == [127]
    nib = _nibbles(packed)
    assert nib[:8] == list(range(8))
    assert nib[8:16] == [8 | c for c in range(8)]
    assert mxfp4.dequantize(packed, scale)[:16].tolist() == vals


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_every_tie_rounds_to_even(sign):
    vals = [sign * m for m in MIDPOINTS]
    x = _block_with(vals)
    packed, scale = mxfp4.quantize(x)
    assert scale.tolist() == [127]
    nib = _nibbles(packed)[: len(vals)]
    want = [(8 if sign < 0 else 0) | c for c in MIDPOINT_CODES]
    assert nib == want
    # Same answer from the oracle, independently.
    assert nib == oracle_block(x.tolist())[0][: len(vals)]


def test_one_ulp_around_every_tie():
    mids = torch.tensor(MIDPOINTS, dtype=torch.float32)
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, 10.0))
    x = _block_with(below.tolist() + above.tolist())
    packed, _ = mxfp4.quantize(x)
    nib = _nibbles(packed)
    lower = [0, 1, 2, 3, 4, 5, 6]  # just below midpoint i: grid[i]
    upper = [1, 2, 3, 4, 5, 6, 7]
    assert nib[:7] == lower
    assert nib[7:14] == upper


def test_scaled_grid_and_ties_at_other_scales():
    for e in (-126, -40, -3, 0, 5, 60, 125):  # 6 * 2**126 overflows float32
        s = 2.0**e
        vals = [m * s for m in MIDPOINTS] + [float(g) * s for g in GRID]
        x = _block_with(vals, anchor=6.0 * s)
        packed, scale = mxfp4.quantize(x)
        assert scale.tolist() == [e + 127], e
        assert _nibbles(packed)[: len(vals)] == MIDPOINT_CODES + list(range(8)), e


def test_saturation():
    y = torch.tensor([6.0, 6.5, 7.0, 100.0, float("inf"), -7.0, -float("inf")])
    assert mxfp4.e2m1_codes(y).tolist() == [7, 7, 7, 7, 7, 15, 15]
    # Through quantize: inf saturates the scale (byte 254), finite neighbours flush.
    x = _block_with([float("inf"), -float("inf"), 3.0], anchor=1.0)
    packed, scale = mxfp4.quantize(x)
    assert scale.tolist() == [254]
    assert _nibbles(packed)[:4] == [7, 15, 0, 0]
    deq = mxfp4.dequantize(packed, scale)
    assert deq[0].item() == float("inf") and deq[1].item() == -float("inf")


def test_scale_boundaries():
    amaxes, want = [], []
    for k in (-126, -100, -7, -1, 0, 1, 7, 100, 125):
        edge = 6.0 * 2.0**k
        up = torch.nextafter(torch.tensor(edge), torch.tensor(math.inf)).item()
        down = torch.nextafter(torch.tensor(edge), torch.tensor(0.0)).item()
        amaxes += [edge, up, down]
        want += [k, k + 1, k]
    # Floor: zero, subnormals and tiny normals all give e = -126 (byte 1).
    tiny = [0.0, 1e-45, 2.0**-130, 2.0**-126, 6 * 2.0**-126]
    amaxes += tiny
    want += [-126] * len(tiny)
    # The largest float32 needs e = 126; only inf reaches 127.
    fmax = torch.finfo(torch.float32).max
    amaxes += [fmax, math.inf]
    want += [126, 127]
    got = mxfp4.ue8m0_exponent(torch.tensor(amaxes, dtype=torch.float32)).tolist()
    assert got == want
    assert [oracle_exponent(_f32(a)) for a in amaxes] == want


def test_nibble_order_even_low_odd_high():
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3] = 0.5, 6.0, -1.0, 3.0
    packed, scale = mxfp4.quantize(x)
    assert scale.tolist() == [127]
    assert packed[0].item() == 0x71  # code(0.5)=1 low, code(6)=7 high
    assert packed[1].item() == 0x5A  # code(-1)=8|2 low, code(3)=5 high
    assert packed[2:].tolist() == [0] * 14


def test_negative_zero_keeps_sign():
    x = torch.full((32,), -0.0)
    x[1] = -0.1  # rounds to -0 at this scale
    x[2] = 6.0
    packed, scale = mxfp4.quantize(x)
    nib = _nibbles(packed)
    assert nib[0] == 8 and nib[1] == 8 and nib[3] == 8
    deq = mxfp4.dequantize(packed, scale)
    assert torch.signbit(deq[0]) and deq[0].item() == 0.0
    allzero = torch.full((32,), -0.0)
    p2, s2 = mxfp4.quantize(allzero)
    assert s2.tolist() == [1] and p2.tolist() == [0x88] * 16


def test_nan_poisons_its_block_only():
    x = torch.randn(2, 64)
    x[0, 40] = float("nan")
    packed, scale = mxfp4.quantize(x)
    assert scale[0].tolist()[1] == mxfp4.NAN_SCALE_BYTE
    assert scale[0, 0].item() != mxfp4.NAN_SCALE_BYTE
    assert (scale[1] != mxfp4.NAN_SCALE_BYTE).all()
    deq = mxfp4.dequantize(packed, scale)
    assert torch.isnan(deq[0, 32:]).all()
    assert not torch.isnan(deq[0, :32]).any() and not torch.isnan(deq[1]).any()
    want_p, want_s = oracle_quantize(x[1])
    assert torch.equal(packed[1], want_p) and torch.equal(scale[1], want_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_blocks_match_oracle(dtype):
    g = torch.Generator().manual_seed(1234)
    n_blocks = 96
    base = torch.randn(n_blocks, 32, generator=g)
    # Log-uniform block magnitudes, plus some exact grid multiples and ties.
    mag = torch.exp2(torch.randint(-40, 40, (n_blocks, 1), generator=g).float())
    x = base * mag
    x[::7] = (torch.randint(-14, 15, (len(x[::7]), 32), generator=g) * 0.25) * mag[::7]
    x = x.to(dtype)
    if dtype == torch.float16:
        x = torch.nan_to_num(x, posinf=0.0, neginf=0.0)
    x = x.reshape(4, -1, 64)  # leading dims and two blocks per row
    packed, scale = mxfp4.quantize(x)
    want_p, want_s = oracle_quantize(x)
    assert packed.shape == (4, n_blocks // 8, 32) and scale.shape == (4, n_blocks // 8, 2)
    assert torch.equal(scale, want_s)
    assert torch.equal(packed, want_p)


def test_round_trip_error_bound():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g))
    packed, scale = mxfp4.quantize(x)
    deq = mxfp4.dequantize(packed, scale)
    s = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)
    # Grid spacing is at most 2 (between 4 and 6) in scale units: half of it.
    assert ((deq - x).abs() <= s * 1.0).all()
    # Values already on the grid survive a round trip exactly.
    packed2, scale2 = mxfp4.quantize(deq)
    assert torch.equal(mxfp4.dequantize(packed2, scale2), deq)


def test_dequantize_matches_oracle_for_all_bytes():
    nib = torch.arange(16, dtype=torch.uint8)
    packed = (nib[:, None] | (nib.flip(0)[:, None] << 4)).repeat(1, 16)[:, :16]  # [16, 16]
    packed = packed.repeat(16, 1)  # 256 rows, one per scale byte
    scale = torch.arange(256, dtype=torch.uint8).unsqueeze(1)
    deq = mxfp4.dequantize(packed, scale)
    want = []
    for row in range(256):
        for b in packed[row].tolist():
            want += [
                oracle_dequantize_value(b & 0xF, row),
                oracle_dequantize_value(b >> 4, row),
            ]
    want_t = torch.tensor(want, dtype=torch.float32).reshape(256, 32)
    assert torch.equal(torch.isnan(deq), torch.isnan(want_t))
    ok = ~torch.isnan(want_t)
    assert torch.equal(deq[ok], want_t[ok])
    assert torch.equal(torch.signbit(deq[ok]), torch.signbit(want_t[ok]))


def test_out_buffers_are_written():
    x = torch.randn(3, 96)
    op = torch.full((3, 48), 0xAB, dtype=torch.uint8)
    os_ = torch.full((3, 3), 0xAB, dtype=torch.uint8)
    p, s = mxfp4.quantize(x, out_packed=op, out_scale=os_)
    assert p.data_ptr() == op.data_ptr() and s.data_ptr() == os_.data_ptr()
    p2, s2 = mxfp4.quantize(x)
    assert torch.equal(op, p2) and torch.equal(os_, s2)
    od = torch.full((3, 96), float("nan"))
    d = mxfp4.dequantize(p, s, out=od)
    assert d.data_ptr() == od.data_ptr() and torch.equal(od, mxfp4.dequantize(p, s))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="'x'"):
        mxfp4.quantize(torch.zeros(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="'x'"):
        mxfp4.quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="out_packed"):
        mxfp4.quantize(torch.randn(2, 32), out_packed=torch.empty(2, 15, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out_scale"):
        mxfp4.quantize(torch.randn(2, 32), out_scale=torch.empty(2, 1, dtype=torch.int32))
    u8 = torch.uint8
    with pytest.raises(ValueError, match="packed"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=u8))
    with pytest.raises(ValueError, match="scale_exp"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=u8), torch.zeros(2, 2, dtype=u8))
    with pytest.raises(ValueError, match="scale_exp"):
        mxfp4.dequantize(torch.zeros(2, 10, dtype=u8), torch.zeros(2, 0, dtype=u8))
    with pytest.raises(ValueError, match="'out'"):
        mxfp4.dequantize(
            torch.zeros(2, 16, dtype=torch.uint8),
            torch.zeros(2, 1, dtype=torch.uint8),
            out=torch.empty(2, 32, dtype=torch.bfloat16),
        )
