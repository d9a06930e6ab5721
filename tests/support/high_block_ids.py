# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Physical block ids past the int32 byte-offset boundary (torch only): the far buffer and
the checks shared by tests/core/test_high_block_ids.py (the plugin's ops and its torch
fallbacks of vLLM's CPU ops) and tests/vllm/test_high_block_ids_vllm.py (vLLM's C++
kernels); see the core module's docstring for the bug class and the memory plan.

The fixtures :func:`far` (the lazily mapped ``2**31 + 8 MiB`` buffer, module scope) and
:func:`one_thread` (autouse, module scope) are bound by importing them into a test module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.support.oracle import (
    assert_flashmla_close,
    dequant_slots_f64,
    e4m3_table,
    quantize_ref,
    read_token_bytes,
    sparse_decode_ref,
)
from tests.support.threads import one_thread_fixture
from vllm_dsv4_backend.formats import fp8_ds_mla as F
from vllm_dsv4_backend.formats import indexer_cache as ic

BOUNDARY = 1 << 31
FAR_BYTES = BOUNDARY + (8 << 20)
POISON = 0xFF
E4M3 = e4m3_table()
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
ROPE = 64
EPS = 1e-6


# Small ops on a shared 2-core box: one intra-op thread avoids OpenMP barrier stalls.
one_thread = one_thread_fixture(autouse=True)


