# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Physical block ids past the int32 byte-offset boundary, for every cache format (torch only).

The field bug class (vllm-ascend#16870): a kernel computes ``block_id * block_bytes`` in int32,
so above block ``2**31 / block_bytes`` the offset wraps and writes, reads and the indexer's top-k
silently use another block. Here every plugin op that addresses a paged cache runs with block ids
whose byte offset is ``>= 2**31``: the ``fp8_ds_mla`` 584 B KV cache (SWA / C4 blocks of 64
tokens, C128 blocks of 2 entries, padded to a multiple of 576 B), the indexer K cache (FP8 132 B
and MXFP4 68 B entries, 64 per block) and the fp32 compressor state cache. Checked against
float64 oracles and byte decoders written here, in tests.support.high_block_ids (the far buffer
and the shared checks) and tests.support.oracle (no plugin code): writes land in the named
entries' bytes and nowhere else, reads, sparse MLA, indexer logits and top-k agree with the
oracle.

Memory: the caches are views of one ``2**31 + 8 MiB`` uint8 buffer from ``torch.empty``, which
the OS maps lazily, so only the few blocks a test poisons and writes become resident (a few
MiB); it is allocated once per module and freed after it. Bytes no entry owns are 0xFF (NaN in
e4m3, bf16 and fp32, the MXFP4 NaN scale), in the far blocks and in block 0, near which an
offset taken modulo ``2**31`` would land (an int32 one turns negative: torch raises, or a
negative block index silently picks a block from the end; both fail here).

vLLM's CPU op conventions (``torch.ops._C.*_cpu``) get the same checks through the
``check_*_op(s)`` helpers and ``check_compressor_far`` (tests.support.high_block_ids): here on
the plugin's torch fallbacks of those ops (what an AVX2 CPU runs), in
tests/vllm/test_high_block_ids_vllm.py on vLLM's C++ kernels. Slot ids (``block * block_size
+ offset``) past int32 are a separate, far higher limit: the plugin's int32 slot tables refuse
them (:func:`test_global_slot_ids_past_int32_are_refused`).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from tests.support import high_block_ids as hb
from tests.support.high_block_ids import (
    E2M1,
    E4M3,
    IND_BS,
    Far,
    Span,
    assert_untouched,
    check_compressor_far,
    check_logits_topk_ops,
    check_sparse_mla_op,
    check_swa_insert_op,
    check_topk_page_ids_wrap,
    check_topk_set,
    ind_cache,
    ind_decode_f64,
    ind_layout,
    logits_ref,
    mla_cache,
    mla_spans,
    named_indices,
)
from tests.support.oracle import (
    DECODE_LSE_TOL,
    DECODE_OUT_TOL,
    assert_flashmla_close,
    dequant_slots_f64,
    quantize_ref,
    read_token_bytes,
    round_to_e4m3,
    sparse_decode_ref,
)
from vllm_dsv4_backend import ops
from vllm_dsv4_backend.formats import fp8_ds_mla as F
from vllm_dsv4_backend.formats import indexer_cache as ic
from vllm_dsv4_backend.formats import mxfp4
from vllm_dsv4_backend.ops import compressor as comp_ops
from vllm_dsv4_backend.ops import indexer as ix
from vllm_dsv4_backend.ops import slots as slot_ops

# The shared fixtures (the far buffer, one intra-op thread), bound here so pytest finds them.
far = hb.far
one_thread = hb.one_thread


# --------------------------------------------------------------------------------------------
# fp8_ds_mla (584 B/token, block-split, padded block stride)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [64, 2], ids=["swa_c4_block64", "c128_block2"])
def test_fp8_ds_mla_insert_and_gather_far_blocks(far: Far, block_size: int,
                                                 slot_dtype: torch.dtype) -> None:
    """Rows inserted at far slots (mixed with a block-0 slot in one call) hold exactly the
    oracle quantizer's bytes, nothing else in the poisoned blocks changes, and the gather
    decodes them as the float64 byte decoder does."""
    cache, view2d, b0, _ = mla_cache(far, block_size, 2)
    g = torch.Generator().manual_seed(1)
    far_slots = torch.randperm(2 * block_size, generator=g)[: min(6, 2 * block_size)]
    slots = torch.cat([far_slots + b0 * block_size, torch.tensor([1])]).to(slot_dtype)
    kv = (torch.randn(len(slots), 512, generator=g) / 4).to(torch.bfloat16)
    F.quantize_and_insert(kv, cache, slots)

    nope, rope, scale, pad = read_token_bytes(cache, slots)
    want_nope, want_scale, want_rope = quantize_ref(kv)
    assert torch.equal(nope, want_nope)
    assert torch.equal(scale, want_scale)
    assert torch.equal(rope.view(torch.int16), want_rope.view(torch.int16))
    assert bool((pad == 0).all())
    assert_untouched(view2d, b0, mla_spans(block_size, slots.long()))

    # The gather, with -1 and the same far slots in another order.
    read = torch.cat([slots.flip(0), torch.tensor([-1], dtype=slot_dtype)])
    got = F.dequantize_and_gather(cache, read)
    assert torch.equal(got[:-1].double(), dequant_slots_f64(cache, read[:-1]))
    assert bool((got[-1] == 0).all())


