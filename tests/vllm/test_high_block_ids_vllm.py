# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's C++ CPU DeepSeek-V4 ops with physical block ids past the int32 byte-offset boundary.

The cache-addressing ``torch.ops._C`` ops of vLLM 0.32's CPU build (the SWA writer
``fused_qnorm_rope_kv_insert_cpu``, sparse MLA ``flash_mla_with_kvcache_cpu`` through the
plugin's FlashMLA-interface adapter, ``save_partial_states_cpu``, the two compressor stores,
the indexer's ``fp8_paged_mqa_logits_cpu`` and ``topk_transform_512_cpu``) on the geometry of
tests/core/test_high_block_ids.py: cache views of one lazily mapped ``2**31 + 8 MiB`` buffer
whose named blocks start at byte offsets ``>= 2**31``, against the same float64 oracles and
poison checks. All of them address those blocks correctly (measured 2026-12-04, vLLM 0.32.0
CPU, AVX512-BF16): no byte offset is kept in 32 bits.

One int32 limit remains in vLLM's kernels, of slot ids rather than byte offsets:
``topk_transform_512_cpu`` writes its global page ids ``page * page_size + offset`` into an
int32 tensor and wraps them (negative) once they pass ``2**31``, i.e. for indexer blocks
``>= 2**31 / 64`` (33.5M blocks of 8448 B: 283 GB of indexer cache per layer).
:func:`test_topk_transform_page_ids_wrap_past_int32` records that. The plugin's CPU layer does
not consume those ids (they go to a scratch lease; the local ids are mapped in int64 by vLLM's
``map_local_to_global_slots_cpu``), and the plugin's own int32 slot tables refuse such ids
(tests/core/test_high_block_ids.py::test_global_slot_ids_past_int32_are_refused).

