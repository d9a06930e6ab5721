# SPDX-License-Identifier: Apache-2.0
"""The failures filed against vLLM's DeepSeek-V4 path, as tests of the plugin (torch only).

Issue 13, item 3. Each section cites its upstream thread. tests/vllm/
test_batch_invariance_kernels.py runs the cheap real-kernel counterparts (vLLM's
C++ CPU ops, vLLM's KV-cache specs); this module never imports vLLM.

Poison convention: bytes no valid entry owns are 0xFF (NaN in e4m3, bf16 and
fp32), so an out-of-range read shows up as NaN or as a changed result.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.compressor_store import indexer_store_case
from tests.support.families import FAMILIES
from vllm_dsv4_backend import eager, ops
from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.formats import indexer_cache as ic
from vllm_dsv4_backend.layer.plan import Dims, build_workspace_config, dims_from_hf_config
from vllm_dsv4_backend.ops import compressor as comp_ops
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.ops import metadata as md_ops
from vllm_dsv4_backend.ops import rope, slots
from vllm_dsv4_backend.testing.schedule import WIDE_PLAN
from vllm_dsv4_backend.vllm_compat import cpu_ops
from vllm_dsv4_backend.workspace import (
    WorkspaceCapacityError,
    WorkspaceLeaseError,
    WorkspaceManager,
    count_allocations,
)

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = ROOT / "configs" / "tiny-dsv4" / "config.json"
POISON = 0xFF
TOPK = 512
INT32_MIN = -(2**31)
DTYPES = ["fp8", "mxfp4"]


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor (a bitwise, NaN-safe comparison)."""
    t = t.contiguous()
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def _attend(q, swa, win, win_lens, sink, scale, out, comp, glob, glob_lens) -> None:
    """Sparse MLA of ``T`` tokens (``q`` / ``out`` ``[T, H, 512]``, index lists ``[T, n]``)
    over window + compressed entries into ``out``, without the lse: the CPU layer's call."""
    ops.sparse_mla_decode(q.unsqueeze(1), swa, win.unsqueeze(1), win_lens, sink, scale, comp,
                          glob.unsqueeze(1), glob_lens, out=out.unsqueeze(1), need_lse=False)


def _storage(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def _cos_sin(max_pos: int = 4096) -> torch.Tensor:
    inv = 1.0 / 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).float()


def _indexer_cache(dtype: str, nb: int, bs: int = 64) -> torch.Tensor:
    return torch.full((nb, bs, ic.entry_bytes(dtype)), POISON, dtype=torch.uint8)


def _poisoned_caches(dtype: str) -> tuple[torch.Tensor, ...]:
    """Two blocks of each cache one C4 layer writes, every byte poisoned: the SWA and
    compressed fp8_ds_mla caches, the indexer K cache, the indexer and main compressor
    states."""
    return (fp8_ds_mla.allocate_cache(2, 64, fill=POISON),
            fp8_ds_mla.allocate_cache(2, 64, fill=POISON), _indexer_cache(dtype, 2),
            torch.full((2, 16, 512), math.nan), torch.full((2, 16, 2048), math.nan))


def _iq(dtype: str, t: int, gen: torch.Generator, pos: torch.Tensor | None = None):
    pos = torch.zeros(t, dtype=torch.int64) if pos is None else pos
    return indexer_ops.indexer_q_rope_quant(
        torch.randn(t, 64, 128, generator=gen).to(torch.bfloat16), pos, _cos_sin(),
        torch.randn(t, 64, generator=gen), softmax_scale=128**-0.5, head_scale=64**-0.5,
        dtype=dtype)


# ==========================================================================================
# 1. All-zero indexer lengths and empty batches, as in vLLM's dummy and capture runs.
#    vllm-project/vllm#51970 (FULL cudagraph capture: all-zero indexer seq_lens hit an
#    out-of-bounds read in DeepGEMM's paged-MQA metadata kernel) and vllm-project/vllm#51181
#    (DSpark capture: the small dummy batch meets the OOB edge q_idx == batch_size).
# ==========================================================================================
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [0, 1, 64, 700])
def test_zero_indexer_lengths_logits_read_nothing(dtype, width):
    """seq_lens all 0 over a fully poisoned cache and an all-zero block table (vLLM's
    dummy metadata): every logit is -inf, none is NaN, nothing raises; the ``out``
    buffer's columns [0, width) are all written."""
    gen = torch.Generator().manual_seed(1)
    t = 4
    cache = _indexer_cache(dtype, 3)
    iq = _iq(dtype, t, gen)
    bt = torch.zeros(t, 11, dtype=torch.int32)
    lens = torch.zeros(t, dtype=torch.int32)
    res = indexer_ops.indexer_logits(iq.q, iq.q_scale, iq.weights, cache, lens, bt,
                                     dtype=dtype, max_seq_len=width)
    assert res.shape == (t, width)
    assert bool((res == -math.inf).all())
    out = torch.full((t, width + 5), math.nan)
    got = indexer_ops.indexer_logits(iq.q, iq.q_scale, iq.weights, cache, lens, bt,
                                     dtype=dtype, max_seq_len=width, out=out)
    assert bool((got == -math.inf).all()) and got.shape == (t, width)
    if width:
        assert got.data_ptr() == out.data_ptr()
    # Empty batch.
    e = indexer_ops.indexer_logits(iq.q[:0], None if iq.q_scale is None else iq.q_scale[:0],
                                   iq.weights[:0], cache, lens[:0], bt[:0], dtype=dtype,
                                   max_seq_len=width)
    assert e.shape == (0, width)


