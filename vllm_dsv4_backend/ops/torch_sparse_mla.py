# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA in vectorized PyTorch (torch only): the production CPU path of the plugin
(``VLLM_DSV4_KERNEL=torch``, and the torch fallback of vLLM's C++ sparse-MLA op on CPUs
without AVX512-BF16), which runs anywhere. (Formerly ``ops/reference.py``.)

Semantics are FlashMLA's (``flash_mla_with_kvcache`` sparse decode over the ``fp8_ds_mla``
cache, ``flash_mla_sparse_fwd`` prefill over a bf16 KV buffer), computed in fp32:

- scores ``s_j = softmax_scale * <q, k_j>`` over the valid indices of a row, ``K = V`` = the
  whole 512-d row (448 dequantized NoPE + 64 RoPE);
- ``out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink})`` (no sink: drop the last term);
  ``sink = +inf`` zeroes the row, ``-inf`` has no effect;
- ``lse = log sum_j e^{s_j}`` (natural log, the sink excluded); a row without a valid index
  gives ``out = 0`` and ``lse = +inf`` (prefill also ``max_logits = -inf``).

Implementation: query rows are processed in chunks and the index axis in segments with an
online (running max) softmax, so the fp32 working set stays under ``budget_bytes``
(32 MiB by default) for any top-k. Only the named slots are gathered and dequantized (a
fused gather + bit-level e4m3 decode, ``fp8_ds_mla.gather_dequant_into``); an invalid
entry reads a slot that the same call names validly (its score is then set to -inf, so its
weight is exactly 0), so unnamed cache slots, which may hold NaN, are never touched.
Matmuls are fp32 ``bmm`` (bf16 ``bmm`` is ~20x slower on CPUs without AVX512-BF16), which
also keeps the result within FlashMLA's test tolerances of a float64 oracle. Every
intermediate lives in one scratch byte buffer; with ``out``, ``lse_out`` and ``scratch``
supplied a call allocates nothing (see :func:`decode_scratch_nbytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.ops.checks import DecodeDims, PrefillDims

__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "decode_scratch_nbytes",
    "prefill_scratch_nbytes",
    "sparse_mla_decode_torch",
    "sparse_mla_prefill_torch",
]

D = fp8_ds_mla.HEAD_DIM
DEFAULT_BUDGET_BYTES = 32 << 20
_ALIGN = 64
_SEG_QUANTUM = 64
_TINY = 1e-30


# --------------------------------------------------------------------------------------------
# scratch planning
# --------------------------------------------------------------------------------------------
def _decode_entry_bytes(h: int) -> int:
    # Per (row, index) entry: K fp32 row, S column, two bool masks, three int64 ids, gathered
    # 576 data + 8 scale bytes, seven int32 scale words.
    return 4 * D + 4 * h + 2 + 24 + fp8_ds_mla.DATA_BYTES_PER_TOKEN + 8 + 28


def _prefill_entry_bytes(h: int) -> int:
    # K fp32 row, S column, 2 bool masks, one int64 id, gathered bf16 row.
    return 4 * D + 4 * h + 2 + 8 + 2 * D


def _row_bytes(h: int) -> int:
    # qf + acc (fp32 [h, 512]) and seven fp32 [h] vectors.
    return 8 * D * h + 28 * h


@dataclass(frozen=True)
class _Plan:
    rows: int  # query rows per chunk (decode: a multiple of s_q)
    seg: int  # index columns per segment
    nbytes: int


def _plan(num_rows: int, row_quantum: int, h: int, width: int, entry_bytes: int,
          budget: int) -> _Plan:
    """Pick (rows per chunk, segment width) so the arena stays within ``budget`` bytes."""
    row_fixed = _row_bytes(h)
    width = max(width, 1)
    seg = width

    def avail(seg: int) -> int:  # budget left for the per-row buffers
        return budget - _arena_bytes(0, h, seg, entry_bytes)

    # Shrink the segment until one row quantum fits the budget (never below 64 columns).
    while seg > _SEG_QUANTUM and row_quantum * (row_fixed + seg * entry_bytes) > avail(seg):
        seg = max(_SEG_QUANTUM, (seg // 2 + _SEG_QUANTUM - 1) // _SEG_QUANTUM * _SEG_QUANTUM)
    per_row = row_fixed + seg * entry_bytes
    rows = max(row_quantum, (max(avail(seg), 0) // per_row) // row_quantum * row_quantum)
    rows = min(rows, max(row_quantum, -(-num_rows // row_quantum) * row_quantum))
    return _Plan(rows, seg, _arena_bytes(rows, h, seg, entry_bytes))


def _arena_bytes(rows: int, h: int, seg: int, entry_bytes: int) -> int:
    # Each carved buffer (fewer than 32) is rounded up to the alignment.
    return rows * (_row_bytes(h) + seg * entry_bytes) + seg * 8 + 32 * _ALIGN


def decode_scratch_nbytes(
    batch: int, s_q: int, h_q: int, topk: int, extra_topk: int = 0,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> int:
    """Bytes of the uint8 ``scratch`` buffer that makes a decode call allocation-free.

    The plan depends only on the shapes, so a buffer sized for the largest batch serves every
    smaller one. A smaller buffer also works (smaller chunks) down to one batch entry and a
    64-wide segment; below that the call raises ``ValueError``.
    """
    return _plan(batch * s_q, s_q, h_q, topk + extra_topk, _decode_entry_bytes(h_q),
                 budget_bytes).nbytes


def prefill_scratch_nbytes(
    s_q: int, h_q: int, topk: int, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> int:
    """Bytes of the uint8 ``scratch`` buffer that makes a prefill call allocation-free."""
    return _plan(s_q, 1, h_q, topk, _prefill_entry_bytes(h_q), budget_bytes).nbytes


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
            f"scratch: expected at least {plan.nbytes} bytes (one row quantum, 64-wide "
            f"segments), got {scratch.numel()}; size it with *_scratch_nbytes()"
        )
    return plan, scratch


# --------------------------------------------------------------------------------------------
# shared online-softmax core
# --------------------------------------------------------------------------------------------
class _Softmax:
    """Running-max softmax accumulator for ``R`` rows x ``h`` heads (all views of the arena)."""

    def __init__(self, arena: _Arena, rows: int, h: int, seg: int) -> None:
        self.qf = arena.take(rows * h * D, torch.float32)
        self.acc = arena.take(rows * h * D, torch.float32)
        self.m = arena.take(rows * h, torch.float32)
        self.mn = arena.take(rows * h, torch.float32)
        self.msafe = arena.take(rows * h, torch.float32)
        self.alpha = arena.take(rows * h, torch.float32)
        self.l = arena.take(rows * h, torch.float32)
        self.tmp = arena.take(rows * h, torch.float32)
        self.s = arena.take(rows * h * seg, torch.float32)
        self.k = arena.take(rows * seg * D, torch.float32)
        self.inv = arena.take(rows * seg, torch.bool)
        self.h = h

    def begin(self, r: int) -> None:
        self.r = r
        h = self.h
        self.first = True
        self.m_v = self.m[: r * h].view(r, h)
        self.l_v = self.l[: r * h].view(r, h)
        self.acc_v = self.acc[: r * h * D].view(r, h, D)
        self.q_v = self.qf[: r * h * D].view(r, h, D)

    def segment_views(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K ``[r, w, 512]`` and bool invalid ``[r, w]`` to fill for one segment."""
        r = self.r
        return self.k[: r * w * D].view(r, w, D), self.inv[: r * w].view(r, w)

    def update(self, w: int, any_invalid: bool) -> None:
        """Fold one filled segment into the running state.

        K rows of invalid entries must be finite (any named slot's values, or zeros): their
        scores are set to -inf, so they get weight exactly 0.
        """
        r, h = self.r, self.h
        k, inv = self.segment_views(w)
        s = self.s[: r * h * w].view(r, h, w)
        torch.bmm(self.q_v, k.transpose(1, 2), out=s)
        if any_invalid:
            s.masked_fill_(inv.unsqueeze(1), -math.inf)
        mn = self.mn[: r * h].view(r, h)
        msafe = self.msafe[: r * h].view(r, h)
        tmp = self.tmp[: r * h].view(r, h)
        torch.amax(s, -1, out=mn)
        if not self.first:
            torch.maximum(mn, self.m_v, out=mn)
        # A row with no valid index so far keeps max -inf; exponentiate against 0 instead.
        torch.nan_to_num(mn, nan=0.0, neginf=0.0, out=msafe)
        s.sub_(msafe.unsqueeze(-1)).exp_()
        if self.first:
            torch.sum(s, -1, out=self.l_v)
            torch.bmm(s, k, out=self.acc_v)
        else:
            alpha = self.alpha[: r * h].view(r, h)
            torch.sub(self.m_v, msafe, out=alpha).exp_()
            torch.sum(s, -1, out=tmp)
            self.l_v.mul_(alpha).add_(tmp)
            self.acc_v.mul_(alpha.unsqueeze(-1)).baddbmm_(s, k)
        self.m_v.copy_(mn)
        self.first = False

    def finish(self, attn_sink: torch.Tensor | None, lse: torch.Tensor | None) -> torch.Tensor:
        """Normalise ``acc`` in place (sink included); write lse (``+inf`` when empty)."""
        r, h = self.r, self.h
        if self.first:  # no index column at all
            self.m_v.fill_(-math.inf)
            self.l_v.zero_()
            self.acc_v.zero_()
        msafe = self.msafe[: r * h].view(r, h)
        denom = self.tmp[: r * h].view(r, h)
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
def sparse_mla_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    dims: DecodeDims,
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
    """Torch sparse decode over ``fp8_ds_mla`` caches (arguments already validated).

    Args:
        q: bf16 ``[b, s_q, h_q, 512]``, any strides.
        k_cache / extra_k_cache: fp8_ds_mla uint8 caches (``dims.layout`` / ``extra_layout``).
        indices / extra_indices: int32 ``[b, s_q, topk]`` global slot ids, -1 invalid; any
            other value outside ``[0, num_slots)`` within the used prefix raises ValueError.
        topk_length / extra_topk_length: int32 ``[b]`` or None (use only the first n).
        attn_sink: fp32 ``[h_q]`` or None.
        dims: from :func:`~vllm_dsv4_backend.ops.checks.check_decode_args`.
        out: bf16 ``[b, s_q, h_q, 512]`` written in place (allocated when None).
        lse_out: fp32 ``[b, h_q, s_q]`` written in place (allocated when None and need_lse).
        scratch: uint8 1-D arena (see :func:`decode_scratch_nbytes`); allocated when None.

    Returns:
        ``(out, lse)``; ``lse`` is None when ``need_lse`` is False.
    """
    b, s_q, h = dims.batch, dims.s_q, dims.h_q
    n1, n2 = dims.topk, dims.extra_topk
    dev = q.device
    if out is None:
        out = torch.empty(b, s_q, h, D, dtype=torch.bfloat16, device=dev)
    if lse_out is None and need_lse:
        lse_out = torch.empty(b, h, s_q, dtype=torch.float32, device=dev)
    if b * s_q == 0:
        return out, lse_out if need_lse else None
    if b * s_q * (n1 + n2) >= DEDUP_MIN_ENTRIES:
        deduped = _decode_deduplicated(
            q, k_cache, indices, topk_length, attn_sink, dims, extra_k_cache, extra_indices,
            extra_topk_length, out, lse_out if need_lse else None, budget_bytes,
        )
        if deduped:
            return out, lse_out if need_lse else None
    eb = _decode_entry_bytes(h)
    plan = _plan(b * s_q, s_q, h, n1 + n2, eb, budget_bytes)
    plan, buf = _resolve_scratch(
        scratch, plan, dev, lambda nbytes: _plan(b * s_q, s_q, h, n1 + n2, eb, nbytes)
    )
    arena = _Arena(buf)
    rows_max, seg = plan.rows, plan.seg
    sm = _Softmax(arena, rows_max, h, seg)
    n_ent = rows_max * seg
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
    ids_buf = arena.take(n_ent, torch.int64)
    tmpb_buf = arena.take(n_ent, torch.bool)
    minmax = arena.take(2, torch.int64)
    pos = arena.take(seg, torch.int32)
    lse_chunk = arena.take(rows_max * h, torch.float32) if need_lse else None

    # (cache, layout, indices, lengths, first combined column, width, name)
    parts = [(k_cache, dims.layout, indices, topk_length, 0, n1, "indices")]
    if extra_k_cache is not None and n2 > 0:
        parts.append((extra_k_cache, dims.extra_layout, extra_indices, extra_topk_length, n1, n2,
                      "extra_indices"))
    views = [p[1].gather_row_views(p[0]) for p in parts]
    bpc = rows_max // s_q  # batch entries per chunk
    total = n1 + n2
    for b0 in range(0, b, bpc):
        b1 = min(b, b0 + bpc)
        nb = b1 - b0
        r = nb * s_q
        sm.begin(r)
        sm.q_v.view(nb, s_q, h, D).copy_(q[b0:b1])
        sm.q_v.mul_(dims.softmax_scale)
        for c0 in range(0, total, seg):
            c1 = min(total, c0 + seg)
            w = c1 - c0
            k_seg, inv_seg = sm.segment_views(w)
            col = 0
            any_invalid = False
            for (cache, layout, idx, lens, base, n, name), vw in zip(parts, views):
                p0, p1 = max(c0, base) - base, min(c1, base + n) - base
                if p1 <= p0:
                    continue
                pw = p1 - p0
                idx_v = idx[b0:b1, :, p0:p1]
                inv_v = inv_seg.view(nb, s_q, w)[:, :, col : col + pw]
                k_part = k_seg.view(nb, s_q, w, D)[:, :, col : col + pw]
                ne = r * pw
                ids = ids_buf[:ne].view(nb, s_q, pw)
                torch.eq(idx_v, -1, out=inv_v)
                if lens is not None:
                    tmpb = tmpb_buf[:ne].view(nb, s_q, pw)
                    torch.arange(p0, p1, dtype=torch.int32, device=dev, out=pos[:pw])
                    torch.ge(pos[:pw].expand(nb, s_q, pw), lens[b0:b1].view(nb, 1, 1), out=tmpb)
                    inv_v.logical_or_(tmpb)
                # ids = used slot ids, -1 where invalid; its min/max give the range check (only
                # -1 is invalid: any other id outside the cache is an error) and, when a valid
                # id exists, a named slot to read in place of the invalid entries, so unnamed
                # (possibly NaN) slots are never touched and no K row needs zeroing.
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
                if lo == -1:
                    any_invalid = True
                if hi < 0:
                    k_part.zero_()
                else:
                    if lo == -1:
                        ids.masked_fill_(inv_v, hi)
                    fp8_ds_mla.gather_dequant_into(
                        k_part, cache, layout, ids, None, views=vw, **g
                    )
                col += pw
            sm.update(w, any_invalid)
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
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    dims: DecodeDims,
    extra_k_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_topk_length: torch.Tensor | None,
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    budget_bytes: int,
) -> bool:
    """Prefill-shaped decode calls (many rows over overlapping slots): dequantize each
    distinct slot once into a bf16 table, then attend with the prefill path over it.

    A prompt's rows share their window and compressed entries, so ``T x topk`` entries
    name only about ``T + T/ratio`` slots; the fp8 decode then runs once per slot instead of
    once per entry. Dequantized values are exact in bf16 (e4m3 times a power of two), so the
    result equals the entry-wise path up to summation order. Returns False (nothing written)
    when the call does not repeat slots enough to pay for the table.
    """
    b, s_q, h = dims.batch, dims.s_q, dims.h_q
    rows = b * s_q
    tables, local = [], []
    offset = 0
    parts = [(k_cache, dims.layout, indices, topk_length, dims.topk)]
    if extra_k_cache is not None and dims.extra_topk > 0:
        parts.append((extra_k_cache, dims.extra_layout, extra_indices, extra_topk_length,
                      dims.extra_topk))
    for cache, layout, idx, lens, n in parts:
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
    res, _, lse = sparse_mla_prefill_torch(
        q.reshape(rows, h, D), kv, idx_all, pdims, attn_sink,
        out=flat_out, budget_bytes=budget_bytes,
    )
    if flat_out is None:
        out.copy_(res.view(b, s_q, h, D))
    if lse_out is not None:
        lse_out.copy_(lse.view(b, s_q, h).transpose(1, 2))
    return True


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------
def sparse_mla_prefill_torch(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    dims: PrefillDims,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    max_logits_out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch sparse prefill over a bf16 KV buffer (arguments already validated).

    Args:
        q: bf16 ``[s_q, h_q, 512]``, any strides.
        kv: bf16 ``[s_kv, 1, 512]``.
        indices: int32 ``[s_q, 1, topk]``; entries ``< 0`` or ``>= s_kv`` are invalid.
        dims: from :func:`~vllm_dsv4_backend.ops.checks.check_prefill_args`.
        attn_sink: fp32 ``[h_q]`` or None. topk_length: int32 ``[s_q]`` or None.
        out: bf16 ``[s_q, h_q, 512]``; max_logits_out / lse_out: fp32 ``[s_q, h_q]``.
        scratch: uint8 1-D arena (see :func:`prefill_scratch_nbytes`).

    Returns:
        ``(out, max_logits, lse)``: natural units; an empty row has ``max_logits = -inf``,
        ``lse = +inf`` and ``out = 0``.
    """
    s_q, h, s_kv, topk = dims.s_q, dims.h_q, dims.s_kv, dims.topk
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
    plan = _plan(s_q, 1, h, topk, eb, budget_bytes)
    plan, buf = _resolve_scratch(scratch, plan, dev, lambda nb: _plan(s_q, 1, h, topk, eb, nb))
    arena = _Arena(buf)
    rows_max, seg = plan.rows, plan.seg
    sm = _Softmax(arena, rows_max, h, seg)
    n_ent = rows_max * seg
    ids = arena.take(n_ent, torch.int64)
    rows_bf16 = arena.take(n_ent * D, torch.bfloat16).view(n_ent, D)
    tmpb_buf = arena.take(n_ent, torch.bool)
    pos = arena.take(seg, torch.int32)
    minmax = arena.take(2, torch.int64)
    kv2d = kv[:, 0, :]
    for r0 in range(0, s_q, rows_max):
        r1 = min(s_q, r0 + rows_max)
        r = r1 - r0
        sm.begin(r)
        sm.q_v.copy_(q[r0:r1])
        sm.q_v.mul_(dims.sm_scale)
        for c0 in range(0, topk, seg):
            c1 = min(topk, c0 + seg)
            w = c1 - c0
            k_seg, inv = sm.segment_views(w)
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
                k_seg.zero_()
            else:
                if lo < 0:
                    ids_v.masked_fill_(inv, hi)
                torch.index_select(kv2d, 0, ids[: r * w], out=rows_bf16[: r * w])
                # bf16 -> fp32 as a 16-bit shift of the bit pattern.
                k_i = k_seg.view(torch.int32)
                k_i.copy_(rows_bf16[: r * w].view(r, w, D).view(torch.int16))
                k_i.bitwise_left_shift_(16)
            sm.update(w, lo < 0)
        acc = sm.finish(attn_sink, lse_out[r0:r1])
        max_logits_out[r0:r1].copy_(sm.m_v)
        out[r0:r1].copy_(acc)
    return out, max_logits_out, lse_out