@pytest.mark.parametrize("extra_block_size", [64, 2], ids=["c4", "c128"])
@pytest.mark.parametrize("shape", ["decode", "prefill_dedup"])
def test_sparse_mla_decode_far_blocks(far: Far, extra_block_size: int, shape: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Sparse MLA over a window cache and a compressed cache whose named slots sit past the
    boundary (plus block-0 slots) agrees with the float64 oracle, which decodes the same
    bytes by hand. ``prefill_dedup``: rows sharing their slots, through the deduplicated
    path (its threshold lowered so the oracle's float64 K stays small)."""
    tsm = ops.torch_sparse_mla
    taken: list[bool] = []
    dedup = tsm._decode_deduplicated
    monkeypatch.setattr(tsm, "_decode_deduplicated",
                        lambda *a, **k: taken.append(dedup(*a, **k)) or taken[-1])
    win, win2d, wb0, end = mla_cache(far, 64, 2)
    comp, comp2d, cb0, _ = mla_cache(far, extra_block_size, 2, after=end)
    g = torch.Generator().manual_seed(7 + extra_block_size)
    win_pool = torch.cat([torch.arange(wb0 * 64, (wb0 + 2) * 64), torch.tensor([3, 60])])
    comp_pool = torch.cat([torch.arange(cb0 * extra_block_size,
                                        (cb0 + 2) * extra_block_size), torch.tensor([1])])
    for cache, pool in ((win, win_pool), (comp, comp_pool)):
        kv = (torch.randn(len(pool), 512, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
        F.quantize_and_insert(kv, cache, pool)
    if shape == "decode":
        b, h, n1, n2 = 3, 64, 128, 128
    else:
        b, h, n1, n2 = 16, 8, 384, 128
        monkeypatch.setattr(tsm, "DEDUP_MIN_ENTRIES", b * (n1 + n2))
    lens = torch.randint(n1 // 2, n1 + 1, (b,), generator=g, dtype=torch.int32)
    idx = named_indices(g, b, n1, win_pool, lens)
    extra = named_indices(g, b, n2, comp_pool, None)
    q = torch.randn(b, 1, h, 512, generator=g).clamp(-1, 1).to(torch.bfloat16)
    sink = torch.randn(h, generator=g) + 4.0
    scale = 512**-0.5
    out, lse = ops.sparse_mla_decode(q, win, idx, lens, sink, scale, comp, extra, None)
    assert taken == ([] if shape == "decode" else [True])
    ref_out, ref_lse = sparse_decode_ref(q, [(win, idx, lens), (comp, extra, None)], sink, scale)
    assert_flashmla_close(out, ref_out, name="out", **DECODE_OUT_TOL)
    assert_flashmla_close(lse, ref_lse, name="lse", **DECODE_LSE_TOL)


# --------------------------------------------------------------------------------------------
# indexer K cache (FP8 132 B / MXFP4 68 B per entry, 64 entries per block)
# --------------------------------------------------------------------------------------------
def _ind_encode_ref(k: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle bytes of keys ``[N, 128]``: FP8 (e4m3 + fp32 power-of-two scale, amax floor
    1e-4) or MXFP4 (e2m1 pairs, even element in the low nibble, ue8m0 per 32)."""
    x = k.double()
    if dtype == "fp8":
        e = [math.ceil(math.log2(max(float(a), 1e-4) / 448.0)) for a in x.abs().amax(-1)]
        s = torch.pow(2.0, torch.tensor(e, dtype=torch.float64)).unsqueeze(-1)
        vals = round_to_e4m3((x / s).clamp(-448, 448))
        return vals, s.float().view(torch.uint8).view(-1, 4)
    blocks = x.view(-1, 4, 32)
    e = torch.tensor([[math.ceil(math.log2(max(float(a), 6 * 2.0**-126) / 6.0)) for a in r]
                      for r in blocks.abs().amax(-1)], dtype=torch.float64)
    y = (blocks / torch.pow(2.0, e).unsqueeze(-1)).abs().clamp(max=6.0)
    dist = (y.unsqueeze(-1) - E2M1).abs()
    # Nearest grid value, ties to the even code.
    key = dist * 4 + (torch.arange(8) % 2).double() * 1e-9
    code = key.argmin(-1) | (torch.signbit(blocks).long() << 3)
    code = code.view(-1, 64, 2)
    packed = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    return packed, (e + 127).to(torch.uint8).view(-1, 4)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_indexer_cache_insert_and_gather_far_blocks(far: Far, dtype: str,
                                                    slot_dtype: torch.dtype) -> None:
    """Keys inserted at far slots hold the oracle's bytes, nothing else changes, and the
    gather returns the float64 decode of those bytes."""
    cache, view2d, b0 = ind_cache(far, dtype, 2)
    g = torch.Generator().manual_seed(3)
    slots = torch.cat([torch.randperm(2 * IND_BS, generator=g)[:7] + b0 * IND_BS,
                       torch.tensor([5])]).to(slot_dtype)
    k = torch.randn(len(slots), 128, generator=g).to(torch.bfloat16)
    ic.quantize_and_insert(k, cache, slots, dtype)

    want_vals, want_scl = _ind_encode_ref(k, dtype)
    written: list[Span] = []
    for i, s in enumerate(slots.tolist()):
        b, vo, vb, so, sb = ind_layout(dtype, s)
        assert torch.equal(view2d[b, vo : vo + vb], want_vals[i]), f"values of slot {s}"
        assert torch.equal(view2d[b, so : so + sb], want_scl[i]), f"scale of slot {s}"
        written += [(b, vo, vo + vb), (b, so, so + sb)]
    assert_untouched(view2d, b0, written)

    read = torch.cat([slots.flip(0), torch.tensor([-1], dtype=slot_dtype)])
    got = ic.dequantize_and_gather(cache, read, dtype)
    assert torch.equal(got[:-1].double(), ind_decode_f64(view2d, dtype, read[:-1].tolist()))
    assert bool((got[-1] == 0).all())


@pytest.mark.parametrize("layout", ["one_request", "per_token"])
@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_indexer_logits_and_topk_far_pages(far: Far, dtype: str, layout: str) -> None:
    """Indexer logits over pages past the boundary (a block-0 page in between) match the
    float64 oracle; the causal top-k is the oracle's set; local -> global slots land in the
    far blocks. ``one_request``: every token reads one page row (the shared-row path);
    ``per_token``: two requests with their own rows."""
    cache, view2d, b0 = ind_cache(far, dtype, 3)
    g = torch.Generator().manual_seed(11)
    pages = torch.tensor([[b0 + 1, 0, b0 + 2, b0], [b0 + 2, b0, 0, b0 + 1]], dtype=torch.int32)
    t, h, topk = 6, 64, 48
    n_entries = pages.shape[1] * IND_BS
    # One key per (page, entry): the rows share the pages, in different orders.
    all_slots = (torch.tensor([b0, b0 + 1, b0 + 2, 0]).repeat_interleave(IND_BS) * IND_BS
                 + torch.arange(IND_BS).repeat(4))
    k = torch.randn(len(all_slots), 128, generator=g).to(torch.bfloat16)
    ic.quantize_and_insert(k, cache, all_slots, dtype)
    req = torch.zeros(t, dtype=torch.int64) if layout == "one_request" else torch.arange(t) % 2
    lens = torch.tensor([n_entries, 200, 131, 40, n_entries - 3, 97])

    qf = torch.randn(t, h, 128, generator=g)
    if dtype == "fp8":
        q, q_scale = qf.to(torch.float8_e4m3fn), None
        q64 = E4M3[q.view(torch.uint8).long()]
    else:
        q, q_scale = mxfp4.quantize(qf)
        nib = torch.stack([q.long() & 0xF, q.long() >> 4], -1).reshape(t, h, 128)
        q64 = (E2M1[nib & 7] * torch.where(nib >= 8, -1.0, 1.0).double()).view(t, h, 4, 32)
        q64 = (q64 * torch.pow(2.0, q_scale.double() - 127).unsqueeze(-1)).view(t, h, 128)
    w = torch.rand(t, h, generator=g)
    logits = ix.indexer_logits(q, q_scale, w, cache, lens, pages, dtype=dtype,
                               token_to_req=req, max_seq_len=n_entries)

    slots = (pages.long()[req].repeat_interleave(IND_BS, dim=1) * IND_BS
             + torch.arange(IND_BS).repeat(pages.shape[1]))  # [t, n_entries]
    uniq, inv = torch.unique(slots, return_inverse=True)
    keys = ind_decode_f64(view2d, dtype, uniq.tolist())[inv]  # [t, n_entries, 128]
    ref = logits_ref(q64, w, keys, lens)
    valid = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(logits), ~valid)
    scale = float(ref[valid].abs().max())
    torch.testing.assert_close(logits[valid].double(), ref[valid], rtol=1e-5, atol=1e-6 * scale)

    local = ix.indexer_topk(logits, None, topk, seq_lens=lens)
    for r in range(t):
        n = int(lens[r])
        band = 2 * (1e-5 * float(ref[r, :n].abs().max()) + 1e-6 * scale)
        check_topk_set(local[r], ref[r, :n], topk, band)

    glob, glens = ix.local_to_global(local, req, pages, IND_BS)
    want_glob = torch.where(local >= 0, slots.gather(1, local.long().clamp(min=0)),
                            torch.full_like(local, -1, dtype=torch.int64))
    assert torch.equal(glob.long(), want_glob)
    assert glens.tolist() == lens.clamp(max=topk).tolist()


# --------------------------------------------------------------------------------------------
# slot ids that int32 cannot hold
# --------------------------------------------------------------------------------------------
def test_global_slot_ids_past_int32_are_refused() -> None:
    """A block id whose global slot id (``block * block_size + offset``) is ``>= 2**31``
    cannot go into FlashMLA's int32 indices: both slot-table builders raise instead of
    wrapping it to another slot (the ids one below the limit still map)."""
    bs = 64
    top_block = (2**31 - 1) // bs  # its last slot is 2**31 - 1
    local = torch.tensor([[0, bs - 1, -1]])
    ok, _ = ix.local_to_global(local, torch.tensor([0]), torch.tensor([[top_block]]), bs)
    assert ok.tolist() == [[top_block * bs, top_block * bs + bs - 1, -1]]
    with pytest.raises(ValueError, match="int32"):
        ix.local_to_global(local, torch.tensor([0]), torch.tensor([[top_block + 1]]), bs)

    out_idx = torch.empty(1, 4, dtype=torch.int32)
    out_lens = torch.empty(1, dtype=torch.int32)
    args = dict(positions=torch.tensor([3]), token_to_req=torch.tensor([0]), block_size=bs,
                arange=torch.arange(4, dtype=torch.int32))
    slot_ops.window_slots(out_idx, out_lens, block_table=torch.tensor([[top_block]]), **args)
    assert out_idx.tolist() == [[top_block * bs + i for i in range(4)]]
    with pytest.raises(ValueError, match="int32"):
        slot_ops.window_slots(out_idx, out_lens, block_table=torch.tensor([[top_block + 1]]),
                              **args)


# --------------------------------------------------------------------------------------------
# compressor: fp32 state cache and the three quantized stores
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["main", "fp8", "mxfp4"])
@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_far_state_and_caches(far: Far, ratio: int, store: str) -> None:
    """The plugin's compressor ops on far state and cache blocks (:func:`check_compressor_far`)."""
    store_fn = (comp_ops.compress_norm_rope_store_main if store == "main" else
                functools.partial(comp_ops.compress_norm_rope_store_indexer,
                                  indexer_kv_dtype=store))
    check_compressor_far(far, ratio, store, comp_ops.save_partial_states, store_fn, 2.0**-10)


# --------------------------------------------------------------------------------------------
# vLLM's CPU op conventions (``torch.ops._C.*_cpu``): the plugin's fallbacks here, vLLM's
# C++ kernels in tests/vllm/test_high_block_ids_vllm.py, through the same checks
# --------------------------------------------------------------------------------------------
def fallback_ops() -> SimpleNamespace:
    """The plugin's torch fallbacks of vLLM's ops, called directly (what an AVX2 CPU runs
    under the ``torch.ops._C`` names; no vLLM needed)."""
    from vllm_dsv4_backend.vllm_compat import cpu_ops

    return SimpleNamespace(**{op.name: op.impl for op in cpu_ops.OPS})


def test_fallback_swa_insert_far_slots(far: Far) -> None:
    """The plugin's fallback of ``fused_qnorm_rope_kv_insert_cpu`` (:func:`check_swa_insert_op`)."""
    check_swa_insert_op(far, fallback_ops())


@pytest.mark.parametrize("extra_block_size", [64, 2], ids=["c4", "c128"])
def test_fallback_sparse_mla_far_slots(far: Far, extra_block_size: int) -> None:
    """The plugin's fallback of ``flash_mla_with_kvcache_cpu`` (:func:`check_sparse_mla_op`)."""
    check_sparse_mla_op(far, fallback_ops(), extra_block_size, DECODE_OUT_TOL)


def test_fallback_logits_and_topk_far_pages(far: Far) -> None:
    """The plugin's fallbacks of ``fp8_paged_mqa_logits_cpu`` and ``topk_transform_512_cpu``
    (:func:`check_logits_topk_ops`)."""
    check_logits_topk_ops(far, fallback_ops())


def test_fallback_topk_page_ids_wrap_past_int32() -> None:
    """The plugin's fallback of ``topk_transform_512_cpu`` keeps the C++ op's int32 page-id
    output, wrap included (:func:`check_topk_page_ids_wrap`); the served CPU layer never
    reads those ids (a scratch lease), and the plugin's own slot tables refuse such ids."""
    check_topk_page_ids_wrap(fallback_ops())