def test_zero_indexer_lengths_topk_and_slots():
    """Zero visible entries: top-k all -1 whatever the (NaN) logits hold, global slots -1
    and lengths 0 (also with an empty block table), empty batches fine."""
    t = 5
    logits = torch.full((t, 600), math.nan)
    lens = torch.zeros(t, dtype=torch.int32)
    out = torch.full((t, TOPK), INT32_MIN, dtype=torch.int32)
    indexer_ops.indexer_topk(logits, None, TOPK, seq_lens=lens, out=out)
    assert bool((out == -1).all())
    for bt in (torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 0, dtype=torch.int32)):
        g = torch.full((t, TOPK), INT32_MIN, dtype=torch.int32)
        n = torch.full((t,), INT32_MIN, dtype=torch.int32)
        indexer_ops.local_to_global(out, torch.zeros(t, dtype=torch.int64), bt, 64, g, n)
        assert bool((g == -1).all()) and bool((n == 0).all())
    # positions 0..2 see no compressed entry ((p + 1) // 4 == 0)
    e = indexer_ops.indexer_topk(logits[:0], torch.zeros(0, dtype=torch.int64), TOPK)
    assert e.shape == (0, TOPK)
    g, n = indexer_ops.local_to_global(out[:0], torch.zeros(0, dtype=torch.int64),
                                       torch.zeros(1, 4, dtype=torch.int32), 64)
    assert g.shape == (0, TOPK) and n.shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scored", [False, True], ids=["short-rule", "indexer"])
def test_zero_visible_select_topk_c4(dtype, scored):
    """Tokens at positions 0, 1, 2 (a fresh prompt, or vLLM's dummy tokens at position 0)
    through eager.select_topk_c4, short-context rule and indexer path, over a poisoned
    indexer cache: local and global ids -1, lengths 0, every output row written."""
    gen = torch.Generator().manual_seed(2)
    pos = torch.tensor([0, 1, 2, 0], dtype=torch.int64)
    t = pos.numel()
    t2r = torch.tensor([0, 0, 0, 1])
    bt = torch.zeros(2, 3, dtype=torch.int32)  # vLLM's dummy block table: all block 0
    iq = _iq(dtype, t, gen, pos)
    local = torch.full((t, TOPK), INT32_MIN, dtype=torch.int32)
    glob = torch.full((t, TOPK), INT32_MIN, dtype=torch.int32)
    lens = torch.full((t,), INT32_MIN, dtype=torch.int32)
    eager.select_topk_c4(
        positions=pos, token_to_req=t2r, compressed_block_table=bt, entries_per_block=64,
        index_topk=TOPK, out_local=local, out_global=glob, out_lens=lens,
        arange=torch.arange(TOPK, dtype=torch.int32), minus_one=torch.tensor(-1, dtype=torch.int32),
        index_q=iq.q if scored else None, index_q_scale=iq.q_scale if scored else None,
        index_weights=iq.weights if scored else None, indexer_k_cache=_indexer_cache(dtype, 3),
        indexer_block_table=bt, indexer_kv_dtype=dtype, max_compressed=0)
    assert bool((local == -1).all()) and bool((glob == -1).all()) and bool((lens == 0).all())