The ops exist only in vLLM's AVX512-BF16 ``_C`` library; elsewhere these tests skip
(``_helpers.real_cpp_ops``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

_CORE = Path(__file__).resolve().parents[1] / "core"
if str(_CORE) not in sys.path:  # the core module imports oracle
    sys.path.insert(0, str(_CORE))

from _helpers import load_core_module, real_cpp_ops  # noqa: E402  (tests/vllm is on sys.path)
from oracle import (  # noqa: E402
    assert_flashmla_close,
    quantize_ref,
    read_token_bytes,
    sparse_decode_ref,
)

from vllm_dsv4_backend.formats import fp8_ds_mla as F  # noqa: E402
from vllm_dsv4_backend.formats import indexer_cache as ic  # noqa: E402
from vllm_dsv4_backend.ops import vllm_cpu  # noqa: E402

H = load_core_module("test_high_block_ids.py", "_core_high_block_ids")

pytestmark = pytest.mark.vllm

# The core module's fixtures, bound here so pytest finds them for this module.
far = H.far
_one_thread = H._one_thread

# vLLM's C++ sparse MLA rounds more than the torch path (bf16 K/V and probabilities, exp
# approximations): tests/core/test_sparse_mla.py's tolerance for it.
CPP_OUT_TOL = {"abs_tol": 2e-3, "rel_tol": 2.01 / 128, "cos_tol": 1e-5}


def test_swa_insert_far_slots(far) -> None:
    """``fused_qnorm_rope_kv_insert_cpu`` (positions 0: identity RoPE) writes far SWA slots
    (and a block-0 slot) with the oracle quantizer's bytes, except the e4m3 subnormals it
    flushes to signed zero, and nothing else."""
    C = real_cpp_ops(["fused_qnorm_rope_kv_insert_cpu"])
    bs = 64
    cache, view2d, b0, _ = H._mla_cache(far, bs, 2)
    g = torch.Generator().manual_seed(5)
    slots = torch.cat([torch.randperm(2 * bs, generator=g)[:6] + b0 * bs, torch.tensor([9])])
    n = len(slots)
    kv = (torch.randn(n, 512, generator=g) / 4).to(torch.bfloat16)
    cos_sin = torch.cat([torch.ones(4, 32), torch.zeros(4, 32)], dim=1)
    C.fused_qnorm_rope_kv_insert_cpu(
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
    H._untouched(view2d, b0, H._mla_spans(bs, slots))


@pytest.mark.parametrize("extra_block_size", [64, 2], ids=["c4", "c128"])
def test_sparse_mla_far_slots(far, extra_block_size: int) -> None:
    """``flash_mla_with_kvcache_cpu`` (through ``ops.vllm_cpu``'s FlashMLA-interface adapter)
    over window and compressed slots past the boundary agrees with the float64 oracle."""
    real_cpp_ops(["flash_mla_with_kvcache_cpu"])
    win, _, wb0, end = H._mla_cache(far, 64, 2)
    comp, _, cb0, _ = H._mla_cache(far, extra_block_size, 2, after=end)
    g = torch.Generator().manual_seed(13 + extra_block_size)
    win_pool = torch.cat([torch.arange(wb0 * 64, (wb0 + 2) * 64), torch.tensor([3, 60])])
    comp_pool = torch.cat([torch.arange(cb0 * extra_block_size, (cb0 + 2) * extra_block_size),
                           torch.tensor([1])])
    for cache, pool in ((win, win_pool), (comp, comp_pool)):
        kv = (torch.randn(len(pool), 512, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
        F.quantize_and_insert(kv, cache, pool)
    b, h = 3, 64
    lens = torch.tensor([128, 77, 100], dtype=torch.int32)
    idx = H._named_indices(g, b, 128, win_pool, lens)
    extra = H._named_indices(g, b, 128, comp_pool, None)
    q = torch.randn(b, 1, h, 512, generator=g).clamp(-1, 1).to(torch.bfloat16)
    sink = torch.randn(h, generator=g) + 4.0
    scale = 512**-0.5
    out = vllm_cpu.sparse_mla_decode_vllm_cpu(q, win, idx, lens, sink, scale, comp, extra, None)
    ref, _ = sparse_decode_ref(q, [(win, idx, lens), (comp, extra, None)], sink, scale)
    assert_flashmla_close(out, ref, name="out", **CPP_OUT_TOL)


@pytest.mark.parametrize("store", ["main", "fp8"])
@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_far_state_and_caches(far, ratio: int, store: str) -> None:
    """``save_partial_states_cpu`` and ``compress_norm_rope_store[_indexer]_cpu`` on far state
    and cache blocks (the core module's :func:`check_compressor_far`; vLLM's CPU build has
    no MXFP4 store). The C++ writers flush e4m3 subnormals to zero (2**-6 of the scale)."""
    names = ["save_partial_states_cpu",
             "compress_norm_rope_store_cpu" if store == "main"
             else "compress_norm_rope_store_indexer_cpu"]
    C = real_cpp_ops(names)
    H.check_compressor_far(far, ratio, store, getattr(C, names[0]), getattr(C, names[1]),
                           2.0**-6)


def test_indexer_logits_and_topk_far_pages(far) -> None:
    """``fp8_paged_mqa_logits_cpu`` over indexer pages past the boundary (a block-0 page
    among them) matches the float64 oracle; ``topk_transform_512_cpu`` keeps the oracle's
    top-512 and writes their far global page ids."""
    C = real_cpp_ops(["fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu"])
    n_pages, bs = 10, H.IND_BS
    cache, view2d, b0 = H._ind_cache(far, "fp8", n_pages - 1)
    g = torch.Generator().manual_seed(23)
    blocks = torch.tensor([b0 + i for i in range(n_pages - 1)] + [0])
    all_slots = blocks.repeat_interleave(bs) * bs + torch.arange(bs).repeat(n_pages)
    ic.quantize_and_insert(torch.randn(len(all_slots), 128, generator=g).to(torch.bfloat16),
                           cache, all_slots, "fp8")
    t, h = 4, 64
    n_entries = n_pages * bs
    # Each token its own page order (block 0 in the middle), as vLLM's per-token page table.
    pages = torch.stack([blocks[torch.randperm(n_pages, generator=g)] for _ in range(t)])
    pages = pages.to(torch.int32)
    lens = torch.tensor([n_entries, 600, 513, 300], dtype=torch.int32)
    q = torch.randn(t, h, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(t, h, generator=g)
    logits = C.fp8_paged_mqa_logits_cpu(q, view2d, w, lens, pages, bs, n_entries)

    slots = pages.long().repeat_interleave(bs, dim=1) * bs + torch.arange(bs).repeat(n_pages)
    uniq, inv = torch.unique(slots, return_inverse=True)
    keys = H._ind_decode_f64(view2d, "fp8", uniq.tolist())[inv]
    ref = H._logits_ref(H.E4M3[q.view(torch.uint8).long()], w, keys, lens.long())
    valid = torch.isfinite(ref)
    scale = float(ref[valid].abs().max())
    torch.testing.assert_close(logits[valid].double(), ref[valid], rtol=1e-4,
                               atol=1e-5 * scale)

    out_pages = torch.empty(t, 512, dtype=torch.int32)
    out_raw = torch.empty(t, 512, dtype=torch.int32)
    C.topk_transform_512_cpu(logits, lens, pages, out_pages, bs, out_raw)
    for r in range(t):
        n = int(lens[r])
        band = 2 * (1e-4 * float(ref[r, :n].abs().max()) + 1e-5 * scale)
        H.check_topk_set(out_raw[r], ref[r, :n], 512, band)
        got = out_raw[r][out_raw[r] >= 0].long()
        assert torch.equal(out_pages[r][out_raw[r] >= 0].long(), slots[r, got])


def test_topk_transform_page_ids_wrap_past_int32() -> None:
    """Records a limit of vLLM's kernel (see the module docstring): a global page id
    ``page * 64 + offset >= 2**31`` comes out of ``topk_transform_512_cpu`` wrapped, while
    the raw local ids stay right. If vLLM starts refusing or widening them this test fails,
    and the module docstring should say so."""
    C = real_cpp_ops(["topk_transform_512_cpu"])
    bs, t, width = 64, 1, 700
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(t, width, generator=g)
    lens = torch.tensor([width], dtype=torch.int32)
    first = 2**31 // bs - 3  # pages 3.. of the table hold ids >= 2**31
    pages = (first + torch.arange(11, dtype=torch.int64)).view(1, -1).to(torch.int32)
    out_pages = torch.empty(t, 512, dtype=torch.int32)
    out_raw = torch.empty(t, 512, dtype=torch.int32)
    C.topk_transform_512_cpu(scores, lens, pages, out_pages, bs, out_raw)
    raw = out_raw[0].long()
    assert set(raw.tolist()) == set(torch.topk(scores[0], 512).indices.tolist())
    true_ids = pages[0].long()[raw // bs] * bs + raw % bs
    past = true_ids >= 2**31
    assert bool(past.any()) and bool((~past).any())
    assert torch.equal(out_pages[0].long()[~past], true_ids[~past])
    wrapped = true_ids[past] - 2**32
    assert torch.equal(out_pages[0].long()[past], wrapped), "vLLM no longer wraps these ids"
