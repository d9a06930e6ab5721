# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compressor-store scenarios and oracles (torch only), shared by
tests/core/test_compressor_store.py and tests/vllm/test_compressor_vllm_ops.py.

- :class:`Scenario` / :func:`make_scenario`: a few requests with raw per-token
  kv/score, a paged state cache, one batch; :func:`oracle_entry` the float64
  transliteration of the published compressor math (per-channel softmax over the
  window, C4 overlap with the previous window on channels ``[:d]``, RMSNorm, GPT-J RoPE
  at the window start), from the raw rows, not from the state cache;
- test-local byte decoders/encoders of the 132 B / 68 B / 584 B layouts;
- the ``*_matches_cpu_op`` tests: they compare the plugin's stores with ``cpu_ops``, a
  fixture each importing module defines (tests/core: a scalar transliteration of vLLM's
  C++ CPU ops; tests/vllm: the real ``torch.ops._C`` ops). They are collected in the
  modules that import them, never here (not a ``test_*.py`` file).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from vllm_dsv4_backend.ops.compressor import (
    compress_norm_rope,
    compress_norm_rope_store_indexer,
    compress_norm_rope_store_main,
    save_partial_states,
)

ROPE_DIM = 64
EPS = 1e-6
POISON_BYTE = 0xFF  # e4m3fn NaN; 0xFFFFFFFF is a NaN fp32 scale too


# ------------------------------------------------------------------------------------------
# scenario: a few requests with raw per-token kv/score, a paged state cache, one batch
# ------------------------------------------------------------------------------------------
@dataclass
class Scenario:
    ratio: int
    head_dim: int
    coff: int
    kv: list[torch.Tensor]  # per request [L, coff*d] fp32
    score: list[torch.Tensor]  # per request [L, coff*d] fp32 (without ape)
    ape: torch.Tensor  # [ratio, coff*d]
    state_cache: torch.Tensor  # [nb, bs, 2*coff*d] view, possibly padded block stride
    state_backing: torch.Tensor  # the allocation state_cache views
    block_table: torch.Tensor  # [R, max_blocks] int64
    state_bs: int
    # the batch
    req_of_token: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] int64
    gather_slots: torch.Tensor  # [T, window] int64
    kv_slot_mapping: torch.Tensor  # [T] int64
    rms_w: torch.Tensor  # [d] fp32
    cos_sin: torch.Tensor  # [max_pos, 64] fp32


