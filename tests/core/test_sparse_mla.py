# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's torch sparse MLA decode / prefill against the float64 oracle (FlashMLA
semantics and tolerance rule), NaN-poisoned caches, adversarial indices, sinks at +-inf, and
vLLM's C++ CPU kernel (through ``ops.vllm_cpu``'s FlashMLA-interface adapter) as an
independent implementation where it can run."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.oracle import (
    DECODE_LSE_TOL,
    DECODE_OUT_TOL,
    PREFILL_LSE_TOL,
    PREFILL_OUT_TOL,
    assert_flashmla_close,
    sparse_decode_ref,
    sparse_prefill_ref,
)
from vllm_dsv4_backend import ops
from vllm_dsv4_backend.formats import fp8_ds_mla as F
from vllm_dsv4_backend.ops import torch_sparse_mla, vllm_cpu

SCALE = 512**-0.55  # FlashMLA's decode test scale (d_qk ** -0.55)


pytestmark = pytest.mark.usefixtures("one_thread")


class CountAllocs(TorchDispatchMode):
    """Counts ops that return fresh storage (factory ops and out-of-place results)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        res = func(*args, **kwargs)
        if func._schema.is_mutable or func.is_view:
            return res
        ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for r in res if isinstance(res, (tuple, list)) else [res]:
            if isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() not in ins:
                self.ops.append(str(func))
        return res


# --------------------------------------------------------------------------------------------
# decode case builder
# --------------------------------------------------------------------------------------------
@dataclass
class DecodeCase:
    q: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    sink: torch.Tensor | None

    def args(self) -> tuple:
        (c1, i1, l1) = self.caches[0]
        extra = self.caches[1] if len(self.caches) > 1 else (None, None, None)
        return (self.q, c1, i1, l1, self.sink, SCALE, *extra)


def _named(idx: torch.Tensor, lens: torch.Tensor | None) -> torch.Tensor:
    valid = idx != -1
    if lens is not None:
        valid &= torch.arange(idx.shape[-1]).view(1, 1, -1) < lens.view(-1, 1, 1).long()
    return idx[valid].unique()


def _make_cache(g: torch.Generator, b: int, s_q: int, block_size: int, num_blocks: int,
                topk: int, padded: bool, lens_kind: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A NaN-poisoned cache (every byte 0xFF) in which only the slots the used indices name
    hold real data; indices mix -1 (incl. a fully invalid row) with real slots."""
    n_slots = num_blocks * block_size
    cache = F.allocate_cache(num_blocks, block_size, padded=padded, fill=0xFF)
    idx = torch.randint(0, n_slots, (b, s_q, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(b, s_q, topk, generator=g) < 0.2] = -1
    if b > 1:
        idx[1] = -1  # a batch row with no valid index
    lens = None
    if lens_kind == "random":
        lens = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32)
        lens[0] = topk // 3
        if b > 2:
            lens[2] = 0
        # Entries beyond the length may hold garbage (never read, never range-checked).
        beyond = torch.arange(topk).view(1, 1, -1) >= lens.view(-1, 1, 1).long()
        idx = torch.where(beyond & (torch.rand(b, s_q, topk, generator=g) < 0.3),
                          torch.full_like(idx, 10**9), idx)
    slots = _named(idx, lens)
    kv = (torch.randn(len(slots), 512, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    F.quantize_and_insert(kv, cache, slots)
    return cache, idx, lens


def make_decode_case(seed: int, b: int, s_q: int, h: int, main: tuple, extra: tuple | None,
                     sink_kind: str = "mixed", noncontig_q: bool = True) -> DecodeCase:
    """``main`` / ``extra``: (block_size, num_blocks, topk, padded, lens_kind)."""
    g = torch.Generator().manual_seed(seed)
    caches = [_make_cache(g, b, s_q, *main[:3], main[3], main[4])]
    if extra is not None:
        caches.append(_make_cache(g, b, s_q, *extra[:3], extra[3], extra[4]))
    q = torch.randn(b, s_q, h, 512, generator=g).clamp(-1, 1).to(torch.bfloat16)
    if noncontig_q:
        wide = torch.zeros(s_q, b, h, 640, dtype=torch.bfloat16)
        wide[..., 64:576] = q.transpose(0, 1)
        q = wide[..., 64:576].transpose(0, 1)
        assert not q.is_contiguous()
    sink = None
    if sink_kind == "mixed":
        # Finite sinks near the typical lse (~ln(valid count)) so they carry real weight.
        sink = torch.randn(h, generator=g) + 4.0
        sink[: h // 4] = math.inf
        sink[h // 4 : h // 2] = -math.inf
    elif sink_kind == "posinf":
        sink = torch.full((h,), math.inf)
    elif sink_kind == "neginf":
        sink = torch.full((h,), -math.inf)
    return DecodeCase(q, caches, sink)


def check_decode(case: DecodeCase, out: torch.Tensor, lse: torch.Tensor | None,
                 out_tol: dict = DECODE_OUT_TOL) -> None:
    ref_out, ref_lse = sparse_decode_ref(case.q, case.caches, case.sink, SCALE)
    assert out.dtype == torch.bfloat16 and out.shape == case.q.shape
    assert_flashmla_close(out, ref_out, name="out", **out_tol)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
        assert_flashmla_close(lse, ref_lse, name="lse", **DECODE_LSE_TOL)


# main: (block_size, num_blocks, topk, padded, lens); extra likewise.
DECODE_GEOMETRIES = [
    ((2, 90, 64, True, "random"), (64, 5, 128, True, "random")),
    ((61, 4, 128, False, "none"), (2, 100, 64, False, "random")),
    ((64, 3, 64, True, "random"), (61, 6, 192, True, "none")),
    ((64, 4, 128, True, "random"), None),
]


@pytest.mark.parametrize("geometry", range(len(DECODE_GEOMETRIES)))
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("s_q", [1, 2])
def test_decode_matches_oracle(geometry: int, h: int, s_q: int) -> None:
    main, extra = DECODE_GEOMETRIES[geometry]
    case = make_decode_case(1000 * geometry + 10 * h + s_q, 4, s_q, h, main, extra)
    out, lse = ops.sparse_mla_decode(*case.args())
    check_decode(case, out, lse)
    # The fully invalid batch row: out 0, lse +inf.
    assert bool((out[1] == 0).all()) and bool(torch.isposinf(lse[1]).all())


@pytest.mark.parametrize("sink_kind", ["none", "posinf", "neginf", "mixed"])
def test_decode_sinks(sink_kind: str) -> None:
    case = make_decode_case(7, 3, 2, 64, (64, 4, 128, True, "random"),
                            (2, 80, 64, True, "random"), sink_kind=sink_kind)
    out, lse = ops.sparse_mla_decode(*case.args())
    check_decode(case, out, lse)
    if sink_kind == "posinf":
        assert bool((out == 0).all())
    if sink_kind in ("none", "neginf", "posinf"):
        # The sink never changes the lse; -inf behaves exactly like no sink.
        case_none = DecodeCase(case.q, case.caches, None)
        out_none, lse_none = ops.sparse_mla_decode(*case_none.args())
        assert torch.equal(lse, lse_none)
        if sink_kind == "neginf":
            assert torch.equal(out, out_none)


def test_decode_online_softmax_segments() -> None:
    """A tiny budget forces 1-row chunks; 256 + 192 columns give three 128-column segments
    and two online-softmax groups, and rows whose first segments are all invalid exercise
    the running max starting at -inf. The budget only sets the chunking: same bits."""
    case = make_decode_case(11, 2, 2, 64, (2, 200, 256, True, "random"),
                            (64, 6, 192, False, "random"))
    (c1, i1, l1), (c2, i2, l2) = case.caches
    i1[0, 0, :200] = -1
    out, lse = ops.sparse_mla_decode(
        case.q, c1, i1, l1, case.sink, SCALE, c2, i2, l2, budget_bytes=1 << 19)
    check_decode(case, out, lse)
    full_out, full_lse = ops.sparse_mla_decode(*case.args())
    assert torch.equal(out, full_out) and torch.equal(lse, full_lse)


def test_decode_zero_topk_and_empty_batch() -> None:
    cache = F.allocate_cache(2, 64, fill=0xFF)
    q = torch.randn(3, 1, 64, 512).to(torch.bfloat16)
    idx = torch.zeros(3, 1, 0, dtype=torch.int32)
    out, lse = ops.sparse_mla_decode(q, cache, idx, None, None, SCALE)
    assert bool((out == 0).all()) and bool(torch.isposinf(lse).all())
    out, lse = ops.sparse_mla_decode(q[:0], cache, idx[:0], None, None, SCALE)
    assert out.shape == (0, 1, 64, 512) and lse.shape == (0, 64, 1)


def test_decode_out_buffers_in_place_and_allocation_free() -> None:
    case = make_decode_case(3, 4, 2, 64, (64, 4, 128, True, "random"),
                            (2, 100, 64, True, "random"))
    b, s_q, h, _ = case.q.shape
    out = torch.full((b, s_q, h, 512), math.nan, dtype=torch.bfloat16)
    lse = torch.full((b, h, s_q), math.nan)
    scratch = torch.empty(ops.decode_scratch_nbytes(b, s_q, h, 128, 64), dtype=torch.uint8)
    ptrs = (out.data_ptr(), lse.data_ptr())
    o, l_ = ops.sparse_mla_decode(*case.args(), out=out, lse_out=lse, scratch=scratch)
    assert o is out and l_ is lse and (out.data_ptr(), lse.data_ptr()) == ptrs
    check_decode(case, out, lse)
    with CountAllocs() as counter:
        ops.sparse_mla_decode(*case.args(), out=out, lse_out=lse, scratch=scratch)
    assert counter.ops == []
    # A strided out view (a slice of a workspace) is written in place too.
    big = torch.zeros(b, s_q, h + 8, 512, dtype=torch.bfloat16)
    ops.sparse_mla_decode(*case.args(), out=big[:, :, 4 : 4 + h])
    assert torch.equal(big[:, :, 4 : 4 + h], out)
    assert bool((big[:, :, :4] == 0).all())
    # need_lse=False returns None for the lse.
    o2, l2 = ops.sparse_mla_decode(*case.args(), need_lse=False)
    assert l2 is None and torch.equal(o2, out)


def test_decode_scratch_views_reused_then_released() -> None:
    """The views carved from a caller's scratch are kept per buffer and plan (a decode step
    reuses them): other shapes through the same buffer still give the fresh-buffer bits,
    and dropping the buffer drops its entry (the cache never holds its memory)."""
    import gc
    import weakref

    big = make_decode_case(3, 4, 2, 64, (64, 4, 128, True, "random"),
                           (2, 100, 64, True, "random"))
    small = make_decode_case(4, 1, 1, 64, (64, 4, 128, True, "random"), None)
    scratch = torch.empty(ops.decode_scratch_nbytes(4, 2, 64, 128, 64), dtype=torch.uint8)
    fresh = [ops.sparse_mla_decode(*c.args()) for c in (big, small)]
    for _ in range(2):  # big, small, big, small through one buffer
        for case, (ref_out, ref_lse) in zip((big, small), fresh):
            out, lse = ops.sparse_mla_decode(*case.args(), scratch=scratch)
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    key = id(scratch)
    carved = torch_sparse_mla._CARVED[key][1]
    assert len(carved) == 2  # one entry per plan
    # The views of the buffer live in these objects (the _Softmax of each plan).
    alive = [weakref.ref(views[0]) for views in carved.values()]
    del scratch, carved
    gc.collect()
    assert key not in torch_sparse_mla._CARVED
    assert all(ref() is None for ref in alive)


def test_decode_small_scratch_chunks_and_too_small_raises() -> None:
    case = make_decode_case(5, 4, 1, 64, (64, 4, 128, True, "random"), None)
    need = ops.decode_scratch_nbytes(4, 1, 64, 128)
    small = ops.decode_scratch_nbytes(1, 1, 64, 128)
    assert small < need
    out, lse = ops.sparse_mla_decode(*case.args(), scratch=torch.empty(small, dtype=torch.uint8))
    check_decode(case, out, lse)
    # Any size from the minimum plan (one row quantum) up works, also as an unaligned view
    # into a bigger buffer, with the same bits (the index segments never depend on it).
    minimum = ops.decode_scratch_nbytes(4, 1, 64, 128, budget_bytes=1)
    ref_out, ref_lse = out, lse
    for nbytes in (minimum, minimum + 777, (minimum + need) // 2, need - 1):
        buf = torch.empty(nbytes + 3, dtype=torch.uint8)[3:]
        out, lse = ops.sparse_mla_decode(*case.args(), scratch=buf)
        check_decode(case, out, lse)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    with pytest.raises(ValueError, match="scratch: expected at least"):
        ops.sparse_mla_decode(*case.args(), scratch=torch.empty(minimum - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scratch: expected a 1-D torch.uint8"):
        ops.sparse_mla_decode(*case.args(), scratch=torch.empty(need, dtype=torch.int8))


@pytest.mark.parametrize("bad_value", [-2, 256, 2**31 - 1, -(2**31)])
def test_decode_out_of_range_index_raises(bad_value: int) -> None:
    case = make_decode_case(9, 2, 1, 64, (64, 4, 64, True, "none"), (2, 50, 64, True, "none"))
    case.caches[1][1][1, 0, 5] = bad_value if bad_value != 256 else 100
    name = "extra_indices" if bad_value != 256 else None
    if bad_value == 256:
        case.caches[0][1][0, 0, 3] = 256  # == num_slots of the main cache
        name = "indices"
    with pytest.raises(ValueError, match=rf"{name}: expected slot ids in \[-1, "):
        ops.sparse_mla_decode(*case.args())


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------
OVERFLOW = [-(2**31), -123456, -1, None, 114514, 1919810, 2147480000, 2**31 - 1]


def make_prefill_case(seed: int, s_q: int, h: int, s_kv: int, topk: int, *,
                      with_len: bool = True, sink: bool = True):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(s_q, h, 512, generator=g) / 10 + (torch.rand(s_q, h, 512, generator=g)
                                                       - 0.5) / 10).clamp(-10, 10)
    wide = torch.zeros(s_q, h, 600, dtype=torch.bfloat16)
    wide[..., :512] = q.to(torch.bfloat16)
    q = wide[..., :512]  # non-contiguous rows
    kv = (torch.randn(s_kv, 1, 512, generator=g) / 10).clamp(-10, 10).to(torch.bfloat16)
    idx = torch.empty(s_q, 1, topk, dtype=torch.int32)
    over = torch.tensor([s_kv if v is None else v for v in OVERFLOW], dtype=torch.int64)
    for i in range(s_q):
        perm = torch.randperm(s_kv, generator=g)[:topk]
        row = torch.cat([perm, over[torch.randint(0, len(over), (max(0, topk - s_kv),),
                                                  generator=g)]])
        row = row[torch.randperm(topk, generator=g)]
        row[torch.rand(topk, generator=g) < 0.1] = over[torch.randint(0, len(over), (1,),
                                                                      generator=g)]
        idx[i, 0] = row.to(torch.int32)
    idx[0] = -1  # an all-invalid row
    lens = None
    if with_len:
        lens = torch.randint(0, max(topk + 1, 64), (s_q,), generator=g).clamp(max=topk)
        lens = lens.to(torch.int32)
        if s_q > 2:
            lens[2] = 0
    sink_t = None
    if sink:
        sink_t = torch.randn(h, generator=g) + 4.0
        r = torch.rand(h, generator=g)
        sink_t[r < 0.31] = math.inf
        sink_t[r > 0.69] = -math.inf
    # Every kv row that no valid index names is NaN: it must never reach the result.
    valid = (idx[:, 0] >= 0) & (idx[:, 0] < s_kv)
    if lens is not None:
        valid &= torch.arange(topk).view(1, -1) < lens.view(-1, 1).long()
    named = torch.zeros(s_kv, dtype=torch.bool)
    named[idx[:, 0][valid].long()] = True
    kv[~named] = math.nan
    return q, kv, idx, sink_t, lens


def check_prefill(q, kv, idx, sm_scale, sink, lens, out, ml, lse) -> None:
    ro, rm, rl = sparse_prefill_ref(q, kv, (idx, lens), sink, sm_scale)
    assert_flashmla_close(out, ro, name="out", **PREFILL_OUT_TOL)
    assert_flashmla_close(ml, rm, name="max_logits", **PREFILL_LSE_TOL)
    assert_flashmla_close(lse, rl, name="lse", **PREFILL_LSE_TOL)


@pytest.mark.parametrize("s_kv,topk", [(128, 128), (592, 128), (95, 128), (153, 256)])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("s_q", [1, 13])
def test_prefill_matches_oracle(s_kv: int, topk: int, h: int, s_q: int) -> None:
    q, kv, idx, sink, lens = make_prefill_case(s_kv + topk + h + s_q, s_q, h, s_kv, topk)
    out, ml, lse = ops.sparse_mla_prefill(q, kv, idx, 0.5, sink, lens)
    check_prefill(q, kv, idx, 0.5, sink, lens, out, ml, lse)
    assert bool((out[0] == 0).all())
    assert bool(torch.isneginf(ml[0]).all()) and bool(torch.isposinf(lse[0]).all())


def test_prefill_without_sink_or_lengths_and_segments() -> None:
    q, kv, idx, _, _ = make_prefill_case(1, 8, 64, 300, 512, with_len=False, sink=False)
    out, ml, lse = ops.sparse_mla_prefill(q, kv, idx, 0.5)
    check_prefill(q, kv, idx, 0.5, None, None, out, ml, lse)
    o2, m2, l2 = ops.sparse_mla_prefill(q, kv, idx, 0.5, budget_bytes=1 << 19)
    check_prefill(q, kv, idx, 0.5, None, None, o2, m2, l2)
    # A smaller budget only chunks the rows: the same bits.
    assert torch.equal(o2, out) and torch.equal(m2, ml) and torch.equal(l2, lse)


def test_prefill_out_buffers_and_allocation_free() -> None:
    s_q, h = 30, 64
    q, kv, idx, sink, lens = make_prefill_case(2, s_q, h, 200, 128)
    out = torch.empty(s_q, h, 512, dtype=torch.bfloat16)
    ml = torch.empty(s_q, h)
    lse = torch.empty(s_q, h)
    scratch = torch.empty(ops.prefill_scratch_nbytes(s_q, h, 128), dtype=torch.uint8)
    res = ops.sparse_mla_prefill(q, kv, idx, 0.5, sink, lens, out=out, max_logits_out=ml,
                                 lse_out=lse, scratch=scratch)
    assert res[0] is out and res[1] is ml and res[2] is lse
    check_prefill(q, kv, idx, 0.5, sink, lens, out, ml, lse)
    with CountAllocs() as counter:
        ops.sparse_mla_prefill(q, kv, idx, 0.5, sink, lens, out=out, max_logits_out=ml,
                               lse_out=lse, scratch=scratch)
    assert counter.ops == []


def test_prefill_empty_kv() -> None:
    q = torch.randn(3, 64, 512).to(torch.bfloat16)
    kv = torch.zeros(0, 1, 512, dtype=torch.bfloat16)
    idx = torch.tensor([[[0, -1, 5] + [7] * 61]] * 3, dtype=torch.int32)
    out, ml, lse = ops.sparse_mla_prefill(q, kv, idx, 0.5)
    assert bool((out == 0).all()) and bool(torch.isneginf(ml).all())
    assert bool(torch.isposinf(lse).all())


# --------------------------------------------------------------------------------------------
# bad inputs (every ValueError of the checks)
# --------------------------------------------------------------------------------------------
def _decode_args():
    q = torch.zeros(2, 1, 64, 512, dtype=torch.bfloat16)
    cache = F.allocate_cache(2, 64)
    idx = torch.zeros(2, 1, 64, dtype=torch.int32)
    return dict(q=q, k_cache=cache, indices=idx, topk_length=None, attn_sink=None,
                softmax_scale=SCALE)


DECODE_BAD = [
    ("q", torch.zeros(2, 64, 512, dtype=torch.bfloat16),
     r"q: expected shape \[b, s_q, h_q, 512\]"),
    ("q", torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16), r"q: expected shape"),
    ("q", torch.zeros(2, 1, 64, 512, dtype=torch.float16), r"q: .*dtype torch.bfloat16"),
    ("k_cache", torch.zeros(2, 64, 576, dtype=torch.uint8), "k_cache: expected last dim 584"),
    ("k_cache", torch.zeros(2, 64, 584, dtype=torch.float32),
     "k_cache: expected dtype torch.uint8"),
    ("indices", torch.zeros(2, 1, 64, dtype=torch.int64), "indices: int32 is required"),
    ("indices", torch.zeros(3, 1, 64, dtype=torch.int32),
     r"indices: expected shape \[2, 1, topk\]"),
    ("topk_length", torch.zeros(2, dtype=torch.int64), "topk_length: int32 is required"),
    ("topk_length", torch.zeros(3, dtype=torch.int32), r"topk_length: expected shape \[2\]"),
    ("attn_sink", torch.zeros(32), r"attn_sink: expected shape \[64\]"),
    ("attn_sink", torch.zeros(64, dtype=torch.bfloat16), "attn_sink: .*dtype torch.float32"),
    ("softmax_scale", "0.1", "softmax_scale: expected a Python float"),
    ("extra_k_cache", F.allocate_cache(2, 2), "extra_k_cache / extra_indices: expected both"),
    ("extra_topk_length", torch.zeros(2, dtype=torch.int32), "extra_topk_length: expected None"),
    ("out", torch.zeros(2, 1, 64, 512),
     r"out: expected shape \[2, 1, 64, 512\], dtype torch.bfloat16"),
    ("lse_out", torch.zeros(2, 1, 64), r"lse_out: expected shape \[2, 64, 1\]"),
    ("indices", torch.zeros(2, 1, 64, dtype=torch.int32, device="meta"),
     "indices: expected .*device cpu; got .*device meta"),
    ("k_cache", F.allocate_cache(2, 64).to("meta"), "k_cache: expected device cpu"),
]


def _refused(op: Callable[..., Any], kw: dict[str, Any], match: str) -> None:
    """``op(**kw)`` raises the ValueError ``match`` names."""
    with pytest.raises(ValueError, match=match):
        op(**kw)


@pytest.mark.parametrize("name,value,match", DECODE_BAD, ids=[f"{i}-{d[0]}" for i, d in
                                                             enumerate(DECODE_BAD)])
def test_decode_bad_inputs(name: str, value, match: str) -> None:
    _refused(ops.sparse_mla_decode, {**_decode_args(), name: value}, match)


def test_decode_bad_extra_indices() -> None:
    kw = _decode_args()
    kw.update(extra_k_cache=F.allocate_cache(2, 2),
              extra_indices=torch.zeros(2, 1, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="extra_indices: int32 is required"):
        ops.sparse_mla_decode(**kw)
    kw["extra_indices"] = torch.zeros(2, 2, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"extra_indices: expected shape \[2, 1, extra_topk\]"):
        ops.sparse_mla_decode(**kw)
    kw["extra_indices"] = torch.zeros(2, 1, 64, dtype=torch.int32)
    kw["extra_topk_length"] = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="extra_topk_length: int32 is required"):
        ops.sparse_mla_decode(**kw)


def _prefill_args():
    return dict(q=torch.zeros(4, 64, 512, dtype=torch.bfloat16),
                kv=torch.zeros(10, 1, 512, dtype=torch.bfloat16),
                indices=torch.zeros(4, 1, 64, dtype=torch.int32), sm_scale=0.5)


PREFILL_BAD = [
    ("q", torch.zeros(4, 64, 576, dtype=torch.bfloat16), r"q: expected shape \[s_q, h_q, 512\]"),
    ("q", torch.zeros(4, 64, 512), "q: .*dtype torch.bfloat16"),
    ("kv", torch.zeros(10, 2, 512, dtype=torch.bfloat16), r"kv: expected shape \[s_kv, 1, 512\]"),
    ("kv", torch.zeros(10, 1, 512), "kv: .*dtype torch.bfloat16"),
    ("indices", torch.zeros(4, 1, 64, dtype=torch.int64), "indices: int32 is required"),
    ("indices", torch.zeros(4, 2, 64, dtype=torch.int32),
     r"indices: expected shape \[4, 1, topk\]"),
    ("sm_scale", None, "sm_scale: expected a Python float"),
    ("attn_sink", torch.zeros(64, 1), r"attn_sink: expected shape \[64\]"),
    ("topk_length", torch.zeros(4, dtype=torch.int64), "topk_length: int32 is required"),
    ("topk_length", torch.zeros(5, dtype=torch.int32), r"topk_length: expected shape \[4\]"),
    ("out", torch.zeros(4, 64, 512), r"out: expected shape \[4, 64, 512\], dtype torch.bfloat16"),
    ("max_logits_out", torch.zeros(4, 65), r"max_logits_out: expected shape \[4, 64\]"),
    ("lse_out", torch.zeros(4, 64, dtype=torch.float64), "lse_out: .*dtype torch.float32"),
    ("kv", torch.zeros(10, 1, 512, dtype=torch.bfloat16, device="meta"),
     "kv: expected .*device cpu"),
]


@pytest.mark.parametrize("name,value,match", PREFILL_BAD, ids=[f"{i}-{d[0]}" for i, d in
                                                               enumerate(PREFILL_BAD)])
def test_prefill_bad_inputs(name: str, value, match: str) -> None:
    _refused(ops.sparse_mla_prefill, {**_prefill_args(), name: value}, match)


# --------------------------------------------------------------------------------------------
# vLLM's C++ CPU kernel as an independent implementation (where it can run)
# --------------------------------------------------------------------------------------------
CPP_OUT_TOL = {"abs_tol": 2e-3, "rel_tol": 2.01 / 128, "cos_tol": 1e-5}


@pytest.mark.parametrize("geometry", range(len(DECODE_GEOMETRIES)))
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("s_q", [1, 2])
def test_decode_vs_vllm_cpp_kernel(geometry: int, h: int, s_q: int) -> None:
    ok, why = vllm_cpu.load()
    if not ok:
        pytest.skip(f"vLLM's C++ flash_mla_with_kvcache_cpu unavailable: {why}")
    main, extra = DECODE_GEOMETRIES[geometry]
    case = make_decode_case(1000 * geometry + 10 * h + s_q, 4, s_q, h, main, extra)
    out = vllm_cpu.sparse_mla_decode_vllm_cpu(*case.args())
    check_decode(case, out, None, out_tol=CPP_OUT_TOL)
    ours, _ = ops.sparse_mla_decode(*case.args())
    assert_flashmla_close(out, ours.double(), name="C++ vs torch", **CPP_OUT_TOL)


def _emulated_cpp_kernel(out, q, w_cache_2d, w_slots, w_bs, c_cache_2d, c_slots, c_bs, sink,
                         scale):
    """float64 emulation of ``flash_mla_with_kvcache_cpu`` written from its C++ source:
    per-token int64 slot rows, entries ``< 0`` or ``>= num_blocks*B`` skipped, sink applied as
    ``out *= 1/(1 + e^(sink - lse))``; also asserts the argument contract the kernel checks."""
    from tests.support.oracle import dequant_slots_f64

    t, h, d = q.shape
    assert d == 512 and q.dtype == torch.bfloat16 and q.stride(-1) == 1
    assert out.shape == (t, h, 512) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert w_slots.dtype == torch.int64 and c_slots.dtype == torch.int64
    assert w_slots.is_contiguous() and c_slots.is_contiguous()
    assert w_slots.shape[0] == t and c_slots.shape[0] == t and w_slots.shape[1] >= 1
    assert sink.dtype == torch.float32 and sink.is_contiguous() and sink.numel() == h
    assert isinstance(scale, float)
    ks, valids = [], []
    for c2d, slots, bs in ((w_cache_2d, w_slots, w_bs), (c_cache_2d, c_slots, c_bs)):
        if slots.shape[1] == 0:
            continue
        nb = c2d.shape[0]
        c3 = torch.as_strided(c2d, (nb, bs, 584), (c2d.stride(0), 584, 1), c2d.storage_offset())
        valid = (slots >= 0) & (slots < nb * bs)
        k = torch.zeros(t, slots.shape[1], 512, dtype=torch.float64)
        if valid.any():
            k[valid] = dequant_slots_f64(c3, slots[valid])
        ks.append(k)
        valids.append(valid)
    k, valid = torch.cat(ks, 1), torch.cat(valids, 1)
    s = torch.einsum("thd,tkd->thk", q.double(), k) * scale
    s = s.masked_fill(~valid.unsqueeze(1), -math.inf)
    lse = torch.logsumexp(s, -1)
    empty = torch.isneginf(lse)
    lse0 = torch.where(empty, torch.zeros_like(lse), lse)
    p = torch.exp(s - lse0.unsqueeze(-1))
    res = torch.einsum("thk,tkd->thd", p, k) / (1 + torch.exp(sink.double() - lse0)).unsqueeze(-1)
    res = torch.where(empty.unsqueeze(-1), torch.zeros_like(res), res)
    out.copy_(res.to(torch.bfloat16))


@pytest.mark.parametrize("geometry", range(len(DECODE_GEOMETRIES)))
def test_vllm_cpu_adapter_with_emulated_kernel(monkeypatch: pytest.MonkeyPatch,
                                               geometry: int) -> None:
    """The vllm_cpu adapter's translation (s_q folded into tokens, lengths written as -1,
    int64 slots, padded 2-D cache views, sink None -> -inf, strided out) against an emulation
    of the C++ kernel, so it is exercised even where vLLM's AVX512-BF16 library cannot run."""
    monkeypatch.setattr(vllm_cpu, "load", lambda: (True, "emulated"))
    monkeypatch.setattr(vllm_cpu, "cpp_op", lambda: _emulated_cpp_kernel)
    main, extra = DECODE_GEOMETRIES[geometry]
    for sink_kind in ("mixed", "none"):
        case = make_decode_case(50 + geometry, 3, 2, 64, main, extra, sink_kind=sink_kind)
        out = vllm_cpu.sparse_mla_decode_vllm_cpu(*case.args())
        check_decode(case, out, None)
    big = torch.zeros(3, 2, 72, 512, dtype=torch.bfloat16)
    vllm_cpu.sparse_mla_decode_vllm_cpu(*case.args(), out=big[:, :, 8:])
    assert torch.equal(big[:, :, 8:], out) and bool((big[:, :, :8] == 0).all())
    # Bad arguments and out-of-range ids are rejected before reaching the kernel (it would
    # skip such ids).
    bad = case.caches[0][1].clone()
    bad[0, 0, 0] = -5
    args = list(case.args())
    args[2] = bad
    with pytest.raises(ValueError, match=r"indices: expected slot ids in \[-1, "):
        vllm_cpu.sparse_mla_decode_vllm_cpu(*args)
    args[2] = bad.long()
    with pytest.raises(ValueError, match="indices: int32 is required"):
        vllm_cpu.sparse_mla_decode_vllm_cpu(*args)


def test_vllm_cpu_adapter_refuses_when_kernel_cannot_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_decode_case(4, 2, 1, 64, (64, 4, 64, True, "none"), None)
    monkeypatch.setattr(vllm_cpu, "load", lambda: (False, "no AVX512-BF16 here"))
    with pytest.raises(RuntimeError, match="cannot run: no AVX512-BF16 here"):
        vllm_cpu.sparse_mla_decode_vllm_cpu(*case.args())


def test_vllm_cpu_ignores_plugin_fallback_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch fallback registered under ``torch.ops._C.flash_mla_with_kvcache_cpu`` by the
    plugin (flagged ``__vllm_dsv4_fallback__``) is not vLLM's C++ kernel."""
    from types import SimpleNamespace

    monkeypatch.setattr(vllm_cpu, "_lookup",
                        lambda name: SimpleNamespace(**{vllm_cpu.FALLBACK_FLAG: True}))
    assert not vllm_cpu.has_op()
    monkeypatch.setattr(vllm_cpu, "_lookup", lambda name: SimpleNamespace())
    assert vllm_cpu.has_op()
    monkeypatch.setattr(vllm_cpu, "_lookup", lambda name: None)
    assert not vllm_cpu.has_op()


def test_nonfinite_entry_of_one_row_does_not_spread_to_others() -> None:
    # docs/correctness.md (found by the mod-4 sweep): an invalid entry (-1) reads a
    # stand-in slot another row names; its score is masked, but 0 * NaN is NaN in
    # p @ V. Row 1 names only finite slots: its output must equal row 1 run alone,
    # as vLLM's C++ kernel keeps it.
    torch.manual_seed(0)
    cache = F.allocate_cache(1, 64, fill=0xFF)  # unwritten slots decode to NaN
    F.quantize_and_insert(torch.randn(2, 512).bfloat16(), cache, torch.tensor([0, 1]))
    q = torch.randn(2, 1, 8, 512).bfloat16()
    idx = torch.tensor([[[0, 1, 5]], [[0, 1, -1]]], dtype=torch.int32)
    out, _ = ops.sparse_mla_decode(q, cache, idx, None, None, 512**-0.5)
    alone, _ = ops.sparse_mla_decode(q[1:], cache, idx[1:], None, None, 512**-0.5)
    assert torch.isnan(out[0]).all()  # row 0 named the NaN slot itself
    assert torch.isfinite(out[1]).all()
    assert torch.equal(out[1], alone[0])

    kv = torch.randn(8, 1, 512).bfloat16()
    kv[5] = float("nan")
    qp = torch.randn(2, 8, 512).bfloat16()
    pidx = torch.tensor([[[0, 1, 5]], [[0, 1, -1]]], dtype=torch.int32)
    pout, _, _ = ops.sparse_mla_prefill(qp, kv, pidx, 512**-0.5)
    palone, _, _ = ops.sparse_mla_prefill(qp[1:], kv, pidx[1:], 512**-0.5)
    assert torch.isfinite(pout[1]).all()
    assert torch.equal(pout[1], palone[0])
