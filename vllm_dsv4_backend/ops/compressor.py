# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-V4 compressor cache store in vectorized PyTorch (torch only, no vLLM).

A port of vLLM 0.32's CPU compressor ops (``csrc/cpu/sgl-kernels/compressor.cpp``:
``save_partial_states_cpu``, ``compress_norm_rope_store_cpu``,
``compress_norm_rope_store_indexer_cpu``) with the same argument conventions,
plus what vLLM refuses off Blackwell: the 68-byte MXFP4 indexer cache.

State cache (written by :func:`save_partial_states`, read by the compress step)
------------------------------------------------------------------------------
``state_cache``: fp32 ``[num_state_blocks, state_block_size, 2 * S]``, ``S = coff * head_dim``,
``coff = 2`` for ``compress_ratio == 4`` (overlapping windows) else 1. Rows are contiguous inside
a block (``stride(1) == 2 * S``, ``stride(2) == 1``); the block stride may be larger (vLLM pools
the state pages with the KV pages). One row per raw token (slot = ``block * state_block_size +
offset``)::

    row[0 : S]      kv           (the token's fp32 kv projection, all coff*head_dim channels)
    row[S : 2 * S]  score + ape  (score projection + ape[position % compress_ratio])

Compress step, for a token at ``position`` with ``(position + 1) % compress_ratio == 0``
------------------------------------------------------------------------------------
``gather_slots[t]`` (int64 ``[window]``, ``window = coff * compress_ratio``) holds the state slots
of raw positions ``position - window + 1 .. position``; ``-1`` (positions before 0, or anything
negative) skips that row. Row ``w`` reads channel half ``h(w) = 1 if w >= compress_ratio else 0``
(C4: rows 0..3 are the previous window and use ``kv[:d]``/``score[:d]``, rows 4..7 the current
window and use ``kv[d:2d]``/``score[d:2d]``; C128: 128 rows, ``h = 0``)::

    p[w, c]  = softmax over the valid rows w of score[w, h(w)*d + c]      (per channel c)
    x[c]     = sum_w p[w, c] * kv[w, h(w)*d + c]
    y        = x * rsqrt(mean(x^2) + eps) * rms_norm_weight              (fp32)
    y[-R:]   = GPT-J (interleaved pairs) RoPE at position (position // ratio) * ratio

with ``R = cos_sin_cache.shape[1]`` (64), ``cos_sin_cache[p] = [cos(p*f_0..f_{R/2-1}) |
sin(...)]``. Entry ``j = position // ratio`` is thus rotated at ``j * ratio``, the window start.

Quantized stores (entry ``y`` goes to ``kv_slot_mapping[t]``; ``-1`` skips)
-------------------------------------------------------------------------
- indexer (head_dim 128): ``y`` rounded to bf16, then the ``fp8`` 132 B or ``mxfp4`` 68 B
  block-split indexer entry (:mod:`vllm_dsv4_backend.formats.indexer_cache`). No Hadamard
  rotation on either dtype, like vLLM's kernels (the reference model rotates before its FP4
  QAT; the dot products are unchanged since the rotation is orthogonal, only the quantization
  error differs), so the query side must not rotate either.
- main (head_dim 512): ``y`` rounded to bf16, then the 584 B ``fp8_ds_mla`` entry
  (:mod:`vllm_dsv4_backend.formats.fp8_ds_mla`); vLLM's kernels also quantize the NoPE part from
  the bf16-rounded values and store the RoPE part as bf16.

All functions are vectorized over tokens. The compress step gathers only the windows of the
tokens that emit an entry (a data-dependent ``nonzero``: a host sync on CUDA, not CUDA-graph
capturable).
"""

from __future__ import annotations

import functools
import math

import torch

from vllm_dsv4_backend._checks import check_tensor, describe
from vllm_dsv4_backend.ops import rope

__all__ = [
    "compress_norm_rope",
    "compress_norm_rope_store",
    "compress_norm_rope_store_indexer",
    "compress_norm_rope_store_main",
    "save_partial_states",
]

INDEXER_HEAD_DIM = 128
MAIN_HEAD_DIM = 512
_FLOAT_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# validation (the package's one tensor check, plus what it does not express)
# --------------------------------------------------------------------------------------------
def _fail(name: str, expected: str, t: torch.Tensor) -> None:
    # Conditions check_tensor does not express (strides, relations between arguments).
    raise ValueError(f"{name}: expected {expected}; got {describe(t)}, stride {tuple(t.stride())}")


def _check_compress_args(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    compress_ratio: int,
    head_dim: int,
) -> tuple[int, int]:
    """Validate the shared compress arguments; returns ``(coff, rope_dim)``."""
    if not isinstance(compress_ratio, int) or compress_ratio < 2:
        raise ValueError(f"compress_ratio: expected an int >= 2 (4 or 128), got {compress_ratio!r}")
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: expected a positive even int, got {head_dim!r}")
    coff = 2 if compress_ratio == 4 else 1
    dev = state_cache.device if isinstance(state_cache, torch.Tensor) else None
    check_tensor(
        "state_cache",
        state_cache,
        shape=(None, None, 2 * coff * head_dim),
        dtype=(torch.float32,),
    )
    if state_cache.stride(2) != 1 or state_cache.stride(1) != state_cache.shape[2]:
        _fail(
            "state_cache",
            f"rows contiguous within a block (stride(1) == {2 * coff * head_dim}, stride(2) == 1)",
            state_cache,
        )
    window = coff * compress_ratio
    check_tensor(
        "gather_slots", gather_slots, shape=(None, window), dtype=(torch.int64,), device=dev
    )
    num_tokens = gather_slots.shape[0]
    check_tensor(
        "positions", positions, shape=(num_tokens,), dtype=(torch.int64, torch.int32), device=dev
    )
    check_tensor(
        "rms_norm_weight",
        rms_norm_weight,
        shape=(head_dim,),
        dtype=_FLOAT_WEIGHT_DTYPES,
        device=dev,
    )
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtype=_FLOAT_WEIGHT_DTYPES, device=dev)
    rope_dim = cos_sin_cache.shape[1]
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        _fail("cos_sin_cache", f"[max_pos, rope_dim] with even 0 < rope_dim <= {head_dim}",
              cos_sin_cache)
    return coff, rope_dim


def _emit_mask(positions: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    # torch's % follows Python (non-negative for a positive divisor), so position -1 would look
    # like a window end: negative positions (padding) are excluded explicitly.
    return (positions >= 0) & ((positions + 1) % compress_ratio == 0)


# --------------------------------------------------------------------------------------------
# core math on the emitting rows
# --------------------------------------------------------------------------------------------
def _compress_rows(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    compress_ratio: int,
    head_dim: int,
    coff: int,
    rope_dim: int,
    out_rows: torch.Tensor,
) -> None:
    """Compress + RMSNorm + RoPE for the tokens ``rows`` (int64 ``[E]``) into ``out_rows``.

    ``out_rows``: fp32 ``[E, head_dim]``, contiguous; fully overwritten.
    """
    num_rows = rows.numel()
    if num_rows == 0:
        return
    d = head_dim
    window = coff * compress_ratio
    nb, bs, row_width = state_cache.shape
    half_width = coff * d  # S: kv part, then score part

    slots = gather_slots.index_select(0, rows)  # [E, W]
    invalid = slots < 0
    capacity = nb * bs
    if bool((slots >= capacity).any()):
        bad = int(slots.max())
        raise ValueError(
            f"gather_slots: expected slot ids in [-1, {capacity}) for state_cache of shape "
            f"{tuple(state_cache.shape)}, got {bad}"
        )
    if bool(invalid.all(dim=1).any()):
        raise ValueError(
            "gather_slots: every emitting token needs at least one valid (>= 0) slot in its "
            "window (its own row), got a row of all -1"
        )
    # Entry j = position // ratio is rotated at the window start j * ratio.
    pos = positions.index_select(0, rows).to(torch.int64)
    rope_pos = torch.div(pos, compress_ratio, rounding_mode="floor").mul_(compress_ratio)
    if bool((rope_pos >= cos_sin_cache.shape[0]).any()):
        raise ValueError(
            f"cos_sin_cache: expected at least {int(rope_pos.max()) + 1} positions (rows), got "
            f"shape {tuple(cos_sin_cache.shape)}"
        )

    # Row w of token e needs two d-long runs: kv at element offset blk*stride0 + off*row_width +
    # h(w)*d and its score half_width further. Express all run starts on one grid of step g, so
    # one index_select per run over an (overlapping, read-only) [rows, d] as_strided view gathers
    # exactly the needed bytes, whatever the (pooled, padded) block stride is.
    s0 = state_cache.stride(0) if nb > 1 else row_width * bs
    g = math.gcd(s0, row_width, d)
    safe = slots.clamp(min=0)
    blk = torch.div(safe, bs, rounding_mode="floor")
    row_id = safe.sub_(blk * bs)  # offset in block
    row_id.mul_(row_width // g).add_(blk.mul_(s0 // g))
    if coff == 2:
        row_id[:, compress_ratio:] += d // g
    row_id = row_id.view(-1)
    num_virt = ((nb - 1) * s0 + (bs - 1) * row_width + (coff - 1) * d) // g + 1
    base = state_cache.storage_offset()
    kv_rows = state_cache.as_strided((num_virt, d), (g, 1), base)
    score_rows = state_cache.as_strided((num_virt, d), (g, 1), base + half_width)
    kv = torch.empty((num_rows, window, d), dtype=torch.float32, device=state_cache.device)
    score = torch.empty_like(kv)
    torch.index_select(kv_rows, 0, row_id, out=kv.view(-1, d))
    torch.index_select(score_rows, 0, row_id, out=score.view(-1, d))

    # Skipped rows get weight exp(-inf) = 0 and kv 0: the clamp above pointed them at slot 0,
    # which may hold NaN (never written) and 0 * NaN would leak.
    bad_e, bad_w = invalid.nonzero(as_tuple=True)
    if bad_e.numel():
        score[bad_e, bad_w] = float("-inf")
        kv[bad_e, bad_w] = 0.0

    # Same order as vLLM's C++ CPU kernel: per-channel max, exp(s - max), sum(e * kv) / sum(e).
    score.sub_(score.amax(dim=1, keepdim=True)).exp_()
    denom = score.sum(dim=1)  # [E, d]
    score.mul_(kv)
    torch.sum(score, dim=1, out=out_rows)
    out_rows.div_(denom)

    # RMSNorm in fp32: x * (1 / sqrt(mean(x^2) + eps)) * w.
    inv_rms = out_rows.square().mean(dim=-1, keepdim=True).add_(rms_norm_eps).rsqrt_()
    out_rows.mul_(inv_rms).mul_(rms_norm_weight.to(torch.float32))

    # GPT-J RoPE on the last rope_dim channels at the window start position.
    half = rope_dim // 2
    cs = cos_sin_cache.index_select(0, rope_pos).to(torch.float32)
    cos, sin = cs[:, :half], cs[:, half:]
    rope.gptj_rope_fma_(out_rows[:, d - rope_dim :], cos, sin)


def _check_out(out: torch.Tensor | None, rows_needed: int, head_dim: int, device: torch.device,
               exact_rows: bool) -> None:
    if out is None:
        return
    check_tensor(
        "out",
        out,
        shape=(rows_needed if exact_rows else None, head_dim),
        dtype=(torch.float32,),
        device=device,
    )
    if not out.is_contiguous():
        _fail("out", "a contiguous fp32 [T, head_dim] tensor", out)
    if out.shape[0] < rows_needed:
        _fail("out", f"at least {rows_needed} rows of [*, {head_dim}] fp32", out)


def compress_norm_rope(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    compress_ratio: int,
    head_dim: int,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed entries (fp32, after RMSNorm and RoPE, before quantization).

    Args:
        state_cache: fp32 ``[num_state_blocks, state_block_size, 2 * coff * head_dim]``, rows
            contiguous within a block (block stride may be padded); layout in the module doc.
        gather_slots: int64 ``[T, coff * compress_ratio]`` state slots of positions
            ``position - window + 1 .. position``; any negative value skips the row.
        positions: int64/int32 ``[T]`` raw token positions.
        rms_norm_weight: fp32/bf16/fp16 ``[head_dim]``.
        rms_norm_eps: RMSNorm epsilon.
        cos_sin_cache: fp32/bf16/fp16 ``[max_pos, rope_dim]``, ``[cos | sin]`` halves.
        compress_ratio: 4 (overlapping windows, coff 2) or 128 (any ratio != 4 has coff 1).
        head_dim: 128 (indexer) or 512 (main); any even size works.
        out: optional fp32 contiguous ``[T, head_dim]``; only emitting rows are written.

    Returns:
        ``(values, emit_mask)``: ``values`` fp32 ``[T, head_dim]`` (``out`` if given; rows with
        ``emit_mask`` False are left untouched, i.e. uninitialized when ``out`` is None) and
        ``emit_mask`` bool ``[T]``: ``position >= 0 and (position + 1) % compress_ratio == 0``.
    """
    coff, rope_dim = _check_compress_args(
        state_cache, gather_slots, positions, rms_norm_weight, cos_sin_cache, compress_ratio,
        head_dim,
    )
    num_tokens = gather_slots.shape[0]
    _check_out(out, num_tokens, head_dim, state_cache.device, exact_rows=True)
    if out is None:
        out = torch.empty((num_tokens, head_dim), dtype=torch.float32, device=state_cache.device)
    emit = _emit_mask(positions, compress_ratio)
    rows = emit.nonzero().view(-1)
    if rows.numel() == num_tokens:
        target = out  # every token emits (e.g. a C4 decode batch at window ends): no scatter
    else:
        target = torch.empty(
            (rows.numel(), head_dim), dtype=torch.float32, device=state_cache.device
        )
    _compress_rows(
        state_cache, gather_slots, positions, rows, rms_norm_weight, rms_norm_eps, cos_sin_cache,
        compress_ratio, head_dim, coff, rope_dim, target,
    )
    if target is not out:
        out.index_copy_(0, rows, target)
    return out, emit


# --------------------------------------------------------------------------------------------
# stores into the paged caches
# --------------------------------------------------------------------------------------------
def compress_norm_rope_store(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
    *,
    indexer_kv_dtype: str | None,
    out: torch.Tensor | None = None,
) -> None:
    """Compress, RMSNorm, RoPE, quantize and insert the entry of each token closing a window.

    ``indexer_kv_dtype`` picks the compressor: ``None`` the main one (head_dim 512, 584 B
    ``fp8_ds_mla`` entries: ``torch.ops._C.compress_norm_rope_store_cpu``, also named
    :data:`compress_norm_rope_store_main`), ``"fp8"`` or ``"mxfp4"`` the indexer's (head_dim
    128, that indexer cache; ``"fp8"`` is ``torch.ops._C.compress_norm_rope_store_indexer_cpu``).
    The positional arguments are those of the C++ ops.

    Args:
        state_cache, gather_slots, positions, rms_norm_weight, rms_norm_eps, cos_sin_cache,
            compress_ratio: as in :func:`compress_norm_rope` (``head_dim`` 512 or 128).
        kv_slot_mapping: int64/int32 ``[T]`` compressed-cache slot of each token's entry; only
            tokens that close a window are read, ``-1`` skips.
        kv_cache_2d: uint8 ``[num_blocks, >= kv_cache_block_size * entry_bytes]`` (vLLM's
            ``kv_cache.view(num_blocks, -1)``; the row stride may be padded). Per block of ``B =
            kv_cache_block_size`` entries, block-split: main: ``[B*576: 448 e4m3 NoPE + 64 bf16
            RoPE][B*8: 7 ue8m0 + 1 pad]`` (584 B/entry); indexer ``fp8``: ``[B*128 e4m3][B*4
            fp32 scale]`` (132 B/entry); ``mxfp4``: ``[B*64 packed e2m1][B*4 ue8m0]`` (68 B/entry).
        kv_cache_block_size: entries per cache block.
        indexer_kv_dtype: ``None`` (main), ``"fp8"`` or ``"mxfp4"`` (indexer).
        out: optional fp32 contiguous ``[>= T, head_dim]`` scratch for the unquantized entries.

    Only the bytes of the written entries change; everything else in the cache is untouched.
    """
    if indexer_kv_dtype is None:
        from vllm_dsv4_backend.formats import fp8_ds_mla

        head_dim, entry_bytes = MAIN_HEAD_DIM, 584
    else:
        from vllm_dsv4_backend.formats import indexer_cache

        if indexer_kv_dtype not in ("fp8", "mxfp4"):
            raise ValueError(
                f"indexer_kv_dtype: expected 'fp8' or 'mxfp4', got {indexer_kv_dtype!r}"
            )
        head_dim = INDEXER_HEAD_DIM
        entry_bytes = indexer_cache.entry_bytes(indexer_kv_dtype)
    coff, rope_dim = _check_compress_args(
        state_cache, gather_slots, positions, rms_norm_weight, cos_sin_cache, compress_ratio,
        head_dim,
    )
    dev = state_cache.device
    num_tokens = gather_slots.shape[0]
    check_tensor(
        "kv_slot_mapping", kv_slot_mapping, shape=(num_tokens,),
        dtype=(torch.int64, torch.int32), device=dev,
    )
    if not isinstance(kv_cache_block_size, int) or kv_cache_block_size <= 0:
        raise ValueError(
            f"kv_cache_block_size: expected a positive int, got {kv_cache_block_size!r}"
        )
    check_tensor("kv_cache_2d", kv_cache_2d, ndim=2, dtype=(torch.uint8,), device=dev)
    block_bytes = kv_cache_block_size * entry_bytes
    if kv_cache_2d.stride(1) != 1 or kv_cache_2d.shape[1] < block_bytes or (
        kv_cache_2d.shape[0] > 1 and kv_cache_2d.stride(0) < block_bytes
    ):
        _fail(
            "kv_cache_2d",
            f"uint8 [num_blocks, >= {block_bytes}] (kv_cache_block_size {kv_cache_block_size} x "
            f"{entry_bytes} B), unit column stride, row stride >= {block_bytes}",
            kv_cache_2d,
        )
    _check_out(out, num_tokens, head_dim, dev, exact_rows=False)

    kv_slots = kv_slot_mapping.to(torch.int64)
    emit = _emit_mask(positions, compress_ratio) & (kv_slots >= 0)
    rows = emit.nonzero().view(-1)
    slots = kv_slots.index_select(0, rows)
    capacity = kv_cache_2d.shape[0] * kv_cache_block_size
    if bool((slots >= capacity).any()):
        raise ValueError(
            f"kv_slot_mapping: expected slot ids in [-1, {capacity}) for kv_cache_2d of shape "
            f"{tuple(kv_cache_2d.shape)} with kv_cache_block_size {kv_cache_block_size}, got "
            f"{int(slots.max())}"
        )
    if out is not None:
        values = out[: rows.numel()]
    else:
        values = torch.empty((rows.numel(), head_dim), dtype=torch.float32, device=dev)
    _compress_rows(
        state_cache, gather_slots, positions, rows, rms_norm_weight, rms_norm_eps, cos_sin_cache,
        compress_ratio, head_dim, coff, rope_dim, values,
    )
    # The [num_blocks, kv_cache_block_size, entry_bytes] uint8 view over kv_cache_2d's bytes
    # (vLLM's shape contract; the bytes inside a block are block-split).
    row_stride = kv_cache_2d.stride(0) if kv_cache_2d.shape[0] > 1 else block_bytes
    cache_3d = kv_cache_2d.as_strided(
        (kv_cache_2d.shape[0], kv_cache_block_size, entry_bytes),
        (row_stride, entry_bytes, 1),
        kv_cache_2d.storage_offset(),
    )
    # vLLM's kernels quantize the bf16-rounded entry (indexer: after RoPE; main: the NoPE part,
    # while the RoPE part is stored as bf16), so bf16 is exactly what the formats consume.
    entries = values.to(torch.bfloat16)
    if not slots.numel():
        return
    if indexer_kv_dtype is None:
        fp8_ds_mla.quantize_and_insert(entries, cache_3d, slots)
    else:
        indexer_cache.quantize_and_insert(entries, cache_3d, slots, indexer_kv_dtype)


#: The main compressor's store (head_dim 512, 584 B ``fp8_ds_mla``): the arguments of
#: ``torch.ops._C.compress_norm_rope_store_cpu`` (plus ``out``).
compress_norm_rope_store_main = functools.partial(compress_norm_rope_store, indexer_kv_dtype=None)

#: The indexer compressor's store (head_dim 128): the arguments of
#: ``torch.ops._C.compress_norm_rope_store_indexer_cpu`` plus the required keyword
#: ``indexer_kv_dtype`` (``"fp8"`` or ``"mxfp4"``) (and ``out``).
compress_norm_rope_store_indexer = compress_norm_rope_store


# --------------------------------------------------------------------------------------------
# partial-state write
# --------------------------------------------------------------------------------------------
def save_partial_states(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's state row: ``[kv | score + ape[position % compress_ratio]]``.

    Same arguments as ``torch.ops._C.save_partial_states_cpu``.

    Args:
        kv: fp32 ``[T, S]`` (``S = coff * head_dim``; unit column stride, any row stride).
        score: fp32 ``[T, S]``.
        ape: fp32 ``[compress_ratio, S]``.
        positions: int64/int32 ``[T]``.
        state_cache: fp32 ``[num_state_blocks, state_block_size, 2 * S]``, rows contiguous
            within a block; written in place.
        slot_mapping: int64/int32 ``[T]`` state slot per token; negative skips the token.
    """
    check_tensor("kv", kv, ndim=2, dtype=(torch.float32,))
    num_tokens, width = kv.shape
    dev = kv.device
    check_tensor("score", score, shape=(num_tokens, width), dtype=(torch.float32,), device=dev)
    check_tensor("ape", ape, shape=(None, width), dtype=(torch.float32,), device=dev)
    check_tensor(
        "positions", positions, shape=(num_tokens,), dtype=(torch.int64, torch.int32), device=dev
    )
    check_tensor(
        "state_cache", state_cache, shape=(None, None, 2 * width), dtype=(torch.float32,),
        device=dev,
    )
    check_tensor(
        "slot_mapping", slot_mapping, shape=(num_tokens,), dtype=(torch.int64, torch.int32),
        device=dev,
    )
    nb, bs, _ = state_cache.shape
    slots = slot_mapping.to(torch.int64)
    keep = (slots >= 0).nonzero().view(-1)
    sl = slots.index_select(0, keep)
    if bool((sl >= nb * bs).any()):
        raise ValueError(
            f"slot_mapping: expected slot ids in [-1, {nb * bs}) for state_cache of shape "
            f"{tuple(state_cache.shape)}, got {int(sl.max())}"
        )
    blk = torch.div(sl, bs, rounding_mode="floor")
    off = sl - blk * bs
    ape_rows = positions.index_select(0, keep).to(torch.int64).remainder(ape.shape[0])
    state_cache[blk, off, :width] = kv.index_select(0, keep)
    state_cache[blk, off, width:] = score.index_select(0, keep) + ape.index_select(0, ape_rows)