def make_cos_sin_cache(max_pos: int, rope_dim: int = ROPE_DIM, theta: float = 160000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(torch.float32).contiguous()


def gather_slots_for(positions, req_of_token, block_table, bs, window):
    """vLLM cpu_compressor.py: state slots of positions pos-window+1 .. pos (-1 if < 0)."""
    local = positions[:, None] - window + 1 + torch.arange(window)
    valid = local >= 0
    safe = local.clamp(min=0)
    blk = block_table[req_of_token[:, None].expand_as(local), safe // bs]
    slot = blk * bs + safe % bs
    return torch.where(valid, slot, torch.full_like(slot, -1))


def make_scenario(
    ratio: int,
    head_dim: int,
    seq_lens: list[int],
    batch: list[tuple[int, int, int]],
    *,
    seed: int,
    pad_block_stride: int = 0,
    writer=None,
    no_kv_slot: tuple[int, ...] = (),
    kv_scale: float = 1.0,
) -> Scenario:
    """``batch``: (request, first position, last position) chunks, in token order.

    Every request's raw rows ``0 .. L-1`` are saved into the state cache through ``writer``
    (default: our save_partial_states); unused state rows stay NaN. Tokens whose index is in
    ``no_kv_slot`` get kv slot -1 even if they close a window.
    """
    gen = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    width = coff * head_dim
    bs = 4 if ratio == 4 else 8
    nreq = len(seq_lens)
    kv = [kv_scale * torch.randn(n, width, generator=gen) for n in seq_lens]
    score = [2.0 * torch.randn(n, width, generator=gen) for n in seq_lens]
    ape = 0.5 * torch.randn(ratio, width, generator=gen)

    blocks_per_req = [-(-n // bs) for n in seq_lens]
    max_blocks = max(blocks_per_req)
    nb = sum(blocks_per_req) + 3
    perm = torch.randperm(nb, generator=gen)
    block_table = torch.zeros(nreq, max_blocks, dtype=torch.int64)
    k = 0
    for r, nbr in enumerate(blocks_per_req):
        block_table[r, :nbr] = perm[k : k + nbr]
        k += nbr

    row_width = 2 * width
    stride0 = bs * row_width + pad_block_stride
    backing = torch.full((nb * stride0,), float("nan"))
    state_cache = backing.as_strided((nb, bs, row_width), (stride0, row_width, 1))

    write = writer or save_partial_states
    for r, n in enumerate(seq_lens):
        pos = torch.arange(n, dtype=torch.int64)
        slots = block_table[r, pos // bs] * bs + pos % bs
        write(kv[r], score[r], ape, pos, state_cache, slots)

    req_of_token = torch.cat(
        [torch.full((last - first + 1,), r, dtype=torch.int64) for r, first, last in batch]
    )
    positions = torch.cat([torch.arange(first, last + 1) for _, first, last in batch])
    window = coff * ratio
    gather = gather_slots_for(positions, req_of_token, block_table, bs, window)

    closes = (positions + 1) % ratio == 0
    num_entries = int(closes.sum())
    kv_slot = torch.full_like(positions, -1)
    kv_slot[closes] = torch.randperm(num_entries + 5, generator=gen)[:num_entries]
    for t in no_kv_slot:
        kv_slot[t] = -1
    rms_w = 1.0 + 0.3 * torch.randn(head_dim, generator=gen)
    max_pos = int(positions.max()) + 1
    return Scenario(
        ratio, head_dim, coff, kv, score, ape, state_cache, backing, block_table, bs,
        req_of_token, positions, gather, kv_slot, rms_w, make_cos_sin_cache(max_pos + 3),
    )


def oracle_entry(sc: Scenario, req: int, position: int) -> torch.Tensor:
    """float64 compressed entry of the window ending at ``position`` (published semantics)."""
    r, d = sc.ratio, sc.head_dim
    j = position // r
    kv = sc.kv[req].double()
    score = sc.score[req].double() + sc.ape.double()[torch.arange(kv.shape[0]) % r]
    cur = torch.arange(j * r, (j + 1) * r)
    rows_kv = [kv[cur, d * (sc.coff - 1) : d * sc.coff]]
    rows_sc = [score[cur, d * (sc.coff - 1) : d * sc.coff]]
    if sc.coff == 2 and j > 0:
        prev = torch.arange((j - 1) * r, j * r)
        rows_kv.insert(0, kv[prev, :d])
        rows_sc.insert(0, score[prev, :d])
    k = torch.cat(rows_kv)
    s = torch.cat(rows_sc)
    x = (torch.softmax(s, dim=0) * k).sum(dim=0)
    y = x / torch.sqrt((x * x).mean() + EPS) * sc.rms_w.double()
    cs = sc.cos_sin[j * r].double()
    cos, sin = cs[: ROPE_DIM // 2], cs[ROPE_DIM // 2 :]
    e, o = y[d - ROPE_DIM :: 2].clone(), y[d - ROPE_DIM + 1 :: 2].clone()
    y[d - ROPE_DIM :: 2] = e * cos - o * sin
    y[d - ROPE_DIM + 1 :: 2] = o * cos + e * sin
    return y


def oracle_values(sc: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    emit = (sc.positions + 1) % sc.ratio == 0
    out = torch.full((sc.positions.numel(), sc.head_dim), float("nan"), dtype=torch.float64)
    for t in emit.nonzero().view(-1).tolist():
        out[t] = oracle_entry(sc, int(sc.req_of_token[t]), int(sc.positions[t]))
    return out, emit


# C4: request 0 prefills 0..12 (entries at 3, 7, 11: the first has no previous window),
# request 1 decodes one closing token, request 2 decodes one non-closing token, request 3
# continues a chunk 9..16.
C4_CASE = dict(seq_lens=[13, 24, 10, 17], batch=[(0, 0, 12), (1, 23, 23), (2, 9, 9), (3, 9, 16)])
# C128: request 0 prefills 0..299 (entries at 127, 255), request 1 decodes at 127, request 2 at a
# non-closing position.
C128_CASE = dict(seq_lens=[300, 128, 140], batch=[(0, 0, 299), (1, 127, 127), (2, 139, 139)])


# a window-closing token whose entry has no cache slot (-1): must be skipped
NO_KV_SLOT = {4: (3,), 128: (127,)}


def scenario_case(ratio):
    return C4_CASE if ratio == 4 else C128_CASE


def run_compress(sc: Scenario, **kw):
    return compress_norm_rope(
        sc.state_cache, sc.gather_slots, sc.positions, sc.rms_w, EPS, sc.cos_sin, sc.ratio,
        sc.head_dim, **kw,
    )


# ------------------------------------------------------------------------------------------
# byte-layout helpers (test-local, from the published formats)
# ------------------------------------------------------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def indexer_store_case(n_tokens: int, gen: torch.Generator, save_partial_states: Callable
                       ) -> tuple[torch.Tensor, ...]:
    """A C4 indexer compressor after ``n_tokens`` consecutive positions of one request
    (state slot = position: blocks 0..3 of 16), saved by ``save_partial_states`` (the
    plugin's op or vLLM's ``save_partial_states_cpu``): ``(state, pos, gather, rms,
    kv_slots)``, the window gather of each token's 8 states and distinct slots of a
    3-block, 64-entry indexer cache for the store."""
    state = torch.full((4, 16, 512), math.nan)
    pos = torch.arange(n_tokens, dtype=torch.int64)
    save_partial_states(torch.randn(n_tokens, 256, generator=gen),
                        2 * torch.randn(n_tokens, 256, generator=gen),
                        0.5 * torch.randn(4, 256, generator=gen), pos, state, pos)
    win = pos[:, None] - 7 + torch.arange(8)
    gather = torch.where(win >= 0, win, torch.full_like(win, -1))
    rms = 1 + 0.1 * torch.randn(128, generator=gen)
    kv_slots = torch.randperm(3 * 64, generator=gen)[:n_tokens].long()
    return state, pos, gather, rms, kv_slots


def make_cache(num_blocks: int, block: int, entry: int, pad: int) -> tuple[torch.Tensor, ...]:
    backing = torch.full((num_blocks, block * entry + pad), POISON_BYTE, dtype=torch.uint8)
    return backing, backing[:, : block * entry]


def entry_byte_mask(num_blocks, block, entry, value_bytes, slots, row_bytes):
    """Bool mask over a [num_blocks, row_bytes] cache of the bytes of entries ``slots``."""
    mask = torch.zeros(num_blocks, row_bytes, dtype=torch.bool)
    scale_bytes = entry - value_bytes
    for s in slots:
        b, p = divmod(int(s), block)
        mask[b, p * value_bytes : (p + 1) * value_bytes] = True
        base = block * value_bytes + p * scale_bytes
        mask[b, base : base + scale_bytes] = True
    return mask


def read_entry(cache_2d, slot, block, value_bytes, scale_bytes):
    b, p = divmod(int(slot), block)
    vals = cache_2d[b, p * value_bytes : (p + 1) * value_bytes]
    base = block * value_bytes + p * scale_bytes
    return vals, cache_2d[b, base : base + scale_bytes]


def fp8_indexer_quant(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's indexer FP8 rule on one entry: bf16 round, scale 2^ceil(log2(max(amax,1e-4)/448))."""
    q = v.to(torch.bfloat16).float()
    amax = q.abs().amax().clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    b = (q / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return b, scale.reshape(1)


def e4m3_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def ordinal(x):
        x = x.to(torch.int32)
        mag = x & 0x7F
        return torch.where(x & 0x80 != 0, -mag, mag)

    return (ordinal(a) - ordinal(b)).abs()


def decode_mxfp4(vals: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    v = vals.to(torch.int64)
    nib = torch.stack([v & 0xF, v >> 4], dim=-1).reshape(-1)  # even index = low nibble
    mag = E2M1[nib & 7]
    x = torch.where(nib & 8 != 0, -mag, mag)
    s = torch.exp2(scales.to(torch.float32) - 127.0)
    return (x.view(-1, 32) * s[:, None]).reshape(-1)


def store_indexer(sc, cache_2d, block, dtype, **kw):
    compress_norm_rope_store_indexer(
        sc.state_cache, sc.gather_slots, sc.positions, sc.kv_slot_mapping, sc.rms_w, EPS,
        sc.cos_sin, cache_2d, block, sc.ratio, indexer_kv_dtype=dtype, **kw,
    )


def written_tokens(sc):
    closes = (sc.positions + 1) % sc.ratio == 0
    keep = closes & (sc.kv_slot_mapping >= 0)
    return keep.nonzero().view(-1).tolist()


# ------------------------------------------------------------------------------------------
# vs vLLM's C++ CPU op conventions: ``cpu_ops`` is the importing module's fixture
# ------------------------------------------------------------------------------------------
def cpp_writer(ops):
    """A :func:`make_scenario` ``writer`` that saves the rows through ``ops``'
    ``save_partial_states_cpu``."""

    def write(kv, score, ape, pos, cache, slots):
        ops.save_partial_states_cpu(kv, score, ape, pos, cache, slots)

    return write


@pytest.mark.parametrize("ratio,head_dim", [(4, 128), (128, 128), (4, 512), (128, 512)])
def test_save_partial_states_matches_cpu_op(cpu_ops, ratio, head_dim):
    ours = make_scenario(ratio, head_dim, **scenario_case(ratio), seed=41, pad_block_stride=48)
    theirs = make_scenario(ratio, head_dim, **scenario_case(ratio), seed=41, pad_block_stride=48,
                           writer=cpp_writer(cpu_ops))
    # identical bits, NaN padding and unwritten rows included
    assert torch.equal(ours.state_backing.view(torch.int32),
                       theirs.state_backing.view(torch.int32))


@pytest.mark.parametrize("ratio", [4, 128])
def test_indexer_fp8_store_matches_cpu_op(cpu_ops, ratio):
    pytest.importorskip("vllm_dsv4_backend.formats.indexer_cache")
    sc = make_scenario(ratio, 128, **scenario_case(ratio), seed=51 + ratio, pad_block_stride=24,
                       writer=cpp_writer(cpu_ops), no_kv_slot=NO_KV_SLOT[ratio])
    block, nblocks, pad = 4, 6, 40
    ours_backing, ours = make_cache(nblocks, block, 132, pad)
    ref_backing, ref = make_cache(nblocks, block, 132, pad)
    store_indexer(sc, ours, block, "fp8")
    cpu_ops.compress_norm_rope_store_indexer_cpu(
        sc.state_cache, sc.gather_slots, sc.positions, sc.kv_slot_mapping, sc.rms_w, EPS,
        sc.cos_sin, ref, block, ratio,
    )
    # Same math and rounding points; the op differs only in fp32 operation order (sequential
    # window sums, 16-lane RMS sum, its exp), which can move a bf16 rounding and hence an e4m3
    # code by one; the power-of-two scale only moves if amax straddles a power of two.
    rows = written_tokens(sc)
    assert len(rows) >= 2
    diff = 0
    for t in rows:
        v_ours, s_ours = read_entry(ours, sc.kv_slot_mapping[t], block, 128, 4)
        v_ref, s_ref = read_entry(ref, sc.kv_slot_mapping[t], block, 128, 4)
        assert torch.equal(s_ours, s_ref), t
        d = e4m3_ulp_distance(v_ours, v_ref)
        assert int(d.max()) <= 1, t
        diff += int((d > 0).sum())
    assert diff <= max(2, len(rows) * 128 // 100)  # under 1% of the codes
    # bytes outside the written entries identical (poison included)
    mask = entry_byte_mask(nblocks, block, 132, 128, sc.kv_slot_mapping[rows],
                           ours_backing.shape[1])
    assert torch.equal(ours_backing[~mask], ref_backing[~mask])
    assert (ours_backing[~mask] == POISON_BYTE).all()


@pytest.mark.parametrize("ratio", [4, 128])
def test_values_match_cpu_op_dequant(cpu_ops, ratio):
    """Our fp32 values vs the op's FP8 indexer cache, dequantized: within FP8 error."""
    sc = make_scenario(ratio, 128, **scenario_case(ratio), seed=61 + ratio,
                       writer=cpp_writer(cpu_ops))
    block, nblocks = 4, 6
    _, ref = make_cache(nblocks, block, 132, 0)
    cpu_ops.compress_norm_rope_store_indexer_cpu(
        sc.state_cache, sc.gather_slots, sc.positions, sc.kv_slot_mapping, sc.rms_w, EPS,
        sc.cos_sin, ref, block, ratio,
    )
    values, _ = run_compress(sc)
    rows = written_tokens(sc)
    assert rows
    for t in rows:
        v_ref, s_ref = read_entry(ref, sc.kv_slot_mapping[t], block, 128, 4)
        scale = s_ref.view(torch.float32)
        deq = v_ref.view(torch.float8_e4m3fn).float() * scale
        # e4m3 half-ulp 2^-4 relative, bf16 2^-9 relative, subnormal step 2^-9 * scale
        tol = (2.0**-4 + 2.0**-8) * values[t].abs() + scale * 2.0**-9
        assert ((deq - values[t]).abs() <= tol).all(), t


@pytest.mark.parametrize("ratio", [4, 128])
def test_main_store_matches_cpu_op(cpu_ops, ratio):
    pytest.importorskip("vllm_dsv4_backend.formats.fp8_ds_mla")
    sc = make_scenario(ratio, 512, **scenario_case(ratio), seed=71 + ratio, pad_block_stride=8,
                       writer=cpp_writer(cpu_ops))
    block, nblocks, pad = 2, 8, 576
    ours_backing, ours = make_cache(nblocks, block, 584, pad)
    ref_backing, ref = make_cache(nblocks, block, 584, pad)
    compress_norm_rope_store_main(
        sc.state_cache, sc.gather_slots, sc.positions, sc.kv_slot_mapping, sc.rms_w, EPS,
        sc.cos_sin, ours, block, ratio,
    )
    cpu_ops.compress_norm_rope_store_cpu(
        sc.state_cache, sc.gather_slots, sc.positions, sc.kv_slot_mapping, sc.rms_w, EPS,
        sc.cos_sin, ref, block, ratio,
    )
    rows = written_tokens(sc)
    assert rows
    diff = 0
    for t in rows:
        d_ours, s_ours = read_entry(ours, sc.kv_slot_mapping[t], block, 576, 8)
        d_ref, s_ref = read_entry(ref, sc.kv_slot_mapping[t], block, 576, 8)
        assert torch.equal(s_ours, s_ref), t
        d = e4m3_ulp_distance(d_ours[:448], d_ref[:448])
        assert int(d.max()) <= 1, t
        diff += int((d > 0).sum())
        r_ours = d_ours[448:].view(torch.int16).to(torch.int32)
        r_ref = d_ref[448:].view(torch.int16).to(torch.int32)
        assert int((r_ours - r_ref).abs().max()) <= 1, t  # bf16 RoPE part: <= 1 ulp
        diff += int((r_ours != r_ref).sum())
    assert diff <= max(2, len(rows) * 512 // 100)
    mask = entry_byte_mask(nblocks, block, 584, 576, sc.kv_slot_mapping[rows],
                           ours_backing.shape[1])
    assert torch.equal(ours_backing[~mask], ref_backing[~mask])
    assert (ours_backing[~mask] == POISON_BYTE).all()


