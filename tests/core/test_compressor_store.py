# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for vllm_dsv4_backend.ops.compressor (DeepSeek-V4 compressor cache store).

Oracles:
- a float64 transliteration of the published compressor math (DeepSeek-V4 ``model.py``
  Compressor: per-channel softmax over the window, C4 overlap with the previous window on channels
  ``[:d]``, RMSNorm, GPT-J RoPE at the window start), computed from the raw per-token kv/score/ape,
  not from the state cache;
- test-local byte decoders/encoders of the 132 B / 68 B / 584 B layouts;
- a scalar transliteration of vLLM's C++ CPU ops (``save_partial_states_cpu``,
  ``compress_norm_rope_store[_indexer]_cpu``), the ``cpu_ops`` of the shared
  ``*_matches_cpu_op`` tests (tests.support.compressor_store, with the scenarios and
  oracles); tests/vllm/test_compressor_vllm_ops.py runs the same tests against the real ops
  when the installed vLLM build has them (this module never imports vLLM).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import compressor_store as cs
from tests.support.compressor_store import (
    C4_CASE,
    EPS,
    NO_KV_SLOT,
    POISON_BYTE,
    ROPE_DIM,
    decode_mxfp4,
    e4m3_ulp_distance,
    entry_byte_mask,
    fp8_indexer_quant,
    make_cache,
    make_scenario,
    oracle_entry,
    oracle_values,
    read_entry,
    run_compress,
    scenario_case,
    store_indexer,
    written_tokens,
)
from vllm_dsv4_backend.ops.compressor import (
    compress_norm_rope,
    compress_norm_rope_store_main,
    save_partial_states,
)


# ------------------------------------------------------------------------------------------
# fp32 values vs the float64 oracle
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio,head_dim", [(4, 128), (4, 512), (128, 128), (128, 512)])
@pytest.mark.parametrize("pad", [0, 40])
def test_compress_norm_rope_matches_float64_oracle(ratio, head_dim, pad):
    sc = make_scenario(ratio, head_dim, **scenario_case(ratio), seed=ratio + head_dim + pad,
                       pad_block_stride=pad)
    ref, ref_emit = oracle_values(sc)
    out = torch.full((sc.positions.numel(), head_dim), float("nan"))
    values, emit = run_compress(sc, out=out)
    assert values is out
    assert torch.equal(emit, ref_emit)
    assert int(emit.sum()) >= 3
    # rows that emit nothing are left untouched
    assert torch.isnan(values[~emit]).all()
    torch.testing.assert_close(values[emit].double(), ref[emit], rtol=2e-5, atol=2e-5)


def test_compress_small_kv_feels_eps():
    # mean(x^2) ~ 1e-6 ~ eps: the oracle only matches if eps sits inside the rsqrt
    sc = make_scenario(4, 128, **C4_CASE, seed=14, kv_scale=1e-3)
    ref, emit = oracle_values(sc)
    values, _ = run_compress(sc)
    torch.testing.assert_close(values[emit].double(), ref[emit], rtol=2e-5, atol=2e-5)


def test_compress_all_tokens_emit_and_none_emit():
    # all-emit path writes straight into out; none-emit path returns out untouched
    sc = make_scenario(4, 128, seq_lens=[12, 8], batch=[(0, 11, 11), (1, 7, 7)], seed=3)
    ref, _ = oracle_values(sc)
    values, emit = run_compress(sc)
    assert emit.all()
    torch.testing.assert_close(values.double(), ref, rtol=2e-5, atol=2e-5)

    sc = make_scenario(4, 128, seq_lens=[12], batch=[(0, 4, 6)], seed=4)
    out = torch.full((3, 128), float("nan"))
    values, emit = run_compress(sc, out=out)
    assert not emit.any() and torch.isnan(values).all()


def test_compress_rope_position_is_window_start():
    # Swapping the cos/sin row of the window start changes the result; the row at the closing
    # position is never read.
    sc = make_scenario(4, 128, seq_lens=[8], batch=[(0, 7, 7)], seed=5)
    base, _ = run_compress(sc)
    cs = sc.cos_sin.clone()
    cs[7] = float("nan")  # closing position: must not be read
    sc.cos_sin = cs
    same, _ = run_compress(sc)
    assert torch.equal(base, same)
    cs[4] += 0.1  # window start j*r = 4
    changed, _ = run_compress(sc)
    assert not torch.allclose(base[:, -ROPE_DIM:], changed[:, -ROPE_DIM:])
    assert torch.equal(base[:, :-ROPE_DIM], changed[:, :-ROPE_DIM])