@dataclass
class Far:
    """The lazily mapped buffer and the cache views over it."""

    buf: torch.Tensor

    def blocks(self, block_bytes: int, stride: int, count: int, after: int = BOUNDARY
               ) -> tuple[torch.Tensor, int]:
        """A uint8 ``[b0 + count, block_bytes]`` view with row stride ``stride`` from byte 0
        and ``b0``, its first block starting at or after byte ``after`` (so the byte offset of
        blocks ``b0 ..`` is ``>= 2**31``); blocks ``b0 ..`` and block 0 are poisoned."""
        b0 = -(-after // stride)
        assert b0 * stride >= BOUNDARY and (b0 + count) * stride <= self.buf.numel()
        view = self.buf.as_strided((b0 + count, block_bytes), (stride, 1), 0)
        view[b0:].fill_(POISON)
        view[0].fill_(POISON)
        return view, b0

    def end(self, stride: int, b0: int, count: int) -> int:
        """First byte after blocks ``b0 .. b0 + count - 1`` (where the next region may go)."""
        return (b0 + count) * stride


@pytest.fixture(scope="module")
def far() -> Iterator[Far]:
    # torch.empty does not touch the pages: only what the tests fill becomes resident.
    buf = torch.empty(FAR_BYTES, dtype=torch.uint8)
    yield Far(buf)
    del buf


Span = tuple[int, int, int]  # (block, first byte, end byte) inside a block row


def assert_untouched(view2d: torch.Tensor, b0: int, written: list[Span]) -> None:
    """Every byte of the poisoned rows (block 0 and blocks ``b0..``) outside the ``written``
    spans is still the poison. Only those rows are read: the rest of the view is never
    touched (reading it would map 2 GiB)."""
    rows = [0, *range(b0, view2d.shape[0])]
    where = {b: i for i, b in enumerate(rows)}
    got = view2d[torch.tensor(rows)]
    mask = torch.zeros(got.shape, dtype=torch.bool)
    for b, lo, hi in written:
        mask[where[b], lo:hi] = True
    bad = (got != POISON) & ~mask
    assert not bool(bad.any()), f"{int(bad.sum())} byte(s) outside the written entries changed"


# --------------------------------------------------------------------------------------------
# fp8_ds_mla (584 B/token, block-split, padded block stride)
# --------------------------------------------------------------------------------------------
def mla_cache(far: Far, block_size: int, count: int, after: int = BOUNDARY
               ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(cache [nb, B, 584], blocks_2d, b0, end)`` with blocks ``b0..`` past 2**31 bytes."""
    stride = F.padded_block_stride(block_size)
    view2d, b0 = far.blocks(F.BYTES_PER_TOKEN * block_size, stride, count, after)
    cache = view2d.as_strided((view2d.shape[0], block_size, F.BYTES_PER_TOKEN),
                              (stride, F.BYTES_PER_TOKEN, 1), 0)
    return cache, view2d, b0, far.end(stride, b0, count)


def mla_spans(block_size: int, slots: torch.Tensor) -> list[Span]:
    spans = []
    for s in slots.tolist():
        b, t = divmod(s, block_size)
        spans += [(b, 576 * t, 576 * (t + 1)),
                  (b, 576 * block_size + 8 * t, 576 * block_size + 8 * (t + 1))]
    return spans


def named_indices(g: torch.Generator, b: int, topk: int, pool: torch.Tensor,
                   lens: torch.Tensor | None) -> torch.Tensor:
    """int32 ``[b, 1, topk]`` drawn from ``pool`` with -1 holes (and garbage past ``lens``)."""
    idx = pool[torch.randint(0, len(pool), (b, 1, topk), generator=g)].to(torch.int32)
    idx[torch.rand(b, 1, topk, generator=g) < 0.2] = -1
    if lens is not None:
        beyond = torch.arange(topk).view(1, 1, -1) >= lens.view(-1, 1, 1).long()
        idx[beyond] = -1
    return idx


# --------------------------------------------------------------------------------------------
# indexer K cache (FP8 132 B / MXFP4 68 B per entry, 64 entries per block)
# --------------------------------------------------------------------------------------------
IND_BS = 64


def ind_cache(far: Far, dtype: str, count: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    eb = ic.entry_bytes(dtype)
    view2d, b0 = far.blocks(IND_BS * eb, IND_BS * eb, count)
    return view2d.view(view2d.shape[0], IND_BS, eb), view2d, b0


def ind_layout(dtype: str, slot: int) -> tuple[int, int, int, int, int]:
    """``(block, value offset, value bytes, scale offset, scale bytes)`` in a block row."""
    vb = ic.HEAD_DIM if dtype == "fp8" else ic.HEAD_DIM // 2
    b, o = divmod(slot, IND_BS)
    return b, vb * o, vb, vb * IND_BS + 4 * o, 4


def ind_decode_f64(view2d: torch.Tensor, dtype: str, slots: list[int]) -> torch.Tensor:
    """float64 ``[M, 128]`` keys decoded from the raw block bytes."""
    rows = []
    for s in slots:
        b, vo, vb, so, sb = ind_layout(dtype, s)
        vals, scl = view2d[b, vo : vo + vb], view2d[b, so : so + sb]
        if dtype == "fp8":
            rows.append(E4M3[vals.long()] * float(scl.clone().view(torch.float32)))
        else:
            nib = torch.stack([vals.long() & 0xF, vals.long() >> 4], -1).reshape(-1)
            mag = E2M1[nib & 7] * torch.where(nib >= 8, -1.0, 1.0).double()
            rows.append((mag.view(4, 32) * torch.pow(2.0, scl.double() - 127).view(4, 1))
                        .reshape(-1))
    return torch.stack(rows)


def logits_ref(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor
                ) -> torch.Tensor:
    """float64 ``I[t, j] = sum_h w[t, h] relu(q[t, h] . k[t, j])``, -inf for ``j >= lens[t]``."""
    s = torch.einsum("thd,tjd->thj", q, keys).clamp(min=0)
    out = torch.einsum("th,thj->tj", w.double(), s)
    return out.masked_fill(torch.arange(keys.shape[1]) >= lens.view(-1, 1), -math.inf)


def check_topk_set(got: torch.Tensor, ref_row: torch.Tensor, k: int, band: float) -> None:
    """``got`` (local ids, -1 padded) is a top-``k`` set of the float64 scores ``ref_row``
    (the visible entries) up to ``band``: every entry scoring above the k-th best + band is
    in, every one below it - band is out (entries within the band may go either way, as the
    fp32 logits may order them differently). ``n <= k`` visible entries: all of them."""
    ids = got[got >= 0].tolist()
    assert len(set(ids)) == len(ids) == min(k, ref_row.numel())
    if ref_row.numel() <= k:
        assert set(ids) == set(range(ref_row.numel()))
        return
    v = float(torch.topk(ref_row, k).values[-1])
    inside = torch.zeros(ref_row.numel(), dtype=torch.bool)
    inside[torch.tensor(ids)] = True
    assert bool(inside[ref_row > v + band].all()), "a clear top-k entry is missing"
    assert not bool(inside[ref_row < v - band].any()), "a clearly lower entry was kept"
    assert bool(((ref_row - v).abs() <= band).sum() < k // 4), "the case must mostly rank"


# --------------------------------------------------------------------------------------------
# compressor: fp32 state cache and the three quantized stores
# --------------------------------------------------------------------------------------------
def far_state_cache(far: Far, row: int, sbs: int, count: int, after: int
                 ) -> tuple[torch.Tensor, int, int]:
    """fp32 ``[nb, sbs, row]`` view whose blocks ``b0..`` start past 2**31 bytes, NaN."""
    stride = sbs * row  # elements
    b0 = -(-after // (4 * stride))
    assert 4 * b0 * stride >= BOUNDARY and 4 * (b0 + count) * stride <= FAR_BYTES
    f32 = far.buf.view(torch.float32)
    st = f32.as_strided((b0 + count, sbs, row), (stride, row, 1), 0)
    st[b0:].fill_(math.nan)
    return st, b0, 4 * (b0 + count) * stride


def compress_ref(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, p: int, ratio: int,
                  d: int, rms_w: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """float64 compressed entry of the window ending at ``p`` from the raw per-position rows
    (softmax over the window per channel, C4 overlap on channels ``[:d]``, RMSNorm, GPT-J
    RoPE at the window start)."""
    coff = 2 if ratio == 4 else 1
    j = p // ratio
    kv64 = kv.double()
    sc64 = score.double() + ape.double()[torch.arange(kv.shape[0]) % ratio]
    cur = torch.arange(j * ratio, (j + 1) * ratio)
    rows_kv, rows_sc = [kv64[cur, d * (coff - 1):d * coff]], [sc64[cur, d * (coff - 1):d * coff]]
    if coff == 2 and j > 0:
        prev = torch.arange((j - 1) * ratio, j * ratio)
        rows_kv.insert(0, kv64[prev, :d])
        rows_sc.insert(0, sc64[prev, :d])
    x = (torch.softmax(torch.cat(rows_sc), 0) * torch.cat(rows_kv)).sum(0)
    y = x / torch.sqrt((x * x).mean() + EPS) * rms_w.double()
    cs = cos_sin[j * ratio].double()
    cos, sin = cs[: ROPE // 2], cs[ROPE // 2 :]
    e, o = y[d - ROPE :: 2].clone(), y[d - ROPE + 1 :: 2].clone()
    y[d - ROPE :: 2] = e * cos - o * sin
    y[d - ROPE + 1 :: 2] = o * cos + e * sin
    return y


def assert_fp8_close(dec: torch.Tensor, ref: torch.Tensor, tile_scale: torch.Tensor,
               small: float) -> None:
    """e4m3 of the bf16-rounded value: within half an e4m3 ulp (2**-4 relative) plus bf16 and
    fp32 rounding, and ``small`` times the tile scale near zero (2**-10: half a subnormal
    step; 2**-6 for a writer that flushes subnormals to zero)."""
    tol = ref.abs() * (2.0**-4 + 2.0**-8) + tile_scale * small + 1e-6
    bad = (dec - ref).abs() > tol
    assert not bool(bad.any()), (
        f"{int(bad.sum())} value(s) off, e.g. {dec[bad][:3].tolist()} vs {ref[bad][:3].tolist()}"
    )


def check_compressor_far(far: Far, ratio: int, store: str, save_fn: Callable[..., None],
                         store_fn: Callable[..., None], small: float) -> None:
    """``save_fn`` (``save_partial_states``' arguments) writes the raw rows into far state
    blocks (exactly, nothing else), and ``store_fn`` (the compress store of ``store``, the C++
    ops' positional arguments) reads its window there and writes its entry into a far block
    of the KV / indexer cache: the entry decodes to the float64 oracle within the format's
    rounding (``small``: see :func:`assert_fp8_close`) and has the bytes the same op writes at low
    block ids."""
    d = 512 if store == "main" else 128
    coff = 2 if ratio == 4 else 1
    width, sbs = coff * d, 4 if ratio == 4 else 8
    window = coff * ratio
    n_pos = window  # positions 0 .. window-1; the last one closes window j = n_pos//ratio - 1
    st, sb0, end = far_state_cache(far, 2 * width, sbs, -(-n_pos // sbs), BOUNDARY)
    g = torch.Generator().manual_seed(ratio + d)
    kv = torch.randn(n_pos, width, generator=g)
    score = 2.0 * torch.randn(n_pos, width, generator=g)
    ape = 0.5 * torch.randn(ratio, width, generator=g)
    pos = torch.arange(n_pos)
    state_slots = sb0 * sbs + pos
    save_fn(kv, score, ape, pos, st, state_slots)
    got_rows = st.reshape(-1, 2 * width)[state_slots]
    want_rows = torch.cat([kv.double(), score.double() + ape.double()[pos % ratio]], 1)
    assert torch.equal(got_rows.double(), want_rows.float().double())
    assert bool(st[sb0:].reshape(-1, 2 * width)[n_pos:].isnan().all())

    p = n_pos - 1
    gather = torch.where(pos + p - window + 1 >= 0, state_slots, -1).view(1, -1)
    rms_w = 1.0 + 0.3 * torch.randn(d, generator=g)
    angles = torch.arange(n_pos).double().unsqueeze(1) / 10000 ** (torch.arange(32) / 32)
    cos_sin = torch.cat([angles.cos(), angles.sin()], 1).float()

    if store == "main":
        cbs = 64 if ratio == 4 else 2
        cache, view2d, cb0, _ = mla_cache(far, cbs, 1, after=end)
        low = F.allocate_cache(1, cbs, fill=POISON)
        kv_2d, low_2d = view2d, F.cache_layout(low).blocks_2d(low)
    else:
        cbs = IND_BS
        eb = ic.entry_bytes(store)
        view2d, cb0 = far.blocks(cbs * eb, cbs * eb, 1, after=end)
        kv_2d, low_2d = view2d, torch.full((1, cbs * eb), POISON, dtype=torch.uint8)
    entry = cbs - 1
    store_fn(st, gather, torch.tensor([p]), torch.tensor([cb0 * cbs + entry]), rms_w, EPS,
             cos_sin, kv_2d, cbs, ratio)

    # The same op on a one-block state and cache at block ids 0 writes the same bytes.
    st_low = st[sb0:].clone()
    store_fn(st_low, gather - sb0 * sbs, torch.tensor([p]), torch.tensor([entry]), rms_w, EPS,
             cos_sin, low_2d, cbs, ratio)
    assert torch.equal(kv_2d[cb0], low_2d[0])

    ref = compress_ref(kv, score, ape, p, ratio, d, rms_w, cos_sin)
    slot = torch.tensor([cb0 * cbs + entry])
    if store == "main":
        dec = dequant_slots_f64(cache, slot)[0]
        _, _, scl, _ = read_token_bytes(cache, slot)
        tile = torch.pow(2.0, scl[0].double() - 127).repeat_interleave(64)
        assert_fp8_close(dec[:448], ref[:448], tile, small)
        torch.testing.assert_close(dec[448:], ref[448:], rtol=2.0**-8, atol=1e-6)
        written = mla_spans(cbs, slot)
    else:
        dec = ind_decode_f64(view2d, store, slot.tolist())[0]
        b, vo, vb, so, sb = ind_layout(store, int(slot))
        if store == "fp8":
            s = float(view2d[b, so : so + sb].clone().view(torch.float32))
            assert_fp8_close(dec, ref, torch.full_like(ref, s), small)
        else:
            s = torch.pow(2.0, view2d[b, so : so + sb].double() - 127).repeat_interleave(32)
            # e2m1 steps: 0.5 below 2, 1 below 4, 2 up to 6 (in units of the block scale).
            tol = torch.clamp(ref.abs() / s / 4, min=0.25) * s + ref.abs() * 2.0**-8 + 1e-6
            assert bool(((dec - ref).abs() <= tol).all())
        written = [(b, vo, vo + vb), (b, so, so + sb)]
    assert_untouched(view2d, cb0, written)


def check_swa_insert_op(far: Far, ops_ns: Any) -> None:
    """``fused_qnorm_rope_kv_insert_cpu`` (positions 0: identity RoPE) writes far SWA slots
    (and a block-0 slot) with the oracle quantizer's bytes, except the e4m3 subnormals the
    writer flushes to signed zero, and nothing else."""
    bs = 64
    cache, view2d, b0, _ = mla_cache(far, bs, 2)
    g = torch.Generator().manual_seed(5)
    slots = torch.cat([torch.randperm(2 * bs, generator=g)[:6] + b0 * bs, torch.tensor([9])])
    n = len(slots)
    kv = (torch.randn(n, 512, generator=g) / 4).to(torch.bfloat16)
    cos_sin = torch.cat([torch.ones(4, 32), torch.zeros(4, 32)], dim=1)
    ops_ns.fused_qnorm_rope_kv_insert_cpu(
        torch.zeros(n, 1, 512, dtype=torch.bfloat16), kv.contiguous(),
        torch.zeros(n, dtype=torch.int64), view2d, slots, cos_sin, 1, 1e-6, bs)

    nope, rope, scale, pad = read_token_bytes(cache, slots)
    want_nope, want_scale, want_rope = quantize_ref(kv)
    subnormal = ((want_nope & 0x78) == 0) & ((want_nope & 0x07) != 0)
    assert torch.equal(nope[~subnormal], want_nope[~subnormal])
    assert bool(((nope[subnormal] & 0x7F) == 0).all())
    assert torch.equal(scale, want_scale)
    assert torch.equal(rope.view(torch.int16), want_rope.view(torch.int16))
    assert bool((pad == 0).all())
    assert_untouched(view2d, b0, mla_spans(bs, slots))


@dataclass
class FarSparseMlaCase:
    """A decode batch of sparse MLA over a window cache (64-token blocks) and a compressed
    cache whose named slots sit past the boundary (plus block-0 slots)."""

    win: torch.Tensor  # [nb, 64, 584] fp8_ds_mla cache
    win2d: torch.Tensor  # its uint8 block rows
    comp: torch.Tensor
    comp2d: torch.Tensor
    extra_block_size: int
    idx: torch.Tensor  # int32 [t, 1, 128] window slots, -1 holes
    lens: torch.Tensor  # int32 [t] valid window slots
    extra: torch.Tensor  # int32 [t, 1, 128] compressed slots, -1 holes
    q: torch.Tensor  # bf16 [t, 1, h, 512]
    sink: torch.Tensor  # [h]
    scale: float

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float64 oracle's ``(out, lse)``."""
        return sparse_decode_ref(self.q, [(self.win, self.idx, self.lens),
                                          (self.comp, self.extra, None)], self.sink, self.scale)


def far_sparse_mla_case(far: Far, extra_block_size: int) -> FarSparseMlaCase:
    """3 tokens, 64 heads: the case of :func:`check_sparse_mla_op` and of the vLLM
    adapter's test (tests/vllm/test_high_block_ids_vllm.py)."""
    win, win2d, wb0, end = mla_cache(far, 64, 2)
    comp, comp2d, cb0, _ = mla_cache(far, extra_block_size, 2, after=end)
    g = torch.Generator().manual_seed(13 + extra_block_size)
    win_pool = torch.cat([torch.arange(wb0 * 64, (wb0 + 2) * 64), torch.tensor([3, 60])])
    comp_pool = torch.cat([torch.arange(cb0 * extra_block_size, (cb0 + 2) * extra_block_size),
                           torch.tensor([1])])
    for cache, pool in ((win, win_pool), (comp, comp_pool)):
        kv = (torch.randn(len(pool), 512, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
        F.quantize_and_insert(kv, cache, pool)
    t, h = 3, 64
    lens = torch.tensor([128, 77, 100], dtype=torch.int32)
    idx = named_indices(g, t, 128, win_pool, lens)
    extra = named_indices(g, t, 128, comp_pool, None)
    q = torch.randn(t, 1, h, 512, generator=g).clamp(-1, 1).to(torch.bfloat16)
    sink = torch.randn(h, generator=g) + 4.0
    return FarSparseMlaCase(win, win2d, comp, comp2d, extra_block_size, idx, lens, extra, q,
                            sink, 512**-0.5)


def check_sparse_mla_op(far: Far, ops_ns: Any, extra_block_size: int, tol: dict) -> None:
    """``flash_mla_with_kvcache_cpu`` (2-D caches, int64 slot rows, lengths as -1) over
    window and compressed slots past the boundary agrees with the float64 oracle."""
    c = far_sparse_mla_case(far, extra_block_size)
    t, _, h, _ = c.q.shape
    out = torch.empty(t, h, 512, dtype=torch.bfloat16)
    ops_ns.flash_mla_with_kvcache_cpu(out, c.q[:, 0].contiguous(), c.win2d,
                                      c.idx[:, 0].long().contiguous(), 64, c.comp2d,
                                      c.extra[:, 0].long().contiguous(), extra_block_size,
                                      c.sink, c.scale)
    ref, _ = c.reference()
    assert_flashmla_close(out.unsqueeze(1), ref, name="out", **tol)


def check_logits_topk_ops(far: Far, ops_ns: Any) -> None:
    """``fp8_paged_mqa_logits_cpu`` over indexer pages past the boundary (a block-0 page
    among them) matches the float64 oracle; ``topk_transform_512_cpu`` keeps the oracle's
    top-512 and writes their far global page ids."""
    n_pages, bs = 10, IND_BS
    cache, view2d, b0 = ind_cache(far, "fp8", n_pages - 1)
    g = torch.Generator().manual_seed(23)
    blocks = torch.tensor([b0 + i for i in range(n_pages - 1)] + [0])
    all_slots = blocks.repeat_interleave(bs) * bs + torch.arange(bs).repeat(n_pages)
    ic.quantize_and_insert(torch.randn(len(all_slots), 128, generator=g).to(torch.bfloat16),
                           cache, all_slots, "fp8")
    t, h = 4, 64
    n_entries = n_pages * bs
    # Each token its own page order (block 0 among them), as vLLM's per-token page table.
    pages = torch.stack([blocks[torch.randperm(n_pages, generator=g)] for _ in range(t)])
    pages = pages.to(torch.int32)
    lens = torch.tensor([n_entries, 600, 513, 300], dtype=torch.int32)
    q = torch.randn(t, h, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(t, h, generator=g)
    logits = ops_ns.fp8_paged_mqa_logits_cpu(q, view2d, w, lens, pages, bs, n_entries)

    slots = pages.long().repeat_interleave(bs, dim=1) * bs + torch.arange(bs).repeat(n_pages)
    uniq, inv = torch.unique(slots, return_inverse=True)
    keys = ind_decode_f64(view2d, "fp8", uniq.tolist())[inv]
    ref = logits_ref(E4M3[q.view(torch.uint8).long()], w, keys, lens.long())
    valid = torch.isfinite(ref)
    scale = float(ref[valid].abs().max())
    torch.testing.assert_close(logits[valid].double(), ref[valid], rtol=1e-4,
                               atol=1e-5 * scale)

    out_pages = torch.empty(t, 512, dtype=torch.int32)
    out_raw = torch.empty(t, 512, dtype=torch.int32)
    ops_ns.topk_transform_512_cpu(logits, lens, pages, out_pages, bs, out_raw)
    for r in range(t):
        n = int(lens[r])
        band = 2 * (1e-4 * float(ref[r, :n].abs().max()) + 1e-5 * scale)
        check_topk_set(out_raw[r], ref[r, :n], 512, band)
        got = out_raw[r][out_raw[r] >= 0].long()
        assert torch.equal(out_pages[r][out_raw[r] >= 0].long(), slots[r, got])


def check_topk_page_ids_wrap(ops_ns: Any) -> None:
    """Records the int32 limit of ``topk_transform_512_cpu``'s page-id output: a global id
    ``page * 64 + offset >= 2**31`` comes out wrapped (two's complement), the raw local ids
    stay right. Whoever changes that (refusing, widening) makes this fail and should update
    tests/vllm/test_high_block_ids_vllm.py's docstring."""
    bs, t, width = 64, 1, 700
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(t, width, generator=g)
    lens = torch.tensor([width], dtype=torch.int32)
    first = 2**31 // bs - 3  # pages 3.. of the table hold ids >= 2**31
    pages = (first + torch.arange(11, dtype=torch.int64)).view(1, -1).to(torch.int32)
    out_pages = torch.empty(t, 512, dtype=torch.int32)
    out_raw = torch.empty(t, 512, dtype=torch.int32)
    ops_ns.topk_transform_512_cpu(scores, lens, pages, out_pages, bs, out_raw)
    raw = out_raw[0].long()
    assert set(raw.tolist()) == set(torch.topk(scores[0], 512).indices.tolist())
    true_ids = pages[0].long()[raw // bs] * bs + raw % bs
    past = true_ids >= 2**31
    assert bool(past.any()) and bool((~past).any())
    assert torch.equal(out_pages[0].long()[~past], true_ids[~past])
    wrapped = true_ids[past] - 2**32
    assert torch.equal(out_pages[0].long()[past], wrapped), "the page ids no longer wrap"


