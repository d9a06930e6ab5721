# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-V4 lightning-indexer K cache: FP8 (132 B/entry) and MXFP4 (68 B/entry).

Torch only; never imports vLLM. One entry is one compressed indexer key
(``index_head_dim = 128`` values). A page (cache block) holds ``B`` entries,
**block-split** like every DeepSeek-V4 cache: first the values of all ``B``
entries, then the scales of all ``B`` entries.

FP8 (``dtype="fp8"``, vLLM's default), 132 B/entry::

    block base + [0, 128*B)          e4m3fn values, entry o at 128*o
    block base + [128*B, 132*B)      float32 scale, entry o at 128*B + 4*o

    scale = 2**ceil(log2(max(amax, 1e-4) / 448))   (one per 128-value row,
                                                    ue8m0 rounding, stored fp32)
    value = e4m3fn(clamp(x / scale, -448, 448))     (round to nearest even)

MXFP4 (``dtype="mxfp4"``, vLLM's ``use_fp4_indexer_cache=True``), 68 B/entry::

    block base + [0, 64*B)           packed e2m1, entry o at 64*o
                                     (element 2k low nibble, 2k+1 high nibble)
    block base + [64*B, 68*B)        4 ue8m0 bytes, entry o at 64*B + 4*o
                                     (one per 32 values, see ``formats.mxfp4``)

The tensor vLLM binds is ``[num_blocks, B, entry_bytes]`` uint8 (the shape is
only a contract: row ``o`` of the view is *not* entry ``o``), possibly a view
into a larger multi-layer allocation, so ``stride(0)`` may exceed
``B * entry_bytes`` (padded block stride). A 4-D ``[num_blocks, B, 1,
entry_bytes]`` view is accepted too. Slot ``s`` means block ``s // B``,
entry ``s % B``.

Numerics, against vLLM's writers (``_fused_kv_compress_norm_rope_insert_
indexer{,_mxfp4}_attn`` in ``fused_compress_quant_cache.py`` and the CPU
``compress_norm_rope_store_indexer_cpu``):

- vLLM rounds the post-RoPE key to bf16 before quantizing. Here the given
  ``k`` is quantized as is: pass a bf16 ``k`` (or ``k.bfloat16()``) for
  byte parity with vLLM; a float32 ``k`` keeps its extra precision.
- The exponent is computed exactly from the float32 bits (smallest ``e``
  with ``amax <= 448 * 2**e``); vLLM's float ``log2`` can round ``ceil`` down
  when ``amax / 448`` lies within an ulp above a power of two, which never
  happens for bf16 inputs (8-bit mantissas).
- The 1e-4 floor is the float32 value of 1e-4, so the smallest FP8 scale is
  ``2**-22`` (an all-zero row stores scale ``2**-22`` and zero bytes).
- A row holding NaN or +-inf stores a NaN scale and all-NaN e4m3 bytes, so
  it dequantizes to NaN instead of to plausible numbers (vLLM's writers
  make no such promise). MXFP4 follows ``formats.mxfp4`` (NaN block ->
  scale byte 0xFF -> NaN block; inf saturates).
"""

from __future__ import annotations

import torch

from vllm_dsv4_backend._checks import check_tensor, describe
from vllm_dsv4_backend.formats import mxfp4

__all__ = [
    "FP8",
    "FP8_MAX",
    "HEAD_DIM",
    "MXFP4",
    "block_views",
    "check_dtype",
    "dequantize_and_gather",
    "dequantize_raw",
    "entry_bytes",
    "fp8_exponent",
    "gather_raw",
    "quantize_and_insert",
    "quantize_rows",
    "scale_bytes",
    "value_bytes",
]

FP8 = "fp8"
MXFP4 = "mxfp4"
HEAD_DIM = 128
FP8_MAX = 448.0
# float32(1e-4), the amax floor every vLLM writer uses (not the double 1e-4).
_FP8_AMAX_FLOOR = float(torch.tensor(1e-4, dtype=torch.float32))

_VALUE_BYTES = {FP8: HEAD_DIM, MXFP4: HEAD_DIM // 2}
_SCALE_BYTES = {FP8: 4, MXFP4: HEAD_DIM // mxfp4.BLOCK_SIZE}


def check_dtype(dtype: str, where: str = "indexer_cache") -> str:
    """Validate an indexer cache dtype name (``"fp8"`` or ``"mxfp4"``)."""
    if dtype not in _VALUE_BYTES:
        raise ValueError(
            f"{where}: argument 'dtype' expected 'fp8' or 'mxfp4', got {dtype!r}"
        )
    return dtype


def value_bytes(dtype: str) -> int:
    """Bytes of values per entry: 128 (FP8) or 64 (MXFP4)."""
    return _VALUE_BYTES[check_dtype(dtype, "value_bytes")]


def scale_bytes(dtype: str) -> int:
    """Bytes of scale per entry: 4 (one float32, FP8) or 4 (ue8m0 bytes, MXFP4)."""
    return _SCALE_BYTES[check_dtype(dtype, "scale_bytes")]


def entry_bytes(dtype: str) -> int:
    """Bytes per cache entry: 132 for ``"fp8"``, 68 for ``"mxfp4"``."""
    check_dtype(dtype, "entry_bytes")
    return _VALUE_BYTES[dtype] + _SCALE_BYTES[dtype]


def fp8_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Exact FP8 ue8m0 exponent ``ceil(log2(max(amax, 1e-4) / 448))``.

    Args:
        amax: ``[...]`` float32 non-negative row maxima.

    Returns:
        ``[...]`` int32, the smallest ``e`` with ``max(amax, 1e-4) <= 448 *
        2**e`` (``>= -22``). Non-finite inputs give meaningless values: callers
        mask them.
    """
    a = amax.clamp_min(_FP8_AMAX_FLOOR)
    bits = a.view(torch.int32)
    exp_field = bits >> 23
    mant = bits & 0x7FFFFF
    # a = (1 + f) * 2**(exp_field - 127) <= 448 * 2**e = 1.75 * 2**(e + 8)
    # holds for e = exp_field - 135 iff f <= 0.75, else for one more.
    return exp_field - 135 + (mant > 0x600000).to(torch.int32)


def quantize_rows(k: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize indexer keys without touching a cache.

    Args:
        k: ``[N, 128]`` float32 / bfloat16 / float16.
        dtype: ``"fp8"`` or ``"mxfp4"``.

    Returns:
        ``(values, scales)`` exactly as stored per entry:
        FP8: ``[N, 128]`` uint8 (e4m3fn bits) and ``[N, 4]`` uint8 (the
        float32 scale's bytes); MXFP4: ``[N, 64]`` uint8 and ``[N, 4]`` uint8.
    """
    check_dtype(dtype, "quantize_rows")
    if dtype == MXFP4:
        return mxfp4.quantize(k)
    x = k.to(torch.float32)
    amax = x.abs().amax(dim=-1)
    e = fp8_exponent(amax)
    scale = ((e + 127) << 23).view(torch.float32)  # 2**e, e in [-22, 105]
    scale = scale.masked_fill(~torch.isfinite(amax), float("nan"))
    y = (x / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    values = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return values, scale.unsqueeze(-1).view(torch.uint8)


def dequantize_raw(
    values: torch.Tensor,
    scales: torch.Tensor,
    dtype: str,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize entries in their stored byte form.

    Args:
        values: ``[..., 128]`` (FP8) or ``[..., 64]`` (MXFP4) uint8.
        scales: ``[..., 4]`` uint8 (float32 bytes for FP8, ue8m0 for MXFP4).
        dtype: ``"fp8"`` or ``"mxfp4"``.
        out: optional ``[..., 128]`` float32 buffer.

    Returns:
        ``[..., 128]`` float32, exact (scales are powers of two).
    """
    if dtype == MXFP4:
        return mxfp4.dequantize(values, scales, out=out)
    v = values.view(torch.float8_e4m3fn)
    s = scales.contiguous().view(torch.float32)
    if out is None:
        return v.to(torch.float32) * s
    out.copy_(v)
    return out.mul_(s)


def block_views(
    cache: torch.Tensor, dtype: str, where: str = "indexer_cache"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-entry views of the value and scale regions of a paged cache.

    Args:
        cache: ``[num_blocks, B, entry_bytes]`` or ``[num_blocks, B, 1,
            entry_bytes]`` uint8; bytes within a block contiguous, any
            ``stride(0) >= B * entry_bytes``.
        dtype: ``"fp8"`` or ``"mxfp4"``.

    Returns:
        ``(values, scales)``: ``[num_blocks, B, value_bytes]`` and
        ``[num_blocks, B, 4]`` uint8 views of the same storage (writes go to
        the cache).
    """
    check_dtype(dtype, where)
    eb = entry_bytes(dtype)
    if cache.dtype != torch.uint8:
        raise ValueError(
            f"{where}: argument 'cache' expected dtype torch.uint8, got {describe(cache)}"
        )
    if cache.dim() == 4 and cache.shape[2] == 1:
        ok = cache.shape[3] == eb and cache.stride(3) == 1 and cache.stride(1) == eb
    elif cache.dim() == 3:
        ok = cache.shape[2] == eb and cache.stride(2) == 1 and cache.stride(1) == eb
    else:
        ok = False
    nb, bs = (cache.shape[0], cache.shape[1]) if cache.dim() >= 2 else (0, 0)
    if not ok or (nb > 1 and cache.stride(0) < bs * eb):
        raise ValueError(
            f"{where}: argument 'cache' expected shape [num_blocks, B, {eb}] or "
            f"[num_blocks, B, 1, {eb}] ({dtype}) with contiguous bytes inside a block "
            f"and stride(0) >= B*{eb}, got {describe(cache)} strides {list(cache.stride())}"
        )
    vb = _VALUE_BYTES[dtype]
    sb = _SCALE_BYTES[dtype]
    s0 = cache.stride(0)
    off = cache.storage_offset()
    values = cache.as_strided((nb, bs, vb), (s0, vb, 1), off)
    scales = cache.as_strided((nb, bs, sb), (s0, sb, 1), off + bs * vb)
    return values, scales


def _widest_view(v: torch.Tensor) -> torch.Tensor:
    """The same bytes as int64 or int32 elements where strides and offset allow."""
    for dt, w in ((torch.int64, 8), (torch.int32, 4)):
        if (
            v.shape[-1] % w == 0
            and v.stride(0) % w == 0
            and v.stride(1) % w == 0
            and v.storage_offset() % w == 0
        ):
            return v.view(dt)
    return v


def gather_raw(
    values: torch.Tensor,
    scales: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather stored entries (no checks; indices must be in range).

    Args:
        values, scales: views from :func:`block_views`.
        block_ids, offsets: ``[...]`` int64 block and in-block entry indices.

    Returns:
        ``([..., value_bytes], [..., 4])`` uint8 copies.
    """
    # Copying 8- or 4-byte elements instead of bytes halves the gather's cost.
    vals = _widest_view(values)[block_ids, offsets].view(torch.uint8)
    scs = _widest_view(scales)[block_ids, offsets].view(torch.uint8)
    return vals, scs


def _check_slots(where: str, slots: torch.Tensor, n: int | None, device: torch.device) -> None:
    check_tensor("slots", slots, shape=(n,), dtype=(torch.int32, torch.int64), device=device,
                 shape_doc="[N]" if n is None else None, where=where)


def _check_slot_range(where: str, slots: torch.Tensor, num_slots: int) -> None:
    if slots.numel() == 0:
        return
    hi = int(slots.max())
    if hi >= num_slots:
        raise ValueError(
            f"{where}: slot ids must be < num_blocks * block_size = {num_slots} "
            f"(or negative to skip), got max {hi}"
        )


def quantize_and_insert(
    k: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    dtype: str = FP8,
) -> None:
    """Quantize indexer keys and write them into the paged cache.

    Args:
        k: ``[N, 128]`` bfloat16 / float32 / float16 keys (already normed and
            RoPE'd; see the module docstring about bf16 parity).
        cache: ``[num_blocks, B, entry_bytes(dtype)]`` (or 4-D
            ``[num_blocks, B, 1, entry_bytes]``) uint8, modified in place.
        slot_mapping: ``[N]`` int32/int64 slot per key; negative (-1) skips the
            key, as vLLM's writers do. Valid slots must be unique.
        dtype: ``"fp8"`` or ``"mxfp4"``.

    Raises:
        ValueError: bad shapes/dtypes/devices, or a slot ``>= num_blocks * B``.
    """
    where = "quantize_and_insert"
    values_v, scales_v = block_views(cache, dtype, where)
    if k.dim() != 2 or k.shape[1] != HEAD_DIM or k.dtype not in (
        torch.bfloat16,
        torch.float32,
        torch.float16,
    ) or k.device != cache.device:
        raise ValueError(
            f"{where}: argument 'k' expected shape [N, {HEAD_DIM}] dtype bfloat16, float32 "
            f"or float16 on {cache.device}, got {describe(k)}"
        )
    _check_slots(where, slot_mapping, k.shape[0], cache.device)
    nb, bs = values_v.shape[0], values_v.shape[1]
    _check_slot_range(where, slot_mapping, nb * bs)
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        keep = valid.nonzero().squeeze(1)
        k = k.index_select(0, keep)
        slots = slots.index_select(0, keep)
    if slots.numel() == 0:
        return
    vals, scs = quantize_rows(k, dtype)
    blk = slots // bs
    off = slots % bs
    values_v[blk, off] = vals
    scales_v[blk, off] = scs


def dequantize_and_gather(
    cache: torch.Tensor,
    slots: torch.Tensor,
    dtype: str = FP8,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read entries back from the paged cache as float32.

    Args:
        cache: ``[num_blocks, B, entry_bytes(dtype)]`` (or 4-D) uint8.
        slots: ``[M]`` int32/int64 slot ids; a negative slot gives a zero row
            (nothing is read for it).
        dtype: ``"fp8"`` or ``"mxfp4"``.
        out: optional ``[M, 128]`` float32 buffer.

    Returns:
        ``[M, 128]`` float32 dequantized keys (exact).

    Raises:
        ValueError: bad shapes/dtypes/devices, or a slot ``>= num_blocks * B``.
    """
    where = "dequantize_and_gather"
    values_v, scales_v = block_views(cache, dtype, where)
    _check_slots(where, slots, None, cache.device)
    m = slots.shape[0]
    if out is not None and (
        tuple(out.shape) != (m, HEAD_DIM)
        or out.dtype != torch.float32
        or out.device != cache.device
    ):
        raise ValueError(
            f"{where}: argument 'out' expected shape [{m}, {HEAD_DIM}] dtype torch.float32 "
            f"on {cache.device}, got {describe(out)}"
        )
    nb, bs = values_v.shape[0], values_v.shape[1]
    _check_slot_range(where, slots, nb * bs)
    s = slots.long()
    valid = s >= 0
    if nb == 0:  # every slot is negative (range-checked above): all zero rows
        res = out if out is not None else torch.empty(m, HEAD_DIM, device=cache.device)
        return res.zero_()
    safe = s.clamp(min=0)
    vals, scs = gather_raw(values_v, scales_v, safe // bs, safe % bs)
    res = dequantize_raw(vals, scs, dtype, out=out)
    # masked_fill (not a multiply): the row read for a skipped slot may be NaN.
    return res.masked_fill_(~valid.unsqueeze(1), 0.0)