def test_compress_negative_slots_and_positions():
    # -1 gather slots pointing at NaN rows are skipped; negative positions never emit.
    sc = make_scenario(4, 128, seq_lens=[4], batch=[(0, 3, 3)], seed=6)
    assert (sc.gather_slots[0, :4] == -1).all()
    values, emit = run_compress(sc)
    assert emit.all() and torch.isfinite(values).all()
    pos = torch.tensor([-1], dtype=torch.int64)
    values, emit = compress_norm_rope(
        sc.state_cache, sc.gather_slots, pos, sc.rms_w, EPS, sc.cos_sin, 4, 128
    )
    assert not emit.any()


def test_compress_empty_batch_and_int32_indices():
    sc = make_scenario(4, 128, **C4_CASE, seed=12)
    ref, emit = oracle_values(sc)
    values, emit32 = compress_norm_rope(
        sc.state_cache, sc.gather_slots, sc.positions.int(), sc.rms_w, EPS, sc.cos_sin, 4, 128
    )
    assert torch.equal(emit32, emit)
    torch.testing.assert_close(values[emit].double(), ref[emit], rtol=2e-5, atol=2e-5)
    values, emit = compress_norm_rope(
        sc.state_cache, sc.gather_slots[:0], sc.positions[:0], sc.rms_w, EPS, sc.cos_sin, 4, 128
    )
    assert values.shape == (0, 128) and emit.shape == (0,)


