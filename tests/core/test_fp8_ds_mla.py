# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Byte-exact tests of the 584 B ``fp8_ds_mla`` cache format.

Oracles: ``oracle.quantize_ref`` (float64, e4m3 by grid search, ties to even) and raw byte
reads at the documented offsets of the underlying storage (``oracle.read_token_bytes``).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.oracle import (
    dequant_slots_f64,
    e4m3_table,
    quantize_ref,
    read_token_bytes,
    storage_bytes,
    token_offsets,
)
from vllm_dsv4_backend.formats import fp8_ds_mla as F

BLOCK_CASES = [(2, True), (61, False), (61, True), (64, True), (64, False)]


pytestmark = pytest.mark.usefixtures("one_thread")


def varied_kv(n: int, seed: int) -> torch.Tensor:
    """bf16 ``[n, 512]`` rows whose tiles span zero, sub-floor, small, normal and huge
    magnitudes, with values that land in e4m3's subnormal range and exact ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g, dtype=torch.float64)
    mags = torch.tensor([0.0, 1e-6, 3e-5, 1e-3, 0.02, 0.3, 1.0, 7.0, 448.0, 1e4])
    pick = torch.randint(0, len(mags), (n, 8), generator=g)
    x = x * mags[pick].repeat_interleave(64, dim=1).to(torch.float64)
    # Some very small entries in otherwise large tiles -> e4m3 subnormals / flush to zero.
    tiny = torch.rand(n, 512, generator=g) < 0.05
    x = torch.where(tiny, x * 1e-4, x)
    return x.to(torch.bfloat16)


def test_padded_block_stride() -> None:
    assert F.padded_block_stride(64) == 37440
    assert F.padded_block_stride(2) == 1728
    for b in range(1, 300):
        s = F.padded_block_stride(b)
        assert s % 576 == 0 and 584 * b <= s < 584 * b + 576
    with pytest.raises(ValueError, match="block_size"):
        F.padded_block_stride(0)


@pytest.mark.parametrize("padded", [True, False])
def test_allocate_cache_geometry(padded: bool) -> None:
    c = F.allocate_cache(3, 61, padded=padded, fill=7)
    stride0 = F.padded_block_stride(61) if padded else 584 * 61
    assert c.shape == (3, 61, 584) and c.dtype == torch.uint8
    assert c.stride() == (stride0, 584, 1)
    assert c.untyped_storage().nbytes() == 3 * stride0
    assert bool((storage_bytes(c) == 7).all())
    lay = F.cache_layout(c)
    assert (lay.num_blocks, lay.block_size, lay.stride0, lay.num_slots) == (3, 61, stride0, 183)


def test_known_values() -> None:
    """Hand-computed bytes at the documented offsets."""
    x = torch.zeros(1, 512, dtype=torch.float32)
    # tile 0: all zero -> amax floored at 1e-4 -> e = ceil(log2(1e-4/448)) = -22 -> byte 105
    # tile 1: amax 448 -> e = 0 -> byte 127; 448 -> 0x7E, 1 -> 0x38, -2 -> 0xC0, 0.5 -> 0x30
    x[0, 64:68] = torch.tensor([448.0, 1.0, -2.0, 0.5])
    # tile 2: amax 1 -> e = ceil(log2(1/448)) = -8 -> byte 119; 1.0 / 2**-8 = 256 -> 0x78
    x[0, 128] = 1.0
    # tile 3: amax 0.01 -> e = ceil(log2(0.01/448)) = -15 -> byte 112 (scale-floor writers: 114)
    x[0, 192] = 0.01
    # tile 4: amax 1e-5 < floor -> byte 105; 2**-31 / 2**-22 = 2**-9: smallest subnormal 0x01
    x[0, 256] = 1e-5
    x[0, 257] = 2.0**-31
    # tile 5: amax 896 = 448 * 2 exactly -> e = 1 (exact power of two, no rounding up)
    x[0, 320] = 896.0
    x[0, 321] = -3.0  # 3/2 = 1.5 -> 0x3C | sign
    # tile 6: an exact tie: amax 448 -> e = 0; 17 lies between 16 and 18 -> even byte (16)
    x[0, 384] = 448.0
    x[0, 385] = 17.0
    rope = torch.tensor([1.0, -2.5, 3.140625, 0.0] + [0.0] * 60)
    x[0, 448:] = rope
    kv = x.to(torch.bfloat16)
    cache = F.allocate_cache(2, 4, fill=0xAB)
    F.quantize_and_insert(kv, cache, torch.tensor([6]))  # block 1, token 2
    flat = storage_bytes(cache)
    stride0 = cache.stride(0)
    base = stride0 * 1
    data = flat[base + 576 * 2 : base + 576 * 3]
    scl = flat[base + 576 * 4 + 8 * 2 : base + 576 * 4 + 8 * 3]
    assert scl.tolist() == [105, 127, 119, 112, 105, 128, 127, 0]
    assert data[:64].tolist() == [0] * 64
    assert data[64:68].tolist() == [0x7E, 0x38, 0xC0, 0x30]
    assert data[128].item() == 0x78
    assert data[256].item() == round_ref_byte(1e-5 * 2.0**22)
    assert data[257].item() == 0x01
    assert data[320:322].tolist() == [0x7E, 0xBC]
    assert data[384:386].tolist() == [0x7E, 0x58]
    assert torch.equal(data[448:].view(torch.bfloat16), rope.to(torch.bfloat16))
    # Other slots and the block padding keep their bytes.
    d_off, s_off = token_offsets(cache, torch.tensor([6]))
    touched = torch.zeros_like(flat, dtype=torch.bool)
    touched[int(d_off) : int(d_off) + 576] = True
    touched[int(s_off) : int(s_off) + 8] = True
    assert bool((flat[~touched] == 0xAB).all())


def round_ref_byte(v: float) -> int:
    """e4m3 byte nearest to ``v`` (ties to even), via the oracle grid."""
    from tests.support.oracle import round_to_e4m3

    return int(round_to_e4m3(torch.tensor([float(torch.tensor(v).to(torch.bfloat16))],
                                          dtype=torch.float64))[0])


@pytest.mark.parametrize("block_size,padded", BLOCK_CASES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_insert_matches_oracle_bytes(block_size: int, padded: bool,
                                     slot_dtype: torch.dtype) -> None:
    nb = 5
    cache = F.allocate_cache(nb, block_size, padded=padded, fill=0xFF)
    before = storage_bytes(cache).clone()
    n = nb * block_size
    g = torch.Generator().manual_seed(block_size)
    slots = torch.randperm(n, generator=g)[: max(1, (2 * n) // 3)]
    kv = varied_kv(len(slots), seed=block_size)
    slot_map = slots.clone()
    slot_map[::5] = -1  # skipped rows
    F.quantize_and_insert(kv, cache, slot_map.to(slot_dtype))
    keep = slot_map >= 0
    nope_ref, scale_ref, rope_ref = quantize_ref(kv[keep])
    nope, rope, scl, pad = read_token_bytes(cache, slot_map[keep])
    assert torch.equal(nope, nope_ref)
    assert torch.equal(scl, scale_ref)
    assert torch.equal(rope.view(torch.int16), rope_ref.view(torch.int16))
    assert bool((pad == 0).all())
    # Nothing outside the named slots' 576 + 8 bytes changed (skipped rows, padding, others).
    flat = storage_bytes(cache)
    d_off, s_off = token_offsets(cache, slot_map[keep])
    touched = torch.zeros_like(flat, dtype=torch.bool)
    touched[(d_off.unsqueeze(1) + torch.arange(576)).reshape(-1)] = True
    touched[(s_off.unsqueeze(1) + torch.arange(8)).reshape(-1)] = True
    assert torch.equal(flat[~touched], before[~touched])


def test_4d_view_and_float_inputs() -> None:
    cache3 = F.allocate_cache(3, 64)
    cache4 = F.allocate_cache(3, 64).unsqueeze(2)
    assert cache4.shape == (3, 64, 1, 584)
    kv = varied_kv(100, seed=3).float()  # float32 input is rounded to bf16 first
    slots = torch.randperm(192)[:100]
    F.quantize_and_insert(kv, cache3, slots)
    F.quantize_and_insert(kv.to(torch.bfloat16), cache4, slots)
    assert torch.equal(storage_bytes(cache3), storage_bytes(cache4))
    out3 = F.dequantize_and_gather(cache3, slots)
    out4 = F.dequantize_and_gather(cache4, slots.to(torch.int32))
    assert torch.equal(out3, out4)


@pytest.mark.parametrize("block_size,padded", BLOCK_CASES)
def test_round_trip_within_half_ulp(block_size: int, padded: bool) -> None:
    nb = 4
    cache = F.allocate_cache(nb, block_size, padded=padded, fill=0xFF)
    n = nb * block_size
    slots = torch.randperm(n)
    kv = varied_kv(n, seed=100 + block_size)
    F.quantize_and_insert(kv, cache, slots)
    got = F.dequantize_and_gather(cache, torch.cat([slots, torch.tensor([-1])]))
    assert got.dtype == torch.bfloat16 and got.shape == (n + 1, 512)
    assert bool((got[-1] == 0).all())  # slot -1 -> zero row
    got = got[:-1]
    # Exactly the oracle's decoding of the stored bytes ...
    assert torch.equal(got.to(torch.float64), dequant_slots_f64(cache, slots))
    # ... RoPE bit-exact ...
    assert torch.equal(got[:, 448:].view(torch.int16), kv[:, 448:].view(torch.int16))
    # ... and NoPE within half an e4m3 ulp at the tile scale (RNE).
    x = kv[:, :448].to(torch.float64).reshape(n, 7, 64)
    _, scale_bytes, _ = quantize_ref(kv)
    s = torch.pow(2.0, scale_bytes.to(torch.float64) - 127).unsqueeze(-1)
    y = x / s
    e = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
    half_ulp = torch.pow(2.0, e - 3) / 2  # e4m3: 3 mantissa bits; subnormal step 2**-9
    err = (got[:, :448].to(torch.float64).reshape(n, 7, 64) / s - y).abs()
    assert bool((err <= half_ulp).all())


def test_scale_floor() -> None:
    amaxes = [0.0, 1e-6, 5e-5, 1e-4, 0.01, 0.0448, 0.05, 1.0]
    x = torch.zeros(len(amaxes), 512)
    for i, a in enumerate(amaxes):
        x[i, 5] = a
    kv = x.to(torch.bfloat16)
    _, scale, _ = F.quantize(kv)
    for i, a in enumerate(amaxes):
        a_bf16 = float(kv[i, 5].float())
        expect = math.ceil(math.log2(max(a_bf16, 1e-4) / 448.0)) + 127
        assert int(scale[i, 0]) == expect, (a, int(scale[i, 0]), expect)
        assert int(scale[i, 1]) == 105  # empty tiles sit at the floor 2**-22
    assert int(scale[0, 0]) == 105


def test_dequant_fast_path_exhaustive() -> None:
    """Every e4m3 byte under every scale byte 0..254 decodes to the exact value (bf16)."""
    tab = e4m3_table()
    nope = torch.cat([torch.arange(256), torch.arange(192)]).to(torch.uint8)
    n = 255
    cache = F.allocate_cache(4, 64, fill=0xFF)
    lay = F.cache_layout(cache)
    dv, sv = lay.data_view(cache), lay.scale_view(cache)
    for t in range(n):
        blk, off = divmod(t, 64)
        dv[blk, off, :448] = nope
        dv[blk, off, 448:] = 0
        sv[blk, off, :7] = t
        sv[blk, off, 7] = 0
    got = F.dequantize_and_gather(cache, torch.arange(n))
    ref = tab[nope.to(torch.int64)].unsqueeze(0) * torch.pow(
        2.0, torch.arange(n, dtype=torch.float64) - 127
    ).unsqueeze(1)
    ref_bf16 = ref.to(torch.bfloat16)
    finite = ~torch.isnan(ref)
    assert torch.equal(got[:, :448][finite].view(torch.int16), ref_bf16[finite].view(torch.int16))


def test_duplicate_and_empty_slot_mapping() -> None:
    cache = F.allocate_cache(2, 64, fill=0x11)
    before = storage_bytes(cache).clone()
    F.quantize_and_insert(torch.zeros(0, 512, dtype=torch.bfloat16), cache,
                          torch.zeros(0, dtype=torch.int64))
    F.quantize_and_insert(torch.ones(3, 512, dtype=torch.bfloat16), cache,
                          torch.tensor([-1, -1, -1]))
    assert torch.equal(storage_bytes(cache), before)
    assert F.dequantize_and_gather(cache, torch.zeros(0, dtype=torch.int64)).shape == (0, 512)


def _bad(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def test_bad_inputs() -> None:
    cache = F.allocate_cache(2, 4)
    kv = torch.zeros(3, 512, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, 2])
    _bad(lambda: F.quantize_and_insert(kv[:, :448], cache, slots), r"kv: expected shape \[N, 512\]")
    _bad(lambda: F.quantize_and_insert(kv.to(torch.int32), cache, slots), "kv: expected dtype")
    _bad(lambda: F.quantize_and_insert(kv, cache.view(torch.int8), slots),
         "cache: expected dtype torch.uint8")
    _bad(lambda: F.quantize_and_insert(kv, torch.zeros(2, 4, 576, dtype=torch.uint8), slots),
         "cache: expected last dim 584")
    _bad(lambda: F.quantize_and_insert(kv, torch.zeros(2, 4, 2, 584, dtype=torch.uint8), slots),
         "h_kv = 1")
    _bad(lambda: F.quantize_and_insert(kv, torch.zeros(8, 584, dtype=torch.uint8), slots),
         "cache: expected shape")
    overlapping = torch.zeros(4000, dtype=torch.uint8).as_strided((2, 4, 584), (1000, 584, 1))
    _bad(lambda: F.quantize_and_insert(kv, overlapping, slots), r"stride\(0\) >= 584")
    strided_rows = torch.zeros(2, 4, 600, dtype=torch.uint8)[:, :, :584]
    _bad(lambda: F.quantize_and_insert(kv, strided_rows, slots), r"stride\(1\) == 584")
    _bad(lambda: F.quantize_and_insert(kv, cache, slots.float()), "slot_mapping: expected dtype")
    _bad(lambda: F.quantize_and_insert(kv, cache, slots[:2]), r"slot_mapping: expected shape \[3\]")
    _bad(lambda: F.quantize_and_insert(kv, cache, torch.tensor([0, 8, 1])),
         r"slot ids in \[-1, 8\)")
    _bad(lambda: F.quantize_and_insert(kv, cache, torch.tensor([0, -2, 1])),
         r"slot ids in \[-1, 8\)")
    _bad(lambda: F.quantize_and_insert(kv.to("meta"), cache, slots), "kv: expected device cpu")
    _bad(lambda: F.quantize_and_insert(kv, cache, slots.to("meta")),
         "slot_mapping: expected device cpu")
    _bad(lambda: F.dequantize_and_gather(cache, torch.tensor([8])), r"slot ids in \[-1, 8\)")
    _bad(lambda: F.dequantize_and_gather(cache, torch.tensor([[0]])),
         r"slots: expected shape \[M\]")
    _bad(lambda: F.dequantize_and_gather(cache, slots, out=torch.empty(3, 512)),
         "out: expected shape")
    _bad(lambda: F.allocate_cache(-1, 4), "num_blocks")


def test_vllm_cpu_writer_byte_exact() -> None:
    """vLLM's C++ CPU writer ``fused_qnorm_rope_kv_insert_cpu`` (positions 0: identity RoPE)
    writes the same bytes for tiles with amax >= 448e-4 except e4m3 subnormals, which it
    flushes to (signed) zero. Needs vLLM's AVX512-BF16 library (found without importing vLLM)."""
    from vllm_dsv4_backend.ops import vllm_cpu

    if not vllm_cpu.fused_qnorm_rope_kv_insert_cpu_available():
        pytest.skip(f"vLLM's C++ fp8_ds_mla writer unavailable: {vllm_cpu.load()[1]}")
    g = torch.Generator().manual_seed(0)
    n, block_size = 150, 64
    kv = (torch.randn(n, 512, generator=g) * 0.5).to(torch.bfloat16)
    kv[:, :448] += 0.1 * torch.sign(kv[:, :448].float()).to(torch.bfloat16)  # amax >= 0.1
    slots = torch.randperm(3 * block_size, generator=g)[:n]
    ours = F.allocate_cache(3, block_size, fill=0x5A)
    theirs = F.allocate_cache(3, block_size, fill=0x5A)
    F.quantize_and_insert(kv, ours, slots)
    lay = F.cache_layout(theirs)
    cache_2d = torch.as_strided(theirs, (3, 584 * block_size), (lay.stride0, 1),
                                lay.storage_offset)
    cos_sin = torch.cat([torch.ones(4, 32), torch.zeros(4, 32)], dim=1)
    torch.ops._C.fused_qnorm_rope_kv_insert_cpu(
        torch.zeros(n, 1, 512, dtype=torch.bfloat16), kv.contiguous(),
        torch.zeros(n, dtype=torch.int64), cache_2d, slots.to(torch.int64), cos_sin, 1, 1e-6,
        block_size,
    )
    a, b = storage_bytes(ours), storage_bytes(theirs)
    nope_a, _, _, _ = read_token_bytes(ours, slots)
    subnormal = ((nope_a & 0x78) == 0) & ((nope_a & 0x07) != 0)
    nope_b, _, _, _ = read_token_bytes(theirs, slots)
    assert bool(((nope_b[subnormal] & 0x7F) == 0).all())
    d_off, _ = token_offsets(ours, slots)
    sub_pos = (d_off.unsqueeze(1) + torch.arange(448))[subnormal]
    same = a == b
    same[sub_pos] = True
    assert bool(same.all()), f"{int((~same).sum())} bytes differ"
