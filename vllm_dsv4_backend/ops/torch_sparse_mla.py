# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA in vectorized PyTorch (torch only), which runs anywhere: the served CPU
layer's sparse MLA with ``VLLM_DSV4_KERNEL=torch``, the torch fallback of vLLM's C++
``flash_mla_with_kvcache_cpu`` on CPUs without AVX512-BF16, and the tests' oracle.

Semantics are FlashMLA's (``flash_mla_with_kvcache`` sparse decode over the ``fp8_ds_mla``
cache, ``flash_mla_sparse_fwd`` prefill over a bf16 KV buffer), computed in fp32:

- scores ``s_j = softmax_scale * <q, k_j>`` over the valid indices of a row, ``K = V`` = the
  whole 512-d row (448 dequantized NoPE + 64 RoPE);
- ``out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink})`` (no sink: drop the last term);
  ``sink = +inf`` zeroes the row, ``-inf`` has no effect;
- ``lse = log sum_j e^{s_j}`` (natural log, the sink excluded); a row without a valid index
  gives ``out = 0`` and ``lse = +inf`` (prefill also ``max_logits = -inf``).

Implementation: query rows are processed in chunks and the index axis in fixed-width,
fixed-origin pieces, so that a row's result is bitwise independent of the rest of the call:

- each index list (``indices``, ``extra_indices``) is cut from its own column 0 into
  *segments* of :data:`SEGMENT` (128) columns, the last one padded with invalid columns;
  every GEMM and every sum of a row runs over exactly one segment (``S^T = K Q^T`` with
  M = 128 entries, ``sum(P)`` over 128, ``P K`` with K = 128), folded in column order;
- up to :data:`GROUP_SEGMENTS` (4) consecutive segments of one list form a *group*, the
  block of the online (running max) softmax: the first group of a row is stored as is,
  each later one rescales the running state by ``exp(m_old - m_new)`` and adds;
- a later group with no valid entry in any row of the chunk is skipped, which is exact:
  its scores are all -inf, so the max does not move (rescale by exactly 1), it adds zeros,
  and a row of the chunk that has no valid entry in a group the chunk runs folds it as
  the same no-op.