def test_empty_rows_attend_zero_over_poisoned_caches():
    """Rows with no valid entry (all -1, or lengths 0 over indices that name poisoned
    slots) give out = 0 and lse = +inf, never NaN: decode with window + compressed caches,
    with and without the lse (the layer's call, into a NaN-filled ``out``), and prefill over
    a NaN KV buffer."""
    gen = torch.Generator().manual_seed(3)
    h, t = 8, 4
    swa = fp8_ds_mla.allocate_cache(3, 64, fill=POISON)
    comp = fp8_ds_mla.allocate_cache(3, 64, fill=POISON)
    q = torch.randn(t, 1, h, 512, generator=gen).to(torch.bfloat16)
    sink = torch.randn(h, generator=gen)
    named = torch.randint(0, 3 * 64, (t, 1, 128), generator=gen, dtype=torch.int32)
    zeros = torch.zeros(t, dtype=torch.int32)
    minus = torch.full((t, 1, 128), -1, dtype=torch.int32)
    for wi, wl, ci, cl in ((minus, None, minus, None), (named, zeros, named, zeros)):
        o, lse = ops.sparse_mla_decode(q, swa, wi, wl, sink, 0.04, comp, ci, cl)
        assert bool((o.float() == 0).all()), "empty row must be exactly 0"
        assert bool((lse == math.inf).all())
    out = torch.full((t, h, 512), math.nan, dtype=torch.bfloat16)
    _attend(q[:, 0], swa, named[:, 0], zeros, sink, 0.04, out, comp, named[:, 0], zeros)
    assert bool((out.float() == 0).all())
    kv = torch.full((50, 1, 512), math.nan, dtype=torch.bfloat16)
    pidx = torch.randint(0, 50, (t, 1, 64), generator=gen, dtype=torch.int32)
    for idx, tl in ((torch.full_like(pidx, -1), None), (pidx, zeros)):
        o, ml, lse = ops.sparse_mla_prefill(q[:, 0], kv, idx, 0.04, sink, tl)
        assert bool((o.float() == 0).all()) and bool((ml == -math.inf).all())
        assert bool((lse == math.inf).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_batch_through_every_op(dtype):
    """T = 0 (an empty micro-batch, a capture size with no tokens): every op of the eager
    region returns correctly shaped outputs, raises nothing and writes no cache byte."""
    cs = _cos_sin()
    caches = _poisoned_caches(dtype)
    swa, comp, ind, ist, mst = caches
    before = [_storage(x) for x in caches]
    e64 = torch.zeros(0, dtype=torch.int64)
    e32 = torch.zeros(0, dtype=torch.int32)
    q = rope.qnorm_rope_kv_insert(torch.zeros(0, 8, 512, dtype=torch.bfloat16),
                                  torch.zeros(0, 512, dtype=torch.bfloat16), e64, swa, e64, cs,
                                  1e-6, out_q=torch.empty(0, 8, 512, dtype=torch.bfloat16))
    assert q.shape == (0, 8, 512)
    iq = indexer_ops.indexer_q_rope_quant(torch.zeros(0, 64, 128, dtype=torch.bfloat16), e64,
                                          cs, torch.zeros(0, 64), softmax_scale=0.1,
                                          head_scale=0.1, dtype=dtype)
    assert iq.q.shape[0] == 0 and iq.weights.shape == (0, 64)
    comp_ops.save_partial_states(torch.zeros(0, 256), torch.zeros(0, 256), torch.zeros(4, 256),
                                 e64, ist, e64)
    comp_ops.compress_norm_rope_store_indexer(ist, torch.zeros(0, 8, dtype=torch.int64), e64,
                                              e64, torch.ones(128), 1e-6, cs,
                                              ind.view(2, -1), 64, 4, indexer_kv_dtype=dtype)
    comp_ops.compress_norm_rope_store_main(mst, torch.zeros(0, 8, dtype=torch.int64), e64, e64,
                                           torch.ones(512), 1e-6, cs,
                                           fp8_ds_mla.cache_layout(comp).blocks_2d(comp), 64, 4)
    local = torch.empty(0, TOPK, dtype=torch.int32)
    glob = torch.empty(0, TOPK, dtype=torch.int32)
    lens = torch.empty(0, dtype=torch.int32)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    eager.select_topk_c4(
        positions=e64, token_to_req=e64, compressed_block_table=bt, entries_per_block=64,
        index_topk=TOPK, out_local=local, out_global=glob, out_lens=lens,
        arange=torch.arange(TOPK, dtype=torch.int32), minus_one=torch.tensor(-1, dtype=torch.int32),
        index_q=iq.q, index_q_scale=iq.q_scale, index_weights=iq.weights, indexer_k_cache=ind,
        indexer_block_table=bt, indexer_kv_dtype=dtype, max_compressed=0)
    win = torch.empty(0, 128, dtype=torch.int32)
    slots.window_slots(win, lens, positions=e64, token_to_req=e64, block_table=bt,
                       block_size=64, arange=torch.arange(128, dtype=torch.int32))
    slots.all_visible_compressed_slots(win, lens, positions=e64, token_to_req=e64,
                                       block_table=bt, block_size=2, compress_ratio=128,
                                       arange=torch.arange(128, dtype=torch.int32))
    out = torch.empty(0, 8, 512, dtype=torch.bfloat16)
    _attend(q, swa, win, lens, torch.zeros(8), 0.04, out, comp, glob, lens)
    o, lse = ops.sparse_mla_decode(torch.zeros(0, 1, 8, 512, dtype=torch.bfloat16), swa,
                                   torch.zeros(0, 1, 128, dtype=torch.int32), e32, None, 0.04)
    assert o.shape == (0, 1, 8, 512) and lse.shape == (0, 8, 1)
    o, ml, lse = ops.sparse_mla_prefill(torch.zeros(0, 8, 512, dtype=torch.bfloat16),
                                        torch.zeros(3, 1, 512, dtype=torch.bfloat16),
                                        torch.zeros(0, 1, 64, dtype=torch.int32), 0.04)
    assert o.shape == (0, 8, 512) and ml.shape == (0, 8)
    fp8_ds_mla.quantize_and_insert(torch.zeros(0, 512, dtype=torch.bfloat16), swa, e64)
    ic.quantize_and_insert(torch.zeros(0, 128), ind, e64, dtype)
    assert ic.dequantize_and_gather(ind, e64, dtype).shape == (0, 128)
    after = [_storage(x) for x in caches]
    for b, a in zip(before, after):
        assert torch.equal(b, a), "an empty batch wrote cache bytes"


@pytest.mark.parametrize("dtype", DTYPES)
def test_dummy_run_padded_tokens_write_nothing(dtype):
    """vLLM's dummy / capture batch: padded tokens at position 0 with slot_mapping -1
    (PAD_SLOT_ID) and all-zero block tables. The cache writers skip them (no byte
    changes), and the step raises nothing."""
    gen = torch.Generator().manual_seed(4)
    t = 8
    cs = _cos_sin()
    caches = _poisoned_caches(dtype)
    swa, comp, ind, ist, mst = caches
    before = [_storage(x) for x in caches]
    # position 0 as in vLLM's dummy batch, and window ends (3, 7, ...) that would emit a
    # compressed entry if their slot were not -1
    pos = torch.tensor([0, 3, 0, 7, 0, 11, 0, 15], dtype=torch.int64)
    pad = torch.full((t,), -1, dtype=torch.int64)
    q = rope.qnorm_rope_kv_insert(torch.randn(t, 8, 512, generator=gen).to(torch.bfloat16),
                                  torch.randn(t, 512, generator=gen).to(torch.bfloat16), pos,
                                  swa, pad, cs, 1e-6,
                                  out_q=torch.empty(t, 8, 512, dtype=torch.bfloat16))
    assert torch.isfinite(q.float()).all()
    comp_ops.save_partial_states(torch.randn(t, 256, generator=gen),
                                 torch.randn(t, 256, generator=gen), torch.zeros(4, 256), pos,
                                 ist, pad)
    gather = torch.full((t, 8), -1, dtype=torch.int64)
    gather[:, -1] = 0
    comp_ops.compress_norm_rope_store_indexer(ist, gather, pos, pad, torch.ones(128), 1e-6, cs,
                                              ind.view(2, -1), 64, 4, indexer_kv_dtype=dtype)
    comp_ops.compress_norm_rope_store_main(mst, gather, pos, pad, torch.ones(512), 1e-6, cs,
                                           fp8_ds_mla.cache_layout(comp).blocks_2d(comp), 64, 4)
    after = [_storage(x) for x in caches]
    for name, b, a in zip(("swa", "comp", "ind", "ind_state", "main_state"), before, after):
        assert torch.equal(b, a), f"a padded token (slot -1) wrote {name} bytes"


# ---- no out-of-range read: poison beyond the valid region --------------------------------
def test_entries_past_lengths_are_never_read():
    """Decode and prefill rows whose index lists continue past their lengths into
    NaN-poisoned slots: the result is bitwise the one with those entries set to -1, and
    finite (FlashMLA semantics: only the first topk_length entries are read)."""
    gen = torch.Generator().manual_seed(5)
    h, t, nb, bs = 8, 6, 8, 64
    good = nb // 2 * bs  # slots [0, good) hold data, [good, nb*bs) are poison
    swa = fp8_ds_mla.allocate_cache(nb, bs, fill=POISON)
    comp = fp8_ds_mla.allocate_cache(nb, bs, fill=POISON)
    for c in (swa, comp):
        fp8_ds_mla.quantize_and_insert(torch.randn(good, 512, generator=gen).to(torch.bfloat16),
                                       c, torch.arange(good))
    q = torch.randn(t, 1, h, 512, generator=gen).to(torch.bfloat16)
    sink = torch.randn(h, generator=gen)
    wl = torch.randint(1, 129, (t,), generator=gen, dtype=torch.int32)
    cl = torch.randint(0, 257, (t,), generator=gen, dtype=torch.int32)
    wi = torch.randint(0, good, (t, 1, 128), generator=gen, dtype=torch.int32)
    ci = torch.randint(0, good, (t, 1, 256), generator=gen, dtype=torch.int32)
    wpast = torch.arange(128) >= wl[:, None]
    cpast = torch.arange(256) >= cl[:, None]
    wi_p = torch.where(wpast[:, None], torch.randint(good, nb * bs, wi.shape, generator=gen,
                                                     dtype=torch.int32), wi)
    ci_p = torch.where(cpast[:, None], torch.randint(good, nb * bs, ci.shape, generator=gen,
                                                     dtype=torch.int32), ci)
    wi_m = wi.masked_fill(wpast[:, None], -1)
    ci_m = ci.masked_fill(cpast[:, None], -1)
    ref, rl = ops.sparse_mla_decode(q, swa, wi_m, None, sink, 0.04, comp, ci_m, None)
    got, gl = ops.sparse_mla_decode(q, swa, wi_p, wl, sink, 0.04, comp, ci_p, cl)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(_bits(got), _bits(ref)) and torch.equal(_bits(gl), _bits(rl))
    kv = torch.randn(300, 1, 512, generator=gen).to(torch.bfloat16)
    kv[200:] = math.nan
    pidx = torch.randint(0, 200, (t, 1, 96), generator=gen, dtype=torch.int32)
    tl = torch.randint(0, 97, (t,), generator=gen, dtype=torch.int32)
    past = torch.arange(96) >= tl[:, None]
    p_poison = torch.where(past[:, None], torch.randint(200, 300, pidx.shape, generator=gen,
                                                        dtype=torch.int32), pidx)
    ro = ops.sparse_mla_prefill(q[:, 0], kv, pidx.masked_fill(past[:, None], -1), 0.04, sink)
    go = ops.sparse_mla_prefill(q[:, 0], kv, p_poison, 0.04, sink, tl)
    for a, b in zip(ro, go):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.isfinite(go[0].float()).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_logits_ignore_poison_past_length(dtype):
    """Entries j >= seq_len of a row live in poisoned pages (the rest of its last block,
    and block-table columns past its length pointing at poisoned blocks): logits[:n]
    are those of a clean cache, logits[n:] are -inf, nothing is NaN."""
    gen = torch.Generator().manual_seed(6)
    bs, t = 64, 4
    lens = torch.tensor([1, 63, 64, 200], dtype=torch.int32)
    nb = 1 + 4 * t + 4
    poisoned = _indexer_cache(dtype, nb)
    clean = torch.zeros_like(poisoned)
    bt = torch.full((t, 6), -1, dtype=torch.int32)
    for i in range(t):
        blocks = torch.arange(1 + 4 * i, 1 + 4 * i + 4, dtype=torch.int32)
        bt[i, :4] = blocks
        bt[i, 4:] = nb - 1  # past the length: a poisoned block
        n = int(lens[i])
        j = torch.arange(n)
        sl = blocks[j // bs].long() * bs + j % bs
        k = torch.randn(n, 128, generator=gen).to(torch.bfloat16)
        ic.quantize_and_insert(k, poisoned, sl, dtype)
        ic.quantize_and_insert(k, clean, sl, dtype)
    iq = _iq(dtype, t, gen)
    args = (iq.q, iq.q_scale, iq.weights)
    got = indexer_ops.indexer_logits(*args, poisoned, lens, bt, dtype=dtype, max_seq_len=384)
    ref = indexer_ops.indexer_logits(*args, clean, lens, bt, dtype=dtype, max_seq_len=384)
    assert not torch.isnan(got).any()
    for i in range(t):
        n = int(lens[i])
        assert torch.equal(_bits(got[i, :n]), _bits(ref[i, :n]))
        assert bool((got[i, n:] == -math.inf).all())


# ==========================================================================================
# 2. Metadata and top-k prepared for a short context, then a long one, in the same buffers.
#    vllm-project/vllm#52492: a short-context shortcut captured into a graph replayed for a
#    long cached prefix and selected candidates 0..511 instead of ranking them.
# ==========================================================================================
def _topk_case(dtype: str, positions: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    nb, bs = 48, 64
    ind = _indexer_cache(dtype, nb)
    ic.quantize_and_insert(torch.randn((nb - 1) * bs, 128, generator=gen).to(torch.bfloat16),
                           ind, torch.arange(bs, nb * bs), dtype)
    bt = torch.stack([torch.randperm(nb - 1, generator=gen)[:12] + 1 for _ in range(2)]).int()
    pos = torch.tensor(positions, dtype=torch.int64)
    t2r = torch.tensor([i % 2 for i in range(len(positions))])
    iq = _iq(dtype, len(positions), gen, pos)
    return ind, bt, pos, t2r, iq


def _select(dtype, case, local, glob, lens, *, scored: bool):
    ind, bt, pos, t2r, iq = case
    widest = int(torch.div(pos + 1, 4, rounding_mode="floor").max())
    eager.select_topk_c4(
        positions=pos, token_to_req=t2r, compressed_block_table=bt, entries_per_block=64,
        index_topk=TOPK, out_local=local, out_global=glob, out_lens=lens,
        arange=torch.arange(TOPK, dtype=torch.int32), minus_one=torch.tensor(-1, dtype=torch.int32),
        index_q=iq.q if scored else None, index_q_scale=iq.q_scale if scored else None,
        index_weights=iq.weights if scored else None, indexer_k_cache=ind,
        indexer_block_table=bt, indexer_kv_dtype=dtype, max_compressed=widest)


def _fresh(dtype, case, scored):
    t = case[2].numel()
    bufs = (torch.full((t, TOPK), INT32_MIN, dtype=torch.int32),
            torch.full((t, TOPK), INT32_MIN, dtype=torch.int32),
            torch.full((t,), INT32_MIN, dtype=torch.int32))
    _select(dtype, case, *bufs, scored=scored)
    return bufs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug-poison"])
def test_topk_short_then_long_in_the_same_lease(dtype, debug):
    """The layer's order on one workspace ``topk`` slot: a short-context step (every row
    sees <= 512 entries: the short-context rule) then a long one (indexer scoring), then
    short again. Each equals a fresh computation in fresh buffers; replaying the short
    rule on the long step (the #52492 failure) is detectably different."""
    # Every view of the topk family (local too): WIDE_PLAN, an explicit plan.
    cfg = build_workspace_config(Dims(num_local_heads=8, padded_q_heads=8, index_topk=TOPK),
                                 max_num_batched_tokens=16, indexer_kv_dtype=dtype,
                                 plan=WIDE_PLAN, compress_ratios=(4,))
    mgr = WorkspaceManager(cfg, [("layers.0", 4)], policy="shared", debug=debug)
    mgr.reserve()
    short = _topk_case(dtype, [100, 2000, 7, 1500, 300, 2046], 7)
    long_ = _topk_case(dtype, [2100, 2900, 2051, 2500, 2060, 2300, 2800, 2052], 8)
    for case in (short, long_, short):
        t = case[2].numel()
        scored = int(torch.div(case[2] + 1, 4, rounding_mode="floor").max()) > TOPK
        with eager.Region(mgr, "layers.0", t) as region:
            lease = region.lease("topk")
            _select(dtype, case, lease["local"], lease["global"], lease["lens"], scored=scored)
            ref = _fresh(dtype, case, scored)
            for name, want in zip(("local", "global", "lens"), ref):
                assert torch.equal(lease[name], want), f"{name} differs from a fresh run"
        if scored:
            shortcut = _fresh(dtype, case, scored=False)
            assert not torch.equal(shortcut[0], ref[0]), "the shortcut must not pass for scoring"
            assert int(ref[2].min()) == TOPK


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_logits_and_topk_persistent_out_short_then_long(dtype):
    """indexer_logits / indexer_topk into persistent ``out`` buffers (max width, max
    tokens): a short call, a long call, a short call; every result equals fresh buffers."""
    calls = [_topk_case(dtype, [100, 700, 40], 9),
             _topk_case(dtype, [2400, 2900, 2100, 2800, 2052], 10),
             _topk_case(dtype, [60, 1000], 11)]
    logits_buf = torch.full((8, 1024), math.nan)
    topk_buf = torch.full((8, TOPK), INT32_MIN, dtype=torch.int32)
    for ind, bt, pos, t2r, iq in calls:
        t = pos.numel()
        vis = torch.div(pos + 1, 4, rounding_mode="floor")
        width = int(vis.max())
        args = (iq.q, iq.q_scale, iq.weights, ind, vis, bt)
        kw = dict(dtype=dtype, token_to_req=t2r, max_seq_len=width)
        got = indexer_ops.indexer_logits(*args, **kw, out=logits_buf[:t])
        ref = indexer_ops.indexer_logits(*args, **kw)
        assert torch.equal(_bits(got), _bits(ref))
        tk = indexer_ops.indexer_topk(got, None, TOPK, seq_lens=vis, out=topk_buf[:t])
        assert torch.equal(tk, indexer_ops.indexer_topk(ref, None, TOPK, seq_lens=vis))


def test_slot_metadata_short_then_long_in_persistent_buffers():
    """The builders' persistent buffers: window slots and the C128 adaptive-width slots
    (``c128_indices_buffer[:T, :width]``) for a short step then a long one then a short
    one, and vLLM's C128A top-k metadata port: each equals a fresh computation."""
    gen = torch.Generator().manual_seed(12)
    mnbt, max_w = 16, 512
    win_buf = torch.full((mnbt, 128), INT32_MIN, dtype=torch.int32)
    win_len = torch.full((mnbt,), INT32_MIN, dtype=torch.int32)
    c128_buf = torch.full((mnbt, max_w), INT32_MIN, dtype=torch.int32)
    c128_len = torch.full((mnbt,), INT32_MIN, dtype=torch.int32)
    dec_buf = torch.full((mnbt, max_w), INT32_MIN, dtype=torch.int32)
    dec_len = torch.full((mnbt,), INT32_MIN, dtype=torch.int32)
    pre_buf = torch.full((mnbt, max_w), INT32_MIN, dtype=torch.int32)
    swa_bt = torch.randperm(2000, generator=gen).view(2, 1000).int()
    c_bt = torch.randperm(600, generator=gen)[:512].view(2, 256).int()
    ar128 = torch.arange(128, dtype=torch.int32)
    ar_w = torch.arange(max_w, dtype=torch.int32)
    for positions in ([5, 130, 2000], [12000, 40000, 3, 52000, 60000, 9000], [7, 300]):
        pos = torch.tensor(positions, dtype=torch.int64)
        t = pos.numel()
        t2r = torch.arange(t) % 2
        width = min(-(-max(int(pos.max() + 1) // 128, 1) // 128) * 128, max_w)

        def both(fn, *bufs, fresh_shape):
            fn(*bufs)
            fresh = [torch.full(s, INT32_MIN, dtype=torch.int32) for s in fresh_shape]
            fn(*fresh)
            for b, f in zip(bufs, fresh):
                assert torch.equal(b, f)

        both(lambda i, n, pos=pos, t2r=t2r: slots.window_slots(
            i, n, positions=pos, token_to_req=t2r, block_table=swa_bt, block_size=64,
            arange=ar128),
            win_buf[:t], win_len[:t], fresh_shape=[(t, 128), (t,)])
        both(lambda i, n, pos=pos, t2r=t2r, width=width: slots.all_visible_compressed_slots(
            i, n, positions=pos, token_to_req=t2r, block_table=c_bt, block_size=2,
            compress_ratio=128, arange=ar_w[:width]),
            c128_buf[:t, :width], c128_len[:t], fresh_shape=[(t, width), (t,)])
        n_dec = t // 2
        sm = torch.arange(t, dtype=torch.int64)
        both(lambda g, n, p, pos=pos, w=width, nd=n_dec, t2r=t2r, sm=sm:
             md_ops.build_c128a_topk_metadata(g, n, p, pos, 128, w, nd, t2r.int(), c_bt, 2, sm),
             dec_buf[:n_dec, :width], dec_len[:n_dec], pre_buf[: t - n_dec, :width],
             fresh_shape=[(n_dec, width), (n_dec,), (t - n_dec, width)])


# ==========================================================================================
# 3. The indexer cache's block-planar layout (per block: the values of all its entries,
#    then all the scales), written by one path and read by every other. Forks that read it
#    interleaved (entry o at o * entry_bytes) got silently wrong top-k or NaN.
# ==========================================================================================
def _planar_decode(cache: torch.Tensor, slot_ids: torch.Tensor, dtype: str):
    """Test-local reader of the documented layout, from the raw storage bytes."""
    nb, bs, eb = cache.shape
    vb, sb = ic.value_bytes(dtype), ic.scale_bytes(dtype)
    raw = _storage(cache)
    stride0 = cache.stride(0)
    vals, scs = [], []
    for s in slot_ids.tolist():
        base = cache.storage_offset() + (s // bs) * stride0
        o = s % bs
        vals.append(raw[base + vb * o : base + vb * (o + 1)])
        scs.append(raw[base + vb * bs + sb * o : base + vb * bs + sb * (o + 1)])
    return torch.stack(vals), torch.stack(scs)


def _interleaved_decode(cache: torch.Tensor, slot_ids: torch.Tensor, dtype: str):
    """The forks' wrong reading: entry o as eb contiguous bytes at o * eb."""
    nb, bs, eb = cache.shape
    vb = ic.value_bytes(dtype)
    raw = _storage(cache)
    rows = []
    for s in slot_ids.tolist():
        base = cache.storage_offset() + (s // bs) * cache.stride(0) + (s % bs) * eb
        rows.append(raw[base : base + eb])
    rows = torch.stack(rows)
    return rows[:, :vb].contiguous(), rows[:, vb:].contiguous()


def _writers(dtype: str, keys: torch.Tensor, slot_ids: torch.Tensor, nb: int, bs: int):
    """The same entries through every writer the plugin has; returns {name: cache}."""
    out = {}
    c = _indexer_cache(dtype, nb, bs)
    ic.quantize_and_insert(keys, c, slot_ids, dtype)
    out["formats.indexer_cache.quantize_and_insert"] = c
    # 3-D view over a padded block stride (vLLM pools pages across groups).
    eb = ic.entry_bytes(dtype)
    backing = torch.full((nb, bs * eb + 96), POISON, dtype=torch.uint8)
    padded = backing[:, : bs * eb].view(nb, bs, eb)
    ic.quantize_and_insert(keys, padded, slot_ids, dtype)
    out["quantize_and_insert (padded block stride)"] = padded
    return out


def _compressor_entries(dtype: str, n_tokens: int, seed: int):
    """A compressor store of ``n_tokens`` consecutive positions (every 4th emits) and the
    bf16 entries it quantized (ops.compressor.compress_norm_rope on the same state)."""
    gen = torch.Generator().manual_seed(seed)
    cs = _cos_sin()
    state, pos, gather, rms, kv_slots = indexer_store_case(n_tokens, gen,
                                                           comp_ops.save_partial_states)
    values, emit = comp_ops.compress_norm_rope(state, gather, pos, rms, 1e-6, cs, 4, 128)
    return state, gather, pos, kv_slots, rms, cs, values[emit].to(torch.bfloat16), emit


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_cache_writers_are_block_planar(dtype):
    """Every writer puts entry o of a block at values[vb * o] and scales[vb * B + 4 * o]
    (checked against a test-local byte reader) and touches no other byte."""
    gen = torch.Generator().manual_seed(13)
    nb, bs, n = 5, 64, 150
    keys = torch.randn(n, 128, generator=gen).to(torch.bfloat16)
    keys[3] = 0.0
    slot_ids = torch.randperm(nb * bs, generator=gen)[:n]
    want_v, want_s = ic.quantize_rows(keys, dtype)
    for name, cache in _writers(dtype, keys, slot_ids, nb, bs).items():
        v, s = _planar_decode(cache, slot_ids, dtype)
        assert torch.equal(v, want_v), f"{name}: value bytes misplaced"
        assert torch.equal(s, want_s), f"{name}: scale bytes misplaced"
        untouched = torch.full_like(_storage(cache), POISON)
        assert int((_storage(cache) != untouched).sum()) <= n * ic.entry_bytes(dtype)
    # The compressor's store (the serving writer) == quantize_and_insert of its entries.
    state, gather, pos, kv_slots, rms, cs, entries, emit = _compressor_entries(dtype, 64, 14)
    via_store = _indexer_cache(dtype, 3)
    comp_ops.compress_norm_rope_store_indexer(state, gather, pos, kv_slots, rms, 1e-6, cs,
                                              via_store.view(3, -1), 64, 4,
                                              indexer_kv_dtype=dtype)
    direct = _indexer_cache(dtype, 3)
    ic.quantize_and_insert(entries, direct, kv_slots[emit], dtype)
    assert torch.equal(_storage(via_store), _storage(direct))
    if dtype == "fp8":  # the plugin's fallback of vLLM's C++ indexer store
        fb = _indexer_cache(dtype, 3)
        cpu_ops.compress_norm_rope_store_indexer_cpu(state, gather, pos, kv_slots, rms, 1e-6,
                                                     cs, fb.view(3, -1), 64, 4)
        assert torch.equal(_storage(fb), _storage(direct))


def _logits_oracle(q_f32: torch.Tensor, weights: torch.Tensor, k_f32: torch.Tensor):
    """float64 ``sum_h w[h] relu(q[h] . k[j])`` for one token: [n]."""
    s = (q_f32.double() @ k_f32.double().t()).clamp_min(0)
    return (weights.double()[:, None] * s).sum(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_cache_every_reader_reads_every_writer(dtype):
    """Entries written by every writer, read back by every reader: the dequantizing
    gather, block views + raw gather, the indexer logits (torch op, and for FP8 the
    plugin's fallback of vLLM's fp8_paged_mqa_logits_cpu on the 2-D page view), each
    equal to the exact dequantized keys / their float64 logits."""
    gen = torch.Generator().manual_seed(15)
    nb, bs, n = 6, 64, 200
    keys = torch.randn(n, 128, generator=gen).to(torch.bfloat16)
    # One request whose entries j = 0..n-1 live at block_table[j // bs] * bs + j % bs.
    bt = torch.tensor([[4, 1, 5, 2]], dtype=torch.int32)
    j = torch.arange(n)
    slot_ids = bt[0, j // bs].long() * bs + j % bs
    qv, qs = ic.quantize_rows(keys, dtype)
    exact = ic.dequantize_raw(qv, qs, dtype)
    iq = _iq(dtype, 1, gen, torch.tensor([4 * n + 10]))
    qf = iq.q.float() if dtype == "fp8" else indexer_ops._dequant_q(iq.q, iq.q_scale, dtype)
    want_logits = _logits_oracle(qf[0], iq.weights[0], exact)
    lens = torch.tensor([n], dtype=torch.int32)
    for name, cache in _writers(dtype, keys, slot_ids, nb, bs).items():
        got = ic.dequantize_and_gather(cache, slot_ids, dtype)
        assert torch.equal(got, exact), f"{name} -> dequantize_and_gather"
        v, s = ic.block_views(cache, dtype)
        rv, rs = ic.gather_raw(v, s, slot_ids // bs, slot_ids % bs)
        assert torch.equal(ic.dequantize_raw(rv, rs, dtype), exact), f"{name} -> block_views"
        lg = indexer_ops.indexer_logits(iq.q, iq.q_scale, iq.weights, cache, lens, bt,
                                        dtype=dtype, max_seq_len=n)[0]
        torch.testing.assert_close(lg.double(), want_logits, rtol=1e-5, atol=1e-5,
                                   msg=f"{name} -> indexer_logits")
        if dtype == "fp8" and cache.is_contiguous():
            fb = cpu_ops.fp8_paged_mqa_logits_cpu(iq.q, cache.view(nb, -1), iq.weights, lens,
                                                  bt, bs, n)[0]
            assert torch.equal(_bits(fb), _bits(lg)), f"{name} -> fp8_paged_mqa_logits_cpu"


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_reading_is_detected(dtype):
    """Negative control: reading the cache interleaved (entry o at o * entry_bytes, the
    forks' bug) gives different bytes and dequantized keys (NaN or wrong), and a cache
    *written* interleaved gives the plugin's readers wrong keys: a round trip test fails."""
    gen = torch.Generator().manual_seed(16)
    nb, bs, n = 3, 64, 128
    keys = torch.randn(n, 128, generator=gen).to(torch.bfloat16)
    slot_ids = torch.arange(n)
    cache = _indexer_cache(dtype, nb, bs)
    ic.quantize_and_insert(keys, cache, slot_ids, dtype)
    want_v, want_s = ic.quantize_rows(keys, dtype)
    iv, is_ = _interleaved_decode(cache, slot_ids, dtype)
    wrong = ic.dequantize_raw(iv, is_, dtype)
    exact = ic.dequantize_raw(want_v, want_s, dtype)
    assert not torch.equal(iv, want_v) or not torch.equal(is_, want_s)
    assert torch.isnan(wrong).any() or not torch.equal(wrong, exact)
    # A cache written interleaved, read by the plugin: mismatch.
    inter = _indexer_cache(dtype, nb, bs)
    flat = inter.view(nb, -1)
    eb, vb = ic.entry_bytes(dtype), ic.value_bytes(dtype)
    for i, s in enumerate(slot_ids.tolist()):
        off = (s % bs) * eb
        flat[s // bs, off : off + vb] = want_v[i]
        flat[s // bs, off + vb : off + eb] = want_s[i]
    read = ic.dequantize_and_gather(inter, slot_ids, dtype)
    assert not torch.equal(read, exact)


# ==========================================================================================
# 4. The SWA cache is 584 B per entry in every KV group. vllm-project/vllm#47716: the
#    runner reshaped the DeepSeek-V4 SWA cache with the semantic 512-byte head size
#    ([num_blocks, 64, 1, 512]) and FlashMLA rejected it. (vLLM's own KV-cache specs are
#    checked in tests/vllm/test_batch_invariance_kernels.py; backend.py imports vLLM.)
# ==========================================================================================
@pytest.mark.parametrize("group,entries", [("swa", 64), ("c4", 256 // 4), ("c128", 256 // 128)])
def test_584_bytes_per_entry_in_every_group(group, entries):
    """Every fp8_ds_mla group (SWA: 64 tokens per block; C4: 64 entries; C128: 2) is a
    page of entries x 584 B padded to 576 B; the plugin's readers and writers address it
    through vLLM's 2-D page view, and a 512 B per token shape is refused by name."""
    assert fp8_ds_mla.BYTES_PER_TOKEN == 584 == 448 + 2 * 64 + 8
    page = fp8_ds_mla.padded_block_stride(entries)
    assert page % 576 == 0 and page >= 584 * entries and page - 584 * entries < 576
    gen = torch.Generator().manual_seed(17)
    nb = 3
    raw = torch.full((nb, page), POISON, dtype=torch.uint8)  # vLLM's [num_blocks, page] view
    view = eager.block_view(raw, entries)
    assert view.shape == (nb, entries, 584) and view.stride(0) == page
    kv = torch.randn(nb * entries, 512, generator=gen).to(torch.bfloat16)
    fp8_ds_mla.quantize_and_insert(kv, view, torch.arange(nb * entries))
    back = fp8_ds_mla.dequantize_and_gather(view, torch.arange(nb * entries))
    nope, scale, rope_ = fp8_ds_mla.quantize(kv)
    assert torch.equal(back, fp8_ds_mla.dequantize(nope, scale, rope_))
    assert bool((raw[:, 584 * entries :] == POISON).all()), "block padding was written"
    wrong = torch.zeros(nb, entries, 1, 512, dtype=torch.uint8)
    with pytest.raises(ValueError, match="584"):
        fp8_ds_mla.cache_layout(wrong)
    with pytest.raises(ValueError, match="584"):
        ops.sparse_mla_decode(torch.zeros(1, 1, 8, 512, dtype=torch.bfloat16), wrong,
                              torch.zeros(1, 1, 4, dtype=torch.int32), None, None, 0.04)


# ==========================================================================================
# 5. Reservation sized from the scheduler's worst case, and a request beyond it. The
#    vllm-project/vllm#41700-style lock asserts ("workspace is locked but allocation ...
#    requires more") gave no hint of what to change; no growth after warm-up.
# ==========================================================================================
def _tiny_manager(mnbt: int, dtype: str, policy: str = "shared", debug: bool = False):
    hf = json.loads(TINY_CONFIG.read_text())
    # The tiny model's dims (padded heads = the local heads, as vLLM's CPU layer);
    # every family of every layer kind, the q family as the attention output
    # (WIDE_PLAN, an explicit plan: C4 layers lease compressor scratch too).
    dims, ratios = dims_from_hf_config(hf, tp_size=1, padded_heads=8)
    cfg = build_workspace_config(dims, max_num_batched_tokens=mnbt, indexer_kv_dtype=dtype,
                                 plan=WIDE_PLAN, compress_ratios=ratios)
    layers = [(f"model.layers.{i}.self_attn", r) for i, r in enumerate(cfg.layer_kinds)]
    mgr = WorkspaceManager(cfg, layers, policy=policy, debug=debug)
    mgr.reserve()
    return mgr


@pytest.mark.parametrize("dtype", DTYPES)
def test_lease_beyond_reservation_names_family_layer_and_setting(dtype):
    """Every family of every layer of the tiny model leases max_num_batched_tokens
    tokens; one more raises WorkspaceCapacityError naming the family, the layer and the
    setting to raise (vLLM's --max-num-batched-tokens), without taking the slot."""
    mnbt = 48
    mgr = _tiny_manager(mnbt, dtype)
    for layer, ratio in mgr.layers.items():
        for fam in mgr.config.layer_families(ratio):
            mgr.lease(layer, fam, mnbt).release()
            with pytest.raises(WorkspaceCapacityError) as ei:
                mgr.lease(layer, fam, mnbt + 1)
            msg = str(ei.value)
            assert repr(fam) in msg and repr(layer) in msg, msg
            assert "max_num_batched_tokens" in msg and "--max-num-batched-tokens" in msg, msg
            assert f"requested {mnbt + 1} tokens" in msg and f"reserved {mnbt} tokens" in msg
            assert isinstance(ei.value, ValueError)
            mgr.lease(layer, fam, 1).release()  # the failed lease held nothing
    assert mgr.stats()["leased_bytes_now"] == 0


@pytest.mark.parametrize("policy", ["shared", "private"])
def test_no_growth_after_warmup(policy):
    """After a warm-up step, steps of any size <= max_num_batched_tokens (all families,
    every layer, through eager.Region) allocate nothing: no tensor allocation in the step,
    the same reserved bytes and storage, the same view addresses per (layer, family, T)."""
    mnbt = 32
    mgr = _tiny_manager(mnbt, "mxfp4", policy)
    storage_ptr = mgr.storage.data_ptr()
    reserved = mgr.stats()["reserved_bytes_total"]
    sizes = [1, 7, mnbt, 0, 19, 1, mnbt]

    def one_step(t: int) -> tuple[dict, int]:
        ptrs = {}
        with count_allocations() as c:
            for layer, ratio in mgr.layers.items():
                with eager.Region(mgr, layer, t) as region:
                    for fam in mgr.config.layer_families(ratio):
                        lease = region.lease(fam)
                        for name, v in lease.views.items():
                            ptrs[(layer, fam, name)] = v.data_ptr()
        return ptrs, c.count

    first = {t: one_step(t)[0] for t in set(sizes)}  # warm-up: views built per T
    for t in sizes * 2:
        ptrs, allocations = one_step(t)
        s = mgr.stats()
        assert allocations == 0, s
        assert s["allocations_total"] == 0 and s["reserved_bytes_total"] == reserved
        assert s["leased_bytes_now"] == 0
        assert ptrs == first[t]
    assert mgr.storage.data_ptr() == storage_ptr


# ==========================================================================================
# 6. An exception inside one layer's eager step: every lease is released, the next step
#    leases again, and the caller sees the original error (not a later "still leased").
# ==========================================================================================
class IndexerBoom(RuntimeError):
    pass


@pytest.mark.parametrize("policy", ["shared", "private"])
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug-poison"])
def test_exception_in_eager_step_releases_every_lease(policy, debug):
    mgr = _tiny_manager(16, "fp8", policy, debug)
    layer, other = "model.layers.1.self_attn", "model.layers.3.self_attn"  # both C4
    with pytest.raises(IndexerBoom, match="indexer exploded"), \
            eager.Region(mgr, layer, 9) as region:
        region.lease("q")
        topk = region.lease("topk")
        topk["local"].fill_(3)
        assert set(region.held()) == {"q", "topk"}
        raise IndexerBoom("indexer exploded")
    assert region.held() == ()
    assert mgr.stats()["leased_bytes_now"] == 0
    if debug:  # the released region was poisoned for the next user
        assert bool((topk["local"] == INT32_MIN).all())
    # The next step of the same layer, and another layer sharing the slot, lease again.
    for name in (layer, other):
        with eager.Region(mgr, name, 16) as region:
            for fam in FAMILIES:
                region.lease(fam)
    assert mgr.stats()["leased_bytes_now"] == 0


def test_failing_release_does_not_leave_other_leases_held(monkeypatch):
    """If one release raises while the step unwinds, the others are still released and
    the first error is the one reported."""
    mgr = _tiny_manager(8, "fp8")
    layer = "model.layers.1.self_attn"
    real = mgr._release
    bad = []

    def failing(lease):
        real(lease)
        if lease in bad:
            raise WorkspaceLeaseError("simulated release failure")

    monkeypatch.setattr(mgr, "_release", failing)
    with pytest.raises(WorkspaceLeaseError, match="simulated"), \
            eager.Region(mgr, layer, 4) as region:
        for fam in ("q", "indexer_q", "topk"):
            region.lease(fam)
        bad.append(region._leases["indexer_q"])
    assert mgr.stats()["leased_bytes_now"] == 0
    with eager.Region(mgr, layer, 8) as region:
        for fam in ("q", "indexer_q", "topk"):
            region.lease(fam)