def test_compress_validation_errors():
    sc = make_scenario(4, 128, seq_lens=[8], batch=[(0, 7, 7)], seed=7)
    args = [sc.state_cache, sc.gather_slots, sc.positions, sc.rms_w, EPS, sc.cos_sin, 4, 128]

    def call(i, v, **kw):
        a = list(args)
        a[i] = v
        return compress_norm_rope(*a, **kw)

    with pytest.raises(ValueError, match="state_cache"):
        call(0, sc.state_cache.double())
    with pytest.raises(ValueError, match="state_cache"):
        call(7, 256)  # head_dim inconsistent with the state width
    with pytest.raises(ValueError, match="gather_slots"):
        call(1, sc.gather_slots[:, :4])
    with pytest.raises(ValueError, match="gather_slots"):
        call(1, sc.gather_slots.int())
    with pytest.raises(ValueError, match="gather_slots"):
        call(1, torch.full_like(sc.gather_slots, 10**6))
    with pytest.raises(ValueError, match="gather_slots"):
        call(1, torch.full_like(sc.gather_slots, -1))
    with pytest.raises(ValueError, match="positions"):
        call(2, sc.positions[:0])
    with pytest.raises(ValueError, match="rms_norm_weight"):
        call(3, sc.rms_w[:64])
    with pytest.raises(ValueError, match="cos_sin_cache"):
        call(5, sc.cos_sin[:4])  # the window start (4) is past the table
    with pytest.raises(ValueError, match="compress_ratio"):
        call(6, 1)
    with pytest.raises(ValueError, match="out"):
        call(0, sc.state_cache, out=torch.empty(1, 128, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------
# save_partial_states
# ------------------------------------------------------------------------------------------
def test_save_partial_states_layout_and_skips():
    gen = torch.Generator().manual_seed(8)
    width, ratio, bs = 256, 4, 4
    kv_score = torch.randn(5, 2 * width, generator=gen)  # fused projection: column-split views
    kv, score = kv_score[:, :width], kv_score[:, width:]
    ape = torch.randn(ratio, width, generator=gen)
    positions = torch.tensor([0, 5, 6, 7, 9])
    slots = torch.tensor([3, -1, 0, 9, 4])
    backing = torch.full((3, bs * 2 * width + 16), float("nan"))
    cache = backing[:, : bs * 2 * width].view(3, bs, 2 * width)
    save_partial_states(kv, score, ape, positions, cache, slots)
    for t in range(5):
        s = int(slots[t])
        if s < 0:
            continue
        row = cache[s // bs, s % bs]
        assert torch.equal(row[:width], kv[t])
        assert torch.equal(row[width:], score[t] + ape[int(positions[t]) % ratio])
    written = torch.zeros(3, bs, dtype=torch.bool)
    for s in slots[slots >= 0].tolist():
        written[s // bs, s % bs] = True
    assert torch.isnan(cache[~written]).all()
    assert torch.isnan(backing[:, bs * 2 * width :]).all()
    with pytest.raises(ValueError, match="slot_mapping"):
        save_partial_states(kv, score, ape, positions, cache, torch.tensor([12, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="state_cache"):
        save_partial_states(kv, score, ape, positions, cache[..., :width], slots)


# ------------------------------------------------------------------------------------------
# indexer stores (need formats/indexer_cache.py)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [4, 128])
def test_indexer_fp8_store_matches_rule_and_oracle(ratio):
    pytest.importorskip("vllm_dsv4_backend.formats.indexer_cache")
    sc = make_scenario(ratio, 128, **scenario_case(ratio), seed=11 + ratio, pad_block_stride=24,
                       no_kv_slot=NO_KV_SLOT[ratio])
    block, nblocks, pad = 4, 6, 40
    backing, cache_2d = make_cache(nblocks, block, 132, pad)
    scratch = torch.full((sc.positions.numel() + 2, 128), float("nan"))
    store_indexer(sc, cache_2d, block, "fp8", out=scratch)

    values, _ = run_compress(sc)
    ref, _ = oracle_values(sc)
    rows = written_tokens(sc)
    assert len(rows) >= 2
    worst = 0
    for t in rows:
        vals, sbytes = read_entry(cache_2d, sc.kv_slot_mapping[t], block, 128, 4)
        exp_b, exp_s = fp8_indexer_quant(values[t])
        # our own fp32 entry through vLLM's quantization rule: byte-exact
        assert torch.equal(vals, exp_b), t
        assert torch.equal(sbytes.view(torch.float32), exp_s), t
        # float64 oracle through the same rule: within 1 e4m3 ulp (fp32 vs f64 rounding)
        ob, os_ = fp8_indexer_quant(ref[t].float())
        if torch.equal(os_, exp_s):
            worst = max(worst, int(e4m3_ulp_distance(vals, ob).max()))
    assert worst <= 1
    mask = entry_byte_mask(nblocks, block, 132, 128, sc.kv_slot_mapping[rows],
                           backing.shape[1])
    assert (backing[~mask] == POISON_BYTE).all()


@pytest.mark.parametrize("ratio", [4, 128])
def test_indexer_mxfp4_store_dequantizes_to_values(ratio):
    pytest.importorskip("vllm_dsv4_backend.formats.indexer_cache")
    sc = make_scenario(ratio, 128, **scenario_case(ratio), seed=21 + ratio, no_kv_slot=(0,))
    block, nblocks, pad = 8, 4, 12
    backing, cache_2d = make_cache(nblocks, block, 68, pad)
    store_indexer(sc, cache_2d, block, "mxfp4")

    values, _ = run_compress(sc)
    rows = written_tokens(sc)
    assert len(rows) >= 2
    for t in rows:
        vals, sbytes = read_entry(cache_2d, sc.kv_slot_mapping[t], block, 64, 4)
        v = values[t].to(torch.bfloat16).float()
        amax = v.view(4, 32).abs().amax(dim=1).clamp(min=6 * 2.0**-126)
        exp_e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        assert torch.equal(sbytes.to(torch.float32), exp_e + 127), t
        deq = decode_mxfp4(vals, sbytes)
        s = torch.exp2(exp_e).repeat_interleave(32)
        # e2m1 grid spacing is at most 2 (4 -> 6), so RNE error <= 1 * scale; at most
        # 0.25 * scale below 1 * scale etc.: use the exact half-spacing of the grid.
        a = (v / s).abs()
        half_gap = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
        assert ((deq - v).abs() <= half_gap * s + 1e-12).all(), t
        assert (deq.abs() <= 6 * s).all()
    mask = entry_byte_mask(nblocks, block, 68, 64, sc.kv_slot_mapping[rows], backing.shape[1])
    assert (backing[~mask] == POISON_BYTE).all()


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_indexer_store_empty_and_nothing_to_write(dtype):
    pytest.importorskip("vllm_dsv4_backend.formats.indexer_cache")
    sc = make_scenario(4, 128, seq_lens=[12], batch=[(0, 4, 6)], seed=13)  # no window ends
    eb = 132 if dtype == "fp8" else 68
    backing, cache_2d = make_cache(2, 4, eb, 8)
    store_indexer(sc, cache_2d, 4, dtype)
    sc.kv_slot_mapping = sc.kv_slot_mapping.int()
    sc.gather_slots, sc.positions = sc.gather_slots[:0], sc.positions[:0]
    sc.kv_slot_mapping = sc.kv_slot_mapping[:0]
    store_indexer(sc, cache_2d, 4, dtype)
    assert (backing == POISON_BYTE).all()


def test_indexer_store_validation():
    pytest.importorskip("vllm_dsv4_backend.formats.indexer_cache")
    sc = make_scenario(4, 128, seq_lens=[8], batch=[(0, 7, 7)], seed=9)
    _, cache_2d = make_cache(2, 4, 132, 0)
    with pytest.raises(ValueError, match="indexer_kv_dtype"):
        store_indexer(sc, cache_2d, 4, "fp4")
    with pytest.raises(ValueError, match="kv_cache_2d"):
        store_indexer(sc, cache_2d[:, :100], 4, "fp8")
    sc.kv_slot_mapping = torch.tensor([8])  # capacity is 2 blocks x 4 entries
    with pytest.raises(ValueError, match="kv_slot_mapping"):
        store_indexer(sc, cache_2d, 4, "fp8")


# ------------------------------------------------------------------------------------------
# main 584 B store (needs formats/fp8_ds_mla.py)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [4, 128])
def test_main_store_decodes_to_values(ratio):
    pytest.importorskip("vllm_dsv4_backend.formats.fp8_ds_mla")
    sc = make_scenario(ratio, 512, **scenario_case(ratio), seed=31 + ratio)
    block, nblocks, pad = 2, 8, 576
    backing, cache_2d = make_cache(nblocks, block, 584, pad)
    compress_norm_rope_store_main(
        sc.state_cache, sc.gather_slots, sc.positions, sc.kv_slot_mapping, sc.rms_w, EPS,
        sc.cos_sin, cache_2d, block, sc.ratio,
    )
    values, _ = run_compress(sc)
    rows = written_tokens(sc)
    for t in rows:
        data, sbytes = read_entry(cache_2d, sc.kv_slot_mapping[t], block, 576, 8)
        v = values[t].to(torch.bfloat16).float()
        rope = data[448:].view(torch.bfloat16).float()
        assert torch.equal(rope, v[448:]), t
        nope = v[:448].view(7, 64)
        amax = nope.abs().amax(dim=1)
        exp_e = torch.ceil(torch.log2(amax / 448.0))  # tiles far above both 1e-4 floors here
        assert torch.equal(sbytes[:7].to(torch.float32), exp_e + 127), t
        assert int(sbytes[7]) == 0
        exp_b = (nope / torch.exp2(exp_e)[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(data[:448], exp_b.view(torch.uint8).reshape(-1)), t
    mask = entry_byte_mask(nblocks, block, 584, 576, sc.kv_slot_mapping[rows], backing.shape[1])
    assert (backing[~mask] == POISON_BYTE).all()


# ------------------------------------------------------------------------------------------
# vs vLLM's C++ CPU ops, and vs a scalar transliteration of them that runs anywhere
# ------------------------------------------------------------------------------------------
class ScalarCpuOps:
    """Per-token fp32 transliteration of vLLM 0.32 ``csrc/cpu/sgl-kernels/compressor.cpp``.

    Same argument lists as the ``torch.ops._C`` ops. Loops over tokens and window rows in the
    kernel's order (sequential fp32 window sums, 16-lane RMS partial sums, FMA RoPE, skip rows
    with slot < 0, skip tokens not closing a window or with kv slot < 0). Quantization as in the
    kernel: indexer = bf16 round after RoPE, one 128-wide block, raw fp32 scale
    ``2^ceil(log2(max(amax, 1e-4) / 448))``; main = bf16 round of the NoPE part, 64-wide tiles
    with ``scale = 2^ceil(log2(max(amax / 448, 1e-4)))`` (a scale floor, unlike the Triton amax
    floor), pad byte 0, RoPE part stored as bf16.
    """

    @staticmethod
    def save_partial_states_cpu(kv, score, ape, positions, state_cache, slot_mapping):
        bs, width = state_cache.shape[1], kv.shape[1]
        for t in range(kv.shape[0]):
            s = int(slot_mapping[t])
            if s < 0:
                continue
            row = state_cache[s // bs, s % bs]
            row[:width] = kv[t]
            row[width:] = score[t] + ape[int(positions[t]) % ape.shape[0]]

    @staticmethod
    def _prologue(state_cache, slots, position, d, ratio, weight, eps, cos_sin):
        bs, width = state_cache.shape[1], state_cache.shape[2] // 2
        rows = []
        for w in range(slots.shape[0]):
            s = int(slots[w])
            if s >= 0:
                h = d if w >= ratio else 0
                row = state_cache[s // bs, s % bs]
                rows.append((row[h : h + d], row[width + h : width + h + d]))
        mx = torch.stack([sc for _, sc in rows]).amax(dim=0)
        den = torch.zeros(d)
        acc = torch.zeros(d)
        for kv, sc in rows:
            e = (sc - mx).exp()
            den = den + e
            acc = acc + e * kv
        v = acc / den
        lanes = torch.zeros(16)
        for i in range(0, d, 16):
            lanes = lanes + v[i : i + 16] * v[i : i + 16]
        inv = 1.0 / torch.sqrt(lanes.sum() / d + torch.tensor(eps, dtype=torch.float32))
        normed = v * inv * weight
        cpos = (position // ratio) * ratio
        cos, sin = cos_sin[cpos, : ROPE_DIM // 2], cos_sin[cpos, ROPE_DIM // 2 :]
        y = normed.clone()
        xe, xo = normed[d - ROPE_DIM :: 2], normed[d - ROPE_DIM + 1 :: 2]
        y[d - ROPE_DIM :: 2] = (xe.double() * cos.double() - (xo * sin).double()).float()
        y[d - ROPE_DIM + 1 :: 2] = (xo.double() * cos.double() + (xe * sin).double()).float()
        return normed, y

    @classmethod
    def compress_norm_rope_store_indexer_cpu(cls, state_cache, gather_slots, positions,
                                             kv_slot_mapping, w, eps, cos_sin, kv2d, B, ratio):
        for t in range(gather_slots.shape[0]):
            p, ks = int(positions[t]), int(kv_slot_mapping[t])
            if (p + 1) % ratio or ks < 0:
                continue
            _, y = cls._prologue(state_cache, gather_slots[t], p, 128, ratio, w, eps, cos_sin)
            q = y.to(torch.bfloat16).float()
            amax = torch.clamp(q.abs().amax(), min=1e-4)
            scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
            b = (q * (1.0 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            blk, off = divmod(ks, B)
            kv2d[blk, off * 128 : (off + 1) * 128] = b
            kv2d[blk, B * 128 + off * 4 : B * 128 + off * 4 + 4] = scale.reshape(1).view(
                torch.uint8)

    @classmethod
    def compress_norm_rope_store_cpu(cls, state_cache, gather_slots, positions, kv_slot_mapping,
                                     w, eps, cos_sin, kv2d, B, ratio):
        for t in range(gather_slots.shape[0]):
            p, ks = int(positions[t]), int(kv_slot_mapping[t])
            if (p + 1) % ratio or ks < 0:
                continue
            normed, y = cls._prologue(state_cache, gather_slots[t], p, 512, ratio, w, eps,
                                      cos_sin)
            nope = normed[:448].to(torch.bfloat16).float().view(7, 64)
            scale = torch.clamp(nope.abs().amax(dim=1) / 448.0, min=1e-4)
            e = torch.ceil(torch.log2(scale))
            b = (nope * (1.0 / torch.exp2(e))[:, None]).clamp(-448, 448)
            blk, off = divmod(ks, B)
            kv2d[blk, off * 576 : off * 576 + 448] = b.to(torch.float8_e4m3fn).view(
                torch.uint8).reshape(-1)
            kv2d[blk, off * 576 + 448 : off * 576 + 576] = y[448:].to(torch.bfloat16).view(
                torch.uint8)
            kv2d[blk, B * 576 + off * 8 : B * 576 + off * 8 + 7] = (e + 127).to(torch.uint8)
            kv2d[blk, B * 576 + off * 8 + 7] = 0


@pytest.fixture
def cpu_ops():
    """The scalar transliteration (torch only). tests/vllm/test_compressor_vllm_ops.py runs
    the same ``*_cpu_op`` tests against vLLM's C++ ops, where the build has them."""
    return ScalarCpuOps


# The comparisons with vLLM's op conventions (tests.support.compressor_store), collected
# here so they run on this module's ``cpu_ops``; tests/vllm/test_compressor_vllm_ops.py
# collects them on vLLM's real ops.
test_save_partial_states_matches_cpu_op = cs.test_save_partial_states_matches_cpu_op
test_indexer_fp8_store_matches_cpu_op = cs.test_indexer_fp8_store_matches_cpu_op
test_values_match_cpu_op_dequant = cs.test_values_match_cpu_op_dequant
test_main_store_matches_cpu_op = cs.test_main_store_matches_cpu_op


def test_oracle_is_not_vacuous():
    """The oracle sees the C4 overlap: dropping the previous window changes the entry."""
    sc = make_scenario(4, 128, seq_lens=[8], batch=[(0, 7, 7)], seed=10)
    full = oracle_entry(sc, 0, 7)
    sc.kv[0][:4, :128] += 1.0  # previous window's channels [:d]
    assert not torch.allclose(full, oracle_entry(sc, 0, 7))
    values, _ = run_compress(sc)
    ref_after = oracle_entry(sc, 0, 7)
    # the state cache still holds the old rows, so our values match the unmodified oracle
    torch.testing.assert_close(values[0].double(), full, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(values[0].double(), ref_after, rtol=1e-3, atol=1e-3)
    assert math.isfinite(float(values.sum()))