The structure of a row's reduction thus depends only on its own index lists: padding a
list with -1 to a wider width, the other rows of the batch, the chunking of rows, the
memory budget and the deduplicated path all give the same bits (BLAS and reduction kernels
are deterministic for a fixed shape; a wider reduction, as the old full-width segment
had, rounds differently: MKL's ``P K`` with K = 256 vs 512 zero-padded differs; and a chunk
of fewer rows than threads runs its GEMMs on one thread, :mod:`~vllm_dsv4_backend.ops.blas`,
because MKL's AVX2 kernels round a lone GEMM by how they split it). The
fp32 working set stays under ``budget_bytes`` (32 MiB by default) for any top-k: the
budget only sets the rows per chunk. Only the named slots are
gathered and dequantized (a fused gather + bit-level e4m3 decode,
``fp8_ds_mla.gather_dequant_into``); an invalid entry reads a slot that the same call
names validly and a padding column a zero row (their score is then set to -inf, so their
weight is exactly 0), so unnamed cache slots, which may hold NaN, are never touched.
Matmuls are fp32 ``bmm`` (bf16 ``bmm`` is ~20x slower on CPUs without AVX512-BF16), which
also keeps the result within FlashMLA's test tolerances of a float64 oracle. Every
intermediate lives in one scratch byte buffer; with ``out``, ``lse_out`` and ``scratch``
supplied a call allocates nothing (see :func:`decode_scratch_nbytes`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.ops.blas import gemm_one_thread, lone_gemm
from vllm_dsv4_backend.ops.checks import (
    DecodeDims,
    PrefillDims,
    check_decode_args,
    check_prefill_args,
)

__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "GROUP_SEGMENTS",
    "SEGMENT",
    "decode_scratch_nbytes",
    "prefill_scratch_nbytes",
    "sparse_mla_decode",
    "sparse_mla_prefill",
]

D = fp8_ds_mla.HEAD_DIM
DEFAULT_BUDGET_BYTES = 32 << 20
SEGMENT = 128
"""Index columns per segment: the M of ``S^T = K Q^T`` and the K of ``P V`` of every GEMM.
Fixed (never derived from the call's width or budget) so that a row's rounding is fixed."""
GROUP_SEGMENTS = 4
"""Segments per online-softmax block (512 columns: one C4 top-k list is a single block)."""
GROUP = SEGMENT * GROUP_SEGMENTS
_ALIGN = 64
_TINY = 1e-30


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _groups(parts: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(part, first column, width)`` of every group, in order; ``parts`` gives each index
    list's ``(first combined column, width)``. Each list's groups start at its own column 0,
    so the padding of one list never moves the groups of another."""
    out = []
    for p, (base, n) in enumerate(parts):
        for c0 in range(0, n, GROUP):
            out.append((p, base + c0, min(GROUP, n - c0)))
    return out


def _group_cols(widths: tuple[int, ...]) -> int:
    """Columns of the per-row K buffer: the widest group, padded to whole segments."""
    return max([SEGMENT] + [min(GROUP, _round_up(n, SEGMENT)) for n in widths])


# --------------------------------------------------------------------------------------------
# scratch planning
# --------------------------------------------------------------------------------------------
def _decode_entry_bytes(h: int) -> int:
    # Per (row, index) entry: K fp32 row, S and P columns, two bool masks, three int64 ids,
    # gathered 576 data + 8 scale bytes, seven int32 scale words.
    return 4 * D + 8 * h + 2 + 24 + fp8_ds_mla.DATA_BYTES_PER_TOKEN + 8 + 28


def _prefill_entry_bytes(h: int) -> int:
    # K fp32 row, S and P columns, 2 bool masks, one int64 id, gathered bf16 row.
    return 4 * D + 8 * h + 2 + 8 + 2 * D


def _row_bytes(h: int) -> int:
    # q^T + acc (fp32 [h, 512]), seven fp32 [h] vectors and the per-segment sums.
    return 8 * D * h + 28 * h + 4 * GROUP_SEGMENTS * h


@dataclass(frozen=True)
class _Plan:
    rows: int  # query rows per chunk (decode: a multiple of s_q)
    cols: int  # index columns of the per-row K buffer (a multiple of SEGMENT, <= GROUP)
    nbytes: int


def _plan(num_rows: int, row_quantum: int, h: int, cols: int, entry_bytes: int,
          budget: int) -> _Plan:
    """Pick the rows per chunk so the arena stays within ``budget`` bytes (at least one row
    quantum). Only the chunking depends on the budget; the index pieces never do."""
    per_row = _row_bytes(h) + cols * entry_bytes
    avail = max(budget - _arena_bytes(0, h, cols, entry_bytes), 0)
    rows = max(row_quantum, (avail // per_row) // row_quantum * row_quantum)
    rows = min(rows, max(row_quantum, _round_up(num_rows, row_quantum)))
    return _Plan(rows, cols, _arena_bytes(rows, h, cols, entry_bytes))


def _arena_bytes(rows: int, h: int, cols: int, entry_bytes: int) -> int:
    # Each carved buffer (fewer than 32) is rounded up to the alignment.
    return rows * (_row_bytes(h) + cols * entry_bytes) + cols * 8 + 32 * _ALIGN


def decode_scratch_nbytes(
    batch: int, s_q: int, h_q: int, topk: int, extra_topk: int = 0,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> int:
    """Bytes of the uint8 ``scratch`` buffer that makes a decode call allocation-free.

    The plan depends only on the shapes, so a buffer sized for the largest batch serves every
    smaller one. A smaller buffer also works (smaller chunks, same bits) down to one batch
    entry; below that the call raises ``ValueError``.
    """
    return _plan(batch * s_q, s_q, h_q, _group_cols((topk, extra_topk)),
                 _decode_entry_bytes(h_q), budget_bytes).nbytes


def prefill_scratch_nbytes(
    s_q: int, h_q: int, topk: int, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> int:
    """Bytes of the uint8 ``scratch`` buffer that makes a prefill call allocation-free."""
    return _plan(s_q, 1, h_q, _group_cols((topk,)), _prefill_entry_bytes(h_q),
                 budget_bytes).nbytes


class _Arena:
    """Carves aligned typed views out of one uint8 buffer (no allocation)."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.off = (-buf.storage_offset()) % _ALIGN
        self.base_off = buf.storage_offset()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        start = self.off
        end = start + nbytes
        if end > self.buf.numel():
            raise ValueError(
                f"scratch: expected at least {end} bytes for this plan, got {self.buf.numel()}"
            )
        self.off = end + (-(self.base_off + end)) % _ALIGN
        return self.buf[start:end].view(dtype)


def _resolve_scratch(scratch: torch.Tensor | None, need: _Plan, device: torch.device,
                     replan) -> tuple[_Plan, torch.Tensor]:
    if scratch is None:
        return need, torch.empty(need.nbytes, dtype=torch.uint8, device=device)
    if scratch.dtype != torch.uint8 or scratch.dim() != 1 or scratch.device != device:
        raise ValueError(
            f"scratch: expected a 1-D torch.uint8 tensor on {device}, got shape "
            f"{list(scratch.shape)}, dtype {scratch.dtype}, device {scratch.device}"
        )
    if not scratch.is_contiguous():
        raise ValueError(f"scratch: expected a contiguous buffer, got stride {scratch.stride()}")
    if scratch.numel() >= need.nbytes:
        return need, scratch
    plan = replan(scratch.numel())
    if plan.nbytes > scratch.numel():
        raise ValueError(
            f"scratch: expected at least {plan.nbytes} bytes (one row quantum), got "
            f"{scratch.numel()}; size it with *_scratch_nbytes()"
        )
    return plan, scratch


# The views carved out of a caller's scratch buffer, per buffer and plan: carving ~25 views
# costs ~0.1 ms, 5% of a batch-1 decode call, and the layer passes the same buffer every
# step. Keyed by id() with a weak reference (a tensor cannot be a dict key); dropped with
# the buffer, so the cache never keeps a buffer's memory alive.
_CARVED: dict[int, tuple[weakref.ref, dict[tuple, Any]]] = {}
_CARVED_PER_BUFFER = 8
_VIEW_SETS = 64  # chunk sizes whose views a _Softmax keeps


def _carved(scratch: torch.Tensor | None, buf: torch.Tensor, key: tuple,
            carve: Callable[[], tuple]) -> tuple:
    if scratch is None or type(scratch) is not torch.Tensor:
        return carve()  # a fresh buffer for this call, or a tracing / fake tensor
    entry = _CARVED.get(id(scratch))
    if entry is None or entry[0]() is not scratch:
        entry = (weakref.ref(scratch), {})
        _CARVED[id(scratch)] = entry
        weakref.finalize(scratch, _CARVED.pop, id(scratch), None)
    # The same storage and offset (resize_ / set_ may have moved the buffer).
    key = (*key, buf.data_ptr(), buf.numel())
    views = entry[1].get(key)
    if views is None:
        if len(entry[1]) >= _CARVED_PER_BUFFER:
            entry[1].clear()
        views = entry[1][key] = carve()
    return views


# --------------------------------------------------------------------------------------------
# shared online-softmax core
# --------------------------------------------------------------------------------------------
class _Softmax:
    """Running-max softmax accumulator for ``R`` rows x ``h`` heads (all views of the arena).

    Per group: the caller fills K ``[r, cols, 512]`` (segment ``j`` = columns
    ``[128 j, 128 j + 128)``, finite everywhere, zero rows past the group's width) and the
    invalid mask ``[r, cols]``, then calls :meth:`update`. The views of a chunk size ``r``
    (and group size) are built once and kept: the object lives as long as the caller's
    scratch buffer (:func:`_carved`), and a decode step repeats the same sizes.
    """

    def __init__(self, arena: _Arena, rows: int, h: int, cols: int) -> None:
        self.qt = arena.take(rows * D * h, torch.float32)
        self.acc = arena.take(rows * h * D, torch.float32)
        self.m = arena.take(rows * h, torch.float32)
        self.mn = arena.take(rows * h, torch.float32)
        self.msafe = arena.take(rows * h, torch.float32)
        self.alpha = arena.take(rows * h, torch.float32)
        self.l = arena.take(rows * h, torch.float32)
        self.tmp = arena.take(rows * h, torch.float32)
        self.sums = arena.take(GROUP_SEGMENTS * rows * h, torch.float32)
        self.s = arena.take(rows * h * cols, torch.float32)
        self.p = arena.take(rows * h * cols, torch.float32)
        self.k = arena.take(rows * cols * D, torch.float32)
        self.inv = arena.take(rows * cols, torch.bool)
        self.h = h
        self.cols = cols
        self._rows: dict[int, tuple] = {}
        self._groups: dict[tuple[int, int], tuple] = {}

    def begin(self, r: int) -> None:
        self.r = r
        self.first = True
        self.one_thread = lone_gemm(r, self.acc.device)
        views = self._rows.get(r)
        if views is None:
            if len(self._rows) >= _VIEW_SETS:  # bounded: prefill chunk sizes vary
                self._rows.clear()
                self._groups.clear()
            h, cols = self.h, self.cols
            views = self._rows[r] = (
                self.m[: r * h].view(r, h), self.mn[: r * h].view(r, h),
                self.l[: r * h].view(r, h), self.acc[: r * h * D].view(r, h, D),
                # Scaled q, transposed ([r, 512, h] contiguous): S^T = K Q^T then multiplies
                # two non-transposed operands, which MKL runs ~1.4x faster than Q K^T at
                # N = 128.
                self.qt[: r * D * h].view(r, D, h),
                # A fixed row stride (cols) for K and the mask, whatever the group's width.
                self.k[: r * cols * D].view(r, cols, D), self.inv[: r * cols].view(r, cols),
                self.msafe[: r * h].view(r, h), self.alpha[: r * h].view(r, h),
                self.tmp[: r * h].view(r, h),
            )
        # The running max and the next one alternate between two buffers (no copy).
        (self.m_v, self.mn_v, self.l_v, self.acc_v, self.qt_v, self.k_v, self.inv_v,
         self.msafe_v, self.alpha_v, self.tmp_v) = views

    def pad_tail(self, w: int) -> tuple[int, bool]:
        """Columns ``[w, round_up(w, 128))``: invalid, with zero (finite) K rows. Returns
        the group's segment count and whether it has padding columns."""
        wp = _round_up(w, SEGMENT)
        if wp > w:
            self.inv_v[:, w:wp].fill_(True)
            self.k_v[:, w:wp].zero_()
        return wp // SEGMENT, wp > w

    def _group_views(self, nseg: int) -> tuple:
        r, h = self.r, self.h
        views = self._groups.get((r, nseg))
        if views is None:
            # Transposed scores S^T, segment-major: each segment's [r, 128, h] block is
            # contiguous, as a one-segment group's is, so every bmm / sum of update() has
            # one shape and layout (M = 128 entries, N = h, K = 512; then M = h, N = 512,
            # K = 128). The probabilities P get their own contiguous [r, h, 128] blocks: with
            # a transposed P operand MKL's AVX2 kernels round a one-matrix bmm (r = 1, more
            # threads than matrices) differently from the same matrix inside a larger batch.
            s = self.s[: nseg * r * SEGMENT * h].view(nseg, r, SEGMENT, h)
            p = self.p[: nseg * r * h * SEGMENT].view(nseg, r, h, SEGMENT)
            sums = self.sums[: nseg * r * h].view(nseg, r, h)
            views = self._groups[(r, nseg)] = (
                s, s.unbind(0), p, p.transpose(2, 3), p.unbind(0),
                tuple(self.k_v[:, j * SEGMENT : (j + 1) * SEGMENT] for j in range(nseg)),
                self.inv_v[:, : nseg * SEGMENT].view(r, nseg, SEGMENT, 1).transpose(0, 1),
                sums, sums.unbind(0), self.msafe_v.view(1, r, 1, h), self.alpha_v.unsqueeze(-1),
            )
        return views

    def update(self, nseg: int, any_invalid: bool) -> None:
        """Fold one filled group of ``nseg`` segments into the running state.

        K rows of invalid entries must be finite (any named slot's values, or zeros): their
        scores are set to -inf, so they get weight exactly 0.
        """
        with gemm_one_thread(self.one_thread):  # see ops/blas.py
            self._update(nseg, any_invalid)

    def _update(self, nseg: int, any_invalid: bool) -> None:
        (s, s_list, p, p_t, p_list, ks, mask, sums, sum_list, msafe4,
         alpha3) = self._group_views(nseg)
        for k_j, s_j in zip(ks, s_list):
            torch.bmm(k_j, self.qt_v, out=s_j)
        if any_invalid:
            s.masked_fill_(mask, -math.inf)
        mn, msafe, l_v, acc_v = self.mn_v, self.msafe_v, self.l_v, self.acc_v
        # A max is exact in any order. Per segment first: amax over dims (0, 2) at once
        # takes a slow generic reduction.
        if nseg == 1:
            torch.amax(s_list[0], 1, out=mn)
        else:
            torch.amax(s, 2, out=sums)
            torch.amax(sums, 0, out=mn)
        if not self.first:
            torch.maximum(mn, self.m_v, out=mn)
        # A row with no valid index so far keeps max -inf; exponentiate against 0 instead.
        torch.nan_to_num(mn, nan=0.0, neginf=0.0, out=msafe)
        torch.sub(s, msafe4, out=p_t)
        p.exp_()
        if self.first and nseg == 1:
            torch.sum(p_list[0], 2, out=l_v)
        else:
            torch.sum(p, 3, out=sums)
        if self.first:
            if nseg > 1:
                l_v.copy_(sum_list[0])
            torch.bmm(p_list[0], ks[0], out=acc_v)
        else:
            alpha = self.alpha_v
            torch.sub(self.m_v, msafe, out=alpha).exp_()
            torch.addcmul(sum_list[0], l_v, alpha, out=l_v)  # l * alpha + sum_0
            acc_v.mul_(alpha3).baddbmm_(p_list[0], ks[0])
        # The other segments fold in column order (one K = 128 GEMM each).
        for j in range(1, nseg):
            l_v.add_(sum_list[j])
            acc_v.baddbmm_(p_list[j], ks[j])
        self.m_v, self.mn_v = mn, self.m_v
        self.first = False

    def finish(self, attn_sink: torch.Tensor | None, lse: torch.Tensor | None) -> torch.Tensor:
        """Normalise ``acc`` in place (sink included); write lse (``+inf`` when empty)."""
        if self.first:  # no index column at all
            self.m_v.fill_(-math.inf)
            self.l_v.zero_()
            self.acc_v.zero_()
        msafe, denom = self.msafe_v, self.tmp_v
        torch.nan_to_num(self.m_v, nan=0.0, neginf=0.0, out=msafe)
        if attn_sink is not None:
            torch.sub(attn_sink.unsqueeze(0), msafe, out=denom).exp_()
            denom.add_(self.l_v)
        else:
            denom.copy_(self.l_v)
        # Empty rows have acc == 0 exactly; keep 0/denominator finite for them.
        denom.clamp_min_(_TINY)
        self.acc_v.div_(denom.unsqueeze(-1))
        if lse is not None:
            torch.log(self.l_v, out=lse)
            lse.add_(self.m_v)
            torch.nan_to_num(lse, nan=math.inf, neginf=math.inf, out=lse)
        return self.acc_v


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------
#: One index list of a decode call: ``(cache, layout, indices, lengths, width, name)``.
_IndexList = tuple[
    torch.Tensor, fp8_ds_mla.CacheLayout, torch.Tensor, torch.Tensor | None, int, str
]


def sparse_mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    softmax_scale: float,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    need_lse: bool = True,
    scratch: torch.Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA decode over ``fp8_ds_mla`` paged caches (FlashMLA ``flash_mla_with_kvcache``
    sparse semantics, MODEL1).

    Args:
        q: bf16 ``[b, s_q, h_q, 512]``, any strides.
        k_cache: uint8 ``[num_blocks, B, 584]`` or ``[num_blocks, B, 1, 584]`` fp8_ds_mla
            cache (block-split bytes, ``stride(0)`` may be padded; see
            :mod:`vllm_dsv4_backend.formats.fp8_ds_mla`).
        indices: int32 ``[b, s_q, topk]`` global slot ids ``blk*B + t``. **Only -1 is
            invalid**; any other id outside ``[0, num_blocks*B)`` within the used prefix
            raises ``ValueError`` (one vectorized check).
        topk_length: int32 ``[b]`` or None: only the first ``topk_length[i]`` indices of batch
            row ``i`` (all its ``s_q`` queries) are used.
        attn_sink: fp32 ``[h_q]`` or None: ``p_j = e^{s_j} / (sum_k e^{s_k} + e^{sink})``;
            ``+inf`` zeroes the row, ``-inf`` has no effect; the returned lse excludes it.
        softmax_scale: multiplies ``<q, k>`` (DeepSeek-V4: ``512 ** -0.5``).
        extra_k_cache / extra_indices / extra_topk_length: a second cache with its own block
            size, ``[b, s_q, extra_topk]`` indices and ``[b]`` lengths, attended under the same
            softmax (DeepSeek-V4: SWA window in ``k_cache``, compressed entries here).
        out: optional bf16 ``[b, s_q, h_q, 512]`` written in place (e.g. a workspace view).
        lse_out: optional fp32 ``[b, h_q, s_q]`` written in place.
        need_lse: False returns None for the lse.
        scratch: optional uint8 1-D arena for the intermediates
            (:func:`decode_scratch_nbytes`); with ``out``, ``lse_out`` and ``scratch`` given
            the call allocates nothing.
        budget_bytes: the fp32 working set's bound without ``scratch`` (sets rows per chunk).

    Returns:
        ``(out, lse)``: out bf16 ``[b, s_q, h_q, 512]`` (V = the whole 512-d row), lse fp32
        ``[b, h_q, s_q]`` natural log (None when ``need_lse`` is False). A row with no valid
        index gives ``out = 0`` and ``lse = +inf``. A row's bits do not depend on the other
        rows, on -1 padding past its entries, nor on the scratch size.

    Raises ``ValueError`` for a bad argument (named, with expected vs received shape, dtype
    and device).
    """
    dims = check_decode_args(
        q, k_cache, indices, topk_length, attn_sink, softmax_scale, extra_k_cache,
        extra_indices, extra_topk_length, out, lse_out,
    )
    b, s_q, h = dims.batch, dims.s_q, dims.h_q
    n1, n2 = dims.topk, dims.extra_topk
    dev = q.device
    if out is None:
        out = torch.empty(b, s_q, h, D, dtype=torch.bfloat16, device=dev)
    if lse_out is None and need_lse:
        lse_out = torch.empty(b, h, s_q, dtype=torch.float32, device=dev)
    if b * s_q == 0:
        return out, lse_out if need_lse else None
    parts: list[_IndexList] = [(k_cache, dims.layout, indices, topk_length, n1, "indices")]
    if n2 > 0:
        parts.append((extra_k_cache, dims.extra_layout, extra_indices, extra_topk_length, n2,
                      "extra_indices"))
    if b * s_q * (n1 + n2) >= DEDUP_MIN_ENTRIES:
        deduped = _decode_deduplicated(
            q, parts, attn_sink, dims, out, lse_out if need_lse else None, budget_bytes
        )
        if deduped:
            return out, lse_out if need_lse else None
    eb = _decode_entry_bytes(h)
    cols = _group_cols((n1, n2))
    plan = _plan(b * s_q, s_q, h, cols, eb, budget_bytes)
    plan, buf = _resolve_scratch(
        scratch, plan, dev, lambda nbytes: _plan(b * s_q, s_q, h, cols, eb, nbytes)
    )
    rows_max = plan.rows

    def carve() -> tuple:
        arena = _Arena(buf)
        sm = _Softmax(arena, rows_max, h, cols)
        n_ent = rows_max * cols
        g = {
            "rows_i64": arena.take(n_ent, torch.int64),
            "tmp_i64": arena.take(n_ent, torch.int64),
            "data_u8": arena.take(n_ent * fp8_ds_mla.DATA_BYTES_PER_TOKEN, torch.uint8).view(
                n_ent, fp8_ds_mla.DATA_BYTES_PER_TOKEN
            ),
            "scale_u8": arena.take(n_ent * 8, torch.uint8).view(n_ent, 8),
            "scale_i32": arena.take(n_ent * fp8_ds_mla.NUM_TILES, torch.int32),
            "flag_i32": arena.take(1, torch.int32).view(()),
        }
        return (sm, g, arena.take(n_ent, torch.int64), arena.take(n_ent, torch.bool),
                arena.take(2, torch.int64), arena.take(cols, torch.int32),
                arena.take(rows_max * h, torch.float32) if need_lse else None)

    sm, g, ids_buf, tmpb_buf, minmax, pos, lse_chunk = _carved(
        scratch, buf, ("decode", plan, h, need_lse), carve)

    groups = _groups([(0, n1), (n1, n2)][: len(parts)])
    views = [p[1].gather_row_views(p[0]) for p in parts]
    bpc = rows_max // s_q  # batch entries per chunk
    for b0 in range(0, b, bpc):
        b1 = min(b, b0 + bpc)
        nb = b1 - b0
        r = nb * s_q
        sm.begin(r)
        sm.qt_v.view(nb, s_q, D, h).copy_(q[b0:b1].transpose(-1, -2))
        sm.qt_v.mul_(dims.softmax_scale)
        for gi, (p, c0, w) in enumerate(groups):
            cache, layout, idx, lens, _, name = parts[p]
            p0 = c0 - (0 if p == 0 else n1)  # the group's first column within its list
            p1 = p0 + w
            idx_v = idx[b0:b1, :, p0:p1]
            inv_v = sm.inv_v.view(nb, s_q, cols)[:, :, :w]
            k_part = sm.k_v.view(nb, s_q, cols, D)[:, :, :w]
            ne = r * w
            ids = ids_buf[:ne].view(nb, s_q, w)
            torch.eq(idx_v, -1, out=inv_v)
            if lens is not None:
                tmpb = tmpb_buf[:ne].view(nb, s_q, w)
                torch.arange(p0, p1, dtype=torch.int32, device=dev, out=pos[:w])
                torch.ge(pos[:w].expand(nb, s_q, w), lens[b0:b1].view(nb, 1, 1), out=tmpb)
                inv_v.logical_or_(tmpb)
            # ids = used slot ids, -1 where invalid; its min/max give the range check (only
            # -1 is invalid: any other id outside the cache is an error) and, when a valid
            # id exists, a named slot to read in place of the invalid entries, so unnamed
            # (possibly NaN) slots are never touched; the stand-in rows are zeroed after
            # the gather (a named slot may still hold another row's non-finite entry).
            ids.copy_(idx_v)
            ids.masked_fill_(inv_v, -1)
            torch.amin(ids.view(-1), 0, out=minmax[0])
            torch.amax(ids.view(-1), 0, out=minmax[1])
            lo, hi = minmax.tolist()
            if lo < -1 or hi >= layout.num_slots:
                vals = ids[(ids < -1) | (ids >= layout.num_slots)]
                raise ValueError(
                    f"{name}: expected slot ids in [-1, {layout.num_slots}) (num_blocks * "
                    f"block_size; only -1 is invalid), got out-of-range value(s) "
                    f"{vals[:4].tolist()}"
                )
            if hi < 0:
                if gi > 0:
                    continue  # no valid entry in the chunk: folding it is an exact no-op
                k_part.zero_()  # the first group always runs (it starts the state)
            else:
                if lo == -1:
                    ids.masked_fill_(inv_v, hi)
                fp8_ds_mla.gather_dequant_into(k_part, cache, layout, ids, None, views=views[p],
                                               **g)
                if lo == -1:
                    # The stand-in slot is another row's: its score is masked, but
                    # 0 * NaN is NaN in p @ V, so one request's non-finite entry would
                    # poison the rows batched with it (vLLM's C++ kernel keeps them apart).
                    k_part.masked_fill_(inv_v.unsqueeze(-1), 0.0)
            nseg, padded = sm.pad_tail(w)
            sm.update(nseg, lo == -1 or padded)
        acc = sm.finish(attn_sink, lse_chunk[: r * h].view(r, h) if need_lse else None)
        out[b0:b1].copy_(acc.view(nb, s_q, h, D))
        if need_lse:
            lse_out[b0:b1].copy_(lse_chunk[: r * h].view(nb, s_q, h).transpose(1, 2))
    return out, lse_out if need_lse else None


DEDUP_MIN_ENTRIES = 1 << 16
"""Decode calls naming at least this many (row, index) entries try the deduplicated path.

Such calls are prefills in decode form (a prompt's rows); they allocate their slot table
even when ``scratch`` is given. Decode steps stay far below this and allocate nothing."""


def _decode_deduplicated(
    q: torch.Tensor,
    parts: list[_IndexList],
    attn_sink: torch.Tensor | None,
    dims: DecodeDims,
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    budget_bytes: int,
) -> bool:
    """Prefill-shaped decode calls (many rows over overlapping slots): dequantize each
    distinct slot once into a bf16 table, then attend with the prefill path over it.

    A prompt's rows share their window and compressed entries, so ``T x topk`` entries
    name only about ``T + T/ratio`` slots; the fp8 decode then runs once per slot instead of
    once per entry. Dequantized values are exact in bf16 (e4m3 times a power of two), and the
    prefill core runs the same groups (one per list, from each list's column 0), so the
    result equals the entry-wise path bit for bit. Returns False (nothing written) when the
    call does not repeat slots enough to pay for the table.
    """
    b, s_q, h = dims.batch, dims.s_q, dims.h_q
    rows = b * s_q
    tables, local = [], []
    offset = 0
    for cache, layout, idx, lens, n, _ in parts:
        ids = idx.reshape(b, s_q, n).to(torch.int64)
        invalid = ids == -1
        if lens is not None:
            pos = torch.arange(n, device=ids.device).view(1, 1, n)
            invalid |= pos >= lens.view(b, 1, 1)
        ids = ids.masked_fill(invalid, -1)
        if bool(((ids < -1) | (ids >= layout.num_slots)).any()):
            return False  # the entry-wise path raises the precise error
        uniq, inv = torch.unique(ids, return_inverse=True)
        if uniq.numel() * 4 > ids.numel():
            return False
        # uniq may start with -1, which gathers a zero row (never referenced below).
        table = fp8_ds_mla.dequantize_and_gather(cache, uniq.to(torch.int32))
        loc = (inv + offset).masked_fill_(invalid, -1)
        tables.append(table)
        local.append(loc.view(rows, n))
        offset += table.shape[0]
    kv = torch.cat(tables).view(-1, 1, D)
    idx_all = torch.cat(local, dim=1).to(torch.int32).view(rows, 1, -1)
    pdims = PrefillDims(s_q=rows, h_q=h, s_kv=kv.shape[0], topk=idx_all.shape[-1],
                        sm_scale=dims.softmax_scale)
    flat_out = out.view(rows, h, D) if out.is_contiguous() else None
    res, _, lse = _prefill(
        q.reshape(rows, h, D), kv, idx_all, pdims, attn_sink, None,
        [(0, dims.topk), (dims.topk, idx_all.shape[-1] - dims.topk)][: len(parts)],
        out=flat_out, max_logits_out=None, lse_out=None, scratch=None,
        budget_bytes=budget_bytes,
    )
    if flat_out is None:
        out.copy_(res.view(b, s_q, h, D))
    if lse_out is not None:
        lse_out.copy_(lse.view(b, s_q, h).transpose(1, 2))
    return True


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------
def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    max_logits_out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill over a bf16 KV buffer (FlashMLA ``flash_mla_sparse_fwd`` semantics).

    Args:
        q: bf16 ``[s_q, h_q, 512]``, any strides (no batch axis: concatenate sequences,
            offset indices).
        kv: bf16 ``[s_kv, 1, 512]`` (dequantized; e.g. gathered from the fp8_ds_mla caches).
        indices: int32 ``[s_q, 1, topk]``; entries ``< 0`` or ``>= s_kv`` are invalid.
        sm_scale: multiplies ``<q, k>``.
        attn_sink: fp32 ``[h_q]`` or None (same conventions as decode).
        topk_length: int32 ``[s_q]`` or None: only the first n indices of each row are used.
        out: optional bf16 ``[s_q, h_q, 512]``; max_logits_out / lse_out: optional fp32
            ``[s_q, h_q]``; all written in place.
        scratch: optional uint8 1-D arena (:func:`prefill_scratch_nbytes`).

    Returns:
        ``(out, max_logits, lse)``: max_logits and lse fp32 ``[s_q, h_q]`` in natural units
        (max over ``sm_scale * <q, k>``); a row with no valid index gives ``out = 0``,
        ``max_logits = -inf``, ``lse = +inf``. A row's bits do not depend on the other rows,
        on invalid padding past its entries, nor on the scratch size. Raises ``ValueError``
        for a bad argument.
    """
    dims = check_prefill_args(
        q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits_out, lse_out
    )
    return _prefill(q, kv, indices, dims, attn_sink, topk_length, [(0, dims.topk)], out=out,
                    max_logits_out=max_logits_out, lse_out=lse_out, scratch=scratch,
                    budget_bytes=budget_bytes)


def _prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    dims: PrefillDims,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    parts: list[tuple[int, int]],
    *,
    out: torch.Tensor | None,
    max_logits_out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    scratch: torch.Tensor | None,
    budget_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sparse_mla_prefill` with the index columns split into ``parts`` (each
    ``(first column, width)``, its own group origin; the deduplicated decode passes its two
    lists). ``topk_length`` counts combined columns."""
    s_q, h, s_kv = dims.s_q, dims.h_q, dims.s_kv
    dev = q.device
    if out is None:
        out = torch.empty(s_q, h, D, dtype=torch.bfloat16, device=dev)
    if max_logits_out is None:
        max_logits_out = torch.empty(s_q, h, dtype=torch.float32, device=dev)
    if lse_out is None:
        lse_out = torch.empty(s_q, h, dtype=torch.float32, device=dev)
    if s_q == 0:
        return out, max_logits_out, lse_out
    eb = _prefill_entry_bytes(h)
    cols = _group_cols(tuple(n for _, n in parts))
    plan = _plan(s_q, 1, h, cols, eb, budget_bytes)
    plan, buf = _resolve_scratch(scratch, plan, dev,
                                 lambda nb: _plan(s_q, 1, h, cols, eb, nb))
    rows_max = plan.rows

    def carve() -> tuple:
        arena = _Arena(buf)
        n_ent = rows_max * cols
        return (_Softmax(arena, rows_max, h, cols), arena.take(n_ent, torch.int64),
                arena.take(n_ent * D, torch.bfloat16).view(n_ent, D),
                arena.take(n_ent, torch.bool), arena.take(cols, torch.int32),
                arena.take(2, torch.int64))

    sm, ids, rows_bf16, tmpb_buf, pos, minmax = _carved(
        scratch, buf, ("prefill", plan, h), carve)
    kv2d = kv[:, 0, :]
    groups = _groups(parts)
    for r0 in range(0, s_q, rows_max):
        r1 = min(s_q, r0 + rows_max)
        r = r1 - r0
        sm.begin(r)
        sm.qt_v.copy_(q[r0:r1].transpose(1, 2))
        sm.qt_v.mul_(dims.sm_scale)
        for gi, (_, c0, w) in enumerate(groups):
            c1 = c0 + w
            inv = sm.inv_v[:, :w]
            k_g = sm.k_v[:, :w]
            idx_v = indices[r0:r1, 0, c0:c1]
            tmpb = tmpb_buf[: r * w].view(r, w)
            torch.lt(idx_v, 0, out=inv)
            torch.ge(idx_v, s_kv, out=tmpb)
            inv.logical_or_(tmpb)
            if topk_length is not None:
                torch.arange(c0, c1, dtype=torch.int32, device=dev, out=pos[:w])
                torch.ge(pos[:w].expand(r, w), topk_length[r0:r1].view(r, 1), out=tmpb)
                inv.logical_or_(tmpb)
            ids_v = ids[: r * w].view(r, w)
            # Invalid entries read a named row instead (never an unnamed, possibly NaN one).
            ids_v.copy_(idx_v)
            ids_v.masked_fill_(inv, -1)
            torch.amin(ids[: r * w], 0, out=minmax[0])
            torch.amax(ids[: r * w], 0, out=minmax[1])
            lo, hi = minmax.tolist()
            if hi < 0:
                if gi > 0:
                    continue  # no valid entry in the chunk: folding it is an exact no-op
                k_g.zero_()
            else:
                if lo < 0:
                    ids_v.masked_fill_(inv, hi)
                torch.index_select(kv2d, 0, ids[: r * w], out=rows_bf16[: r * w])
                # bf16 -> fp32 as a 16-bit shift of the bit pattern.
                k_i = k_g.view(torch.int32)
                k_i.copy_(rows_bf16[: r * w].view(r, w, D).view(torch.int16))
                k_i.bitwise_left_shift_(16)
                if lo < 0:
                    # As in decode: a masked stand-in row must not carry NaN into p @ V.
                    k_g.masked_fill_(inv.unsqueeze(-1), 0.0)
            nseg, padded = sm.pad_tail(w)
            sm.update(nseg, lo < 0 or padded)
        acc = sm.finish(attn_sink, lse_out[r0:r1])
        max_logits_out[r0:r1].copy_(sm.m_v)
        out[r0:r1].copy_(acc)
    return out, max_logits_out, lse_out
