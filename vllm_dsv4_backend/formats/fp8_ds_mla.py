# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-V4 ``fp8_ds_mla`` KV cache: 584 bytes per token, block-split (torch only).

Byte layout
-----------
A cache is a uint8 tensor ``[num_blocks, B, 584]`` (or the FlashMLA shape contract
``[num_blocks, B, 1, 584]``). The per-token 584-byte *rows* of that view are only a shape
contract: the bytes of a block are **not** stored token by token. For block ``blk`` at byte
``base = blk * stride0`` (``stride0 = cache.stride(0)``, in bytes, ``>= 584 * B``; vLLM and
FlashMLA pad it to a multiple of 576, see :func:`padded_block_stride`), token ``t < B`` has:

====================================  ======================================================
``base + 576*t + [0, 448)``           448 e4m3fn bytes: the NoPE values ``x[0:448] / s[i]``
``base + 576*t + [448, 576)``         64 bf16 RoPE values ``x[448:512]``, little endian
``base + 576*B + 8*t + [0, 7)``       7 UE8M0 scale bytes ``e_i``, ``s[i] = 2**(e_i - 127)``,
                                      one per 64-value NoPE tile ``i``
``base + 576*B + 8*t + 7``            pad byte, always 0
====================================  ======================================================

Bytes from ``base + 584*B`` to ``base + stride0`` (block padding) are never read or written.

Quantization (vLLM's writer, the DeepSeek-V4 reference ``act_quant`` variant)
---------------------------------------------------------------------------
The input row is first rounded to bf16. Per NoPE tile ``i`` of 64 values (fp32 math)::

    amax  = max(|x_tile|).clamp_min(1e-4)          # amax floor: scale >= 2**-22
    e     = ceil(log2(amax / 448))                 # computed exactly with frexp
    byte  = clamp(e + 127, 0, 255)
    fp8   = (x_tile * 2**-e).clamp(-448, 448).to(float8_e4m3fn)   # RNE, subnormals kept

Dequantization: ``fp8.to(f32) * 2**(byte - 127)``, exact in fp32 (a power-of-two scale), then
bf16, which is also exact for every byte the writer can produce. RoPE bytes are the bf16
values unchanged.

Known differences from other writers (documented, not bugs of this module):

- FlashMLA's test quantizer floors the *scale* at 1e-4 (``scale >= 2**-13``) instead of the
  amax; vLLM 0.32's AVX512 CPU writer (``fused_qnorm_rope_kv_insert_cpu``) does the same
  and also flushes fp8-subnormal results to zero. The bytes agree with those writers for
  every tile with ``amax >= 448e-4`` and every value that is not an fp8 subnormal.
- NaN/inf inputs are not supported (their bytes are unspecified).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_dsv4_backend._checks import check_tensor

__all__ = [
    "BYTES_PER_TOKEN",
    "DATA_BYTES_PER_TOKEN",
    "HEAD_DIM",
    "NOPE_DIM",
    "ROPE_DIM",
    "SCALE_BYTES_PER_TOKEN",
    "TILE_SIZE",
    "NUM_TILES",
    "BLOCK_STRIDE_ALIGNMENT",
    "CacheLayout",
    "allocate_cache",
    "cache_layout",
    "dequantize",
    "dequantize_and_gather",
    "gather_dequant_into",
    "padded_block_stride",
    "quantize",
    "quantize_and_insert",
]

NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM  # 512
TILE_SIZE = 64
NUM_TILES = NOPE_DIM // TILE_SIZE  # 7
DATA_BYTES_PER_TOKEN = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES_PER_TOKEN = NUM_TILES + 1  # 8
BYTES_PER_TOKEN = DATA_BYTES_PER_TOKEN + SCALE_BYTES_PER_TOKEN  # 584
BLOCK_STRIDE_ALIGNMENT = 576
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4

# Bit mask that keeps the sign bit and the 7 magnitude bits of an e4m3 byte after the byte
# has been sign-extended to int32 and shifted left by 20 (see ``gather_dequant_into``).
_E4M3_IN_F32_MASK = 0x87F00000 - (1 << 32)
# A scale byte ``e`` becomes the fp32 multiplier ``2**(e - 7)`` = bits ``(e + 120) << 23``;
# that is a normal fp32 number only up to ``e = 134``. Larger bytes take a second multiply.
_MAX_SINGLE_MULT_SCALE_BYTE = 134


def padded_block_stride(block_size: int) -> int:
    """Bytes per cache block, padded as vLLM and FlashMLA do: ``ceil(584*B / 576) * 576``.

    Examples: ``B = 64`` gives 37440 (37376 unpadded); ``B = 2`` gives 1728 (1168 unpadded).
    """
    if block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size}")
    raw = BYTES_PER_TOKEN * block_size
    return -(-raw // BLOCK_STRIDE_ALIGNMENT) * BLOCK_STRIDE_ALIGNMENT


def allocate_cache(
    num_blocks: int,
    block_size: int,
    device: torch.device | str | None = None,
    padded: bool = True,
    *,
    fill: int = 0,
) -> torch.Tensor:
    """Allocate an ``fp8_ds_mla`` cache and return its ``[num_blocks, block_size, 584]`` view.

    Args:
        num_blocks: number of page blocks.
        block_size: tokens per block ``B``.
        device: torch device (default: the current default device).
        padded: if True, one contiguous uint8 allocation ``[num_blocks, padded_block_stride(B)]``
            (``stride(0)`` a multiple of 576 B, as FlashMLA requires on SM100); else
            ``stride(0) = 584 * B``.
        fill: value of every byte, padding included (tests use ``0xFF`` to poison).

    Returns:
        uint8 ``[num_blocks, block_size, 584]``, ``stride = (stride0, 584, 1)``: a view into
        the padded allocation (not contiguous when padded and the padding is non-zero).
    """
    if num_blocks < 0:
        raise ValueError(f"num_blocks: expected a non-negative int, got {num_blocks}")
    stride0 = padded_block_stride(block_size) if padded else BYTES_PER_TOKEN * block_size
    if block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size}")
    raw = torch.full((num_blocks, stride0), fill, dtype=torch.uint8, device=device)
    return raw[:, : BYTES_PER_TOKEN * block_size].view(num_blocks, block_size, BYTES_PER_TOKEN)


@dataclass(frozen=True)
class CacheLayout:
    """Geometry of one ``fp8_ds_mla`` cache view (all sizes in bytes unless noted).

    Attributes:
        num_blocks: ``cache.shape[0]``.
        block_size: tokens per block ``B`` (``cache.shape[1]``).
        stride0: bytes between consecutive blocks (``cache.stride(0)``, or ``584*B`` when there
            is a single block).
        storage_offset: byte offset of block 0 in the cache's storage.
    """

    num_blocks: int
    block_size: int
    stride0: int
    storage_offset: int

    @property
    def num_slots(self) -> int:
        """Number of addressable slots ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    def blocks_2d(self, cache: torch.Tensor) -> torch.Tensor:
        """uint8 ``[num_blocks, 584*B]`` view of the meaningful bytes of each block."""
        return torch.as_strided(
            cache,
            (self.num_blocks, BYTES_PER_TOKEN * self.block_size),
            (self.stride0, 1),
            self.storage_offset,
        )

    def _section_view(self, cache: torch.Tensor, nbytes: int, offset: int) -> torch.Tensor:
        # A block is split into sections of B per-token records; this one holds ``nbytes``
        # per token and starts ``offset`` bytes into every block.
        return torch.as_strided(
            cache,
            (self.num_blocks, self.block_size, nbytes),
            (self.stride0, nbytes, 1),
            self.storage_offset + offset,
        )

    def data_view(self, cache: torch.Tensor) -> torch.Tensor:
        """uint8 ``[num_blocks, B, 576]`` view: NoPE e4m3 bytes + RoPE bf16 bytes per token."""
        return self._section_view(cache, DATA_BYTES_PER_TOKEN, 0)

    def scale_view(self, cache: torch.Tensor) -> torch.Tensor:
        """uint8 ``[num_blocks, B, 8]`` view: 7 UE8M0 scale bytes + 1 pad byte per token."""
        return self._section_view(
            cache, SCALE_BYTES_PER_TOKEN, DATA_BYTES_PER_TOKEN * self.block_size
        )

    def gather_row_views(
        self, cache: torch.Tensor
    ) -> tuple[torch.Tensor, int, int, torch.Tensor, int, int, int]:
        """Overlapping read-only row views used to gather tokens with one ``index_select``.

        Every token's 576 data bytes start at ``blk*stride0 + 576*off``, a multiple of
        ``g = gcd(stride0, 576)``; viewing the storage as rows of 576 bytes with row step ``g``
        makes each token one row: ``row = blk*(stride0//g) + off*(576//g)``. Same for the 8
        scale bytes with ``g2 = gcd(stride0, 8)``: ``row = blk*(stride0//g2) + (576*B)//g2 +
        off*(8//g2)``.

        Returns:
            ``(data_rows [R, 576] u8, data_blk_mult, data_off_mult, scale_rows [R2, 8] u8,
            scale_blk_mult, scale_base_row, scale_off_mult)``.
        """
        nb, bs, s0 = self.num_blocks, self.block_size, self.stride0
        g = math.gcd(s0, DATA_BYTES_PER_TOKEN)
        n_rows = ((nb - 1) * s0 + (bs - 1) * DATA_BYTES_PER_TOKEN) // g + 1 if nb else 0
        data_rows = torch.as_strided(
            cache, (n_rows, DATA_BYTES_PER_TOKEN), (g, 1), self.storage_offset
        )
        g2 = math.gcd(s0, SCALE_BYTES_PER_TOKEN)
        base2 = DATA_BYTES_PER_TOKEN * bs // g2
        n_rows2 = (
            ((nb - 1) * s0 + (bs - 1) * SCALE_BYTES_PER_TOKEN) // g2 + base2 + 1 if nb else 0
        )
        scale_rows = torch.as_strided(
            cache, (n_rows2, SCALE_BYTES_PER_TOKEN), (g2, 1), self.storage_offset
        )
        return (
            data_rows,
            s0 // g,
            DATA_BYTES_PER_TOKEN // g,
            scale_rows,
            s0 // g2,
            base2,
            SCALE_BYTES_PER_TOKEN // g2,
        )


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, stride {tuple(t.stride())}, dtype {t.dtype}, device {t.device}"


def cache_layout(cache: torch.Tensor, name: str = "cache") -> CacheLayout:
    """Validate an ``fp8_ds_mla`` cache view and return its geometry.

    Accepts uint8 ``[num_blocks, B, 584]`` or ``[num_blocks, B, 1, 584]`` whose token rows
    are 584 B apart (``stride(1) == 584``, ``stride(-1) == 1``) and whose blocks do not overlap
    (``stride(0) >= 584*B``). ``stride(0)`` may exceed ``584*B`` (padded blocks): the cache may
    be a view into a larger allocation; it is addressed through its storage, never assumed
    contiguous.

    Raises:
        ValueError: naming ``name`` and the expected vs received shape/stride/dtype.
    """
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name}: expected a uint8 torch.Tensor, got {type(cache).__name__}")
    if cache.dtype != torch.uint8:
        raise ValueError(
            f"{name}: expected dtype torch.uint8 (fp8_ds_mla bytes), got {_describe(cache)}"
        )
    if cache.dim() == 4:
        if cache.shape[2] != 1:
            raise ValueError(
                f"{name}: expected shape [num_blocks, block_size, 1, {BYTES_PER_TOKEN}] "
                f"(h_kv = 1), got {_describe(cache)}"
            )
    elif cache.dim() != 3:
        raise ValueError(
            f"{name}: expected shape [num_blocks, block_size, {BYTES_PER_TOKEN}] or "
            f"[num_blocks, block_size, 1, {BYTES_PER_TOKEN}], got {_describe(cache)}"
        )
    if cache.shape[-1] != BYTES_PER_TOKEN:
        raise ValueError(
            f"{name}: expected last dim {BYTES_PER_TOKEN} bytes per token (fp8_ds_mla), "
            f"got {_describe(cache)}"
        )
    nb, bs = int(cache.shape[0]), int(cache.shape[1])
    if bs <= 0:
        raise ValueError(f"{name}: expected block_size >= 1, got {_describe(cache)}")
    if cache.stride(-1) != 1 or (bs > 1 and cache.stride(1) != BYTES_PER_TOKEN):
        raise ValueError(
            f"{name}: expected token rows of {BYTES_PER_TOKEN} contiguous bytes "
            f"(stride(1) == {BYTES_PER_TOKEN}, stride(-1) == 1), got {_describe(cache)}"
        )
    stride0 = int(cache.stride(0)) if nb > 1 else BYTES_PER_TOKEN * bs
    if stride0 < BYTES_PER_TOKEN * bs:
        raise ValueError(
            f"{name}: expected stride(0) >= {BYTES_PER_TOKEN} * block_size = "
            f"{BYTES_PER_TOKEN * bs} bytes (blocks must not overlap), got {_describe(cache)}"
        )
    return CacheLayout(nb, bs, stride0, int(cache.storage_offset()))


def _check_kv(kv: torch.Tensor, name: str) -> None:
    # One constraint at a time, so the message names the first one that fails.
    check_tensor(name, kv, shape=(None, HEAD_DIM),
                 shape_doc=f"[N, {HEAD_DIM}] (448 NoPE + 64 RoPE)")
    check_tensor(name, kv, dtype=(torch.bfloat16, torch.float16, torch.float32))


def _check_slots(slots: torch.Tensor, name: str, n: int | None, num_slots: int,
                 device: torch.device) -> None:
    check_tensor(name, slots, dtype=(torch.int32, torch.int64))
    check_tensor(name, slots, shape=(n,), shape_doc="[M]" if n is None else None)
    check_tensor(name, slots, device=device)
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(
                f"{name}: expected slot ids in [-1, {num_slots}) (num_blocks * block_size; "
                f"-1 skips), got values in [{lo}, {hi}]"
            )


def quantize(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize rows to the ``fp8_ds_mla`` token fields (no cache involved).

    Args:
        kv: ``[N, 512]`` bf16 (float16/float32 are rounded to bf16 first): 448 NoPE + 64 RoPE.

    Returns:
        ``(nope [N, 448] uint8 e4m3fn bytes, scale [N, 7] uint8 UE8M0 bytes,
        rope [N, 64] bf16)``, see the module docstring for the rule.
    """
    _check_kv(kv, "kv")
    n = kv.shape[0]
    x = kv.to(torch.bfloat16).float()
    nope = x[:, :NOPE_DIM].reshape(n, NUM_TILES, TILE_SIZE)
    q = nope.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / FP8_MAX
    # ceil(log2(q)) exactly: q = m * 2**ex with m in [0.5, 1); m == 0.5 is an exact power.
    mant, ex = torch.frexp(q)
    e = ex - (mant == 0.5).to(ex.dtype)
    scale = (e + 127).clamp(0, 255).to(torch.uint8)
    inv = torch.ldexp(torch.ones_like(q), -e)
    fp8 = (nope * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    nope_bytes = fp8.view(torch.uint8).reshape(n, NOPE_DIM)
    rope = x[:, NOPE_DIM:].to(torch.bfloat16)
    return nope_bytes, scale, rope


def dequantize(nope: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize`: nope ``[N, 448] u8``, scale ``[N, 7] u8``, rope ``[N, 64]``
    bf16 -> ``[N, 512]`` bf16.

    Straightforward exact formula (torch's e4m3fn and e8m0fnu casts; NaN bytes stay NaN).
    """
    n = nope.shape[0]
    vals = nope.view(torch.float8_e4m3fn).float().view(n, NUM_TILES, TILE_SIZE)
    s = scale.contiguous().view(torch.float8_e8m0fnu).float()
    vals = vals * s.unsqueeze(-1)
    return torch.cat([vals.view(n, NOPE_DIM), rope.float()], dim=-1).to(torch.bfloat16)


def quantize_and_insert(kv: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``kv`` and write each row into its cache slot, in place.

    Args:
        kv: ``[N, 512]`` bf16 (float16/float32 are rounded to bf16 first): 448 NoPE + 64 RoPE.
        cache: uint8 ``[num_blocks, B, 584]`` or ``[num_blocks, B, 1, 584]`` (see
            :func:`cache_layout`; padded ``stride(0)`` allowed).
        slot_mapping: int32/int64 ``[N]``, slot ``blk*B + t``; ``-1`` skips the row.

    Only the 584 bytes of each named slot (its 576 data bytes and 8 scale bytes) change.
    When a slot appears twice, which row wins is unspecified (as in vLLM).

    Raises:
        ValueError: bad shapes/dtypes/devices, or slot ids outside ``[-1, num_blocks*B)``.
    """
    layout = cache_layout(cache, "cache")
    _check_kv(kv, "kv")
    if kv.device != cache.device:
        raise ValueError(f"kv: expected device {cache.device} (the cache's), got {_describe(kv)}")
    _check_slots(slot_mapping, "slot_mapping", kv.shape[0], layout.num_slots, cache.device)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        kv = kv[keep]
        slot_mapping = slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    nope, scale, rope = quantize(kv)
    n = kv.shape[0]
    data_row = torch.cat([nope, rope.contiguous().view(torch.uint8)], dim=-1)  # [n, 576]
    scale_row = torch.cat([scale, scale.new_zeros(n, 1)], dim=-1)  # [n, 8]
    slots = slot_mapping.to(torch.int64)
    blk = torch.div(slots, layout.block_size, rounding_mode="floor")
    off = slots - blk * layout.block_size
    layout.data_view(cache)[blk, off] = data_row
    layout.scale_view(cache)[blk, off] = scale_row


def gather_dequant_into(
    out: torch.Tensor,
    cache: torch.Tensor,
    layout: CacheLayout,
    slots: torch.Tensor,
    invalid: torch.Tensor | None,
    *,
    rows_i64: torch.Tensor,
    tmp_i64: torch.Tensor,
    data_u8: torch.Tensor,
    scale_u8: torch.Tensor,
    scale_i32: torch.Tensor,
    flag_i32: torch.Tensor,
    views: tuple | None = None,
) -> None:
    """Gather and dequantize tokens into a caller buffer without allocating (hot path).

    Args:
        out: fp32 ``[*S, 512]``, last dim contiguous (may be a strided view).
        cache, layout: the cache and its :func:`cache_layout`.
        slots: int32/int64 ``[*S]`` slot ids; entries flagged in ``invalid`` may hold anything.
        invalid: bool ``[*S]`` or None; flagged rows are written as exact zeros and the bytes
            they would address are never read into ``out`` (NaN-poisoned slots stay out).
        rows_i64, tmp_i64: int64 ``[>= n]`` contiguous scratch, ``n = prod(S)``.
        data_u8: uint8 ``[>= n, 576]`` contiguous scratch; scale_u8: uint8 ``[>= n, 8]``.
        scale_i32: int32 contiguous scratch with ``>= 7 n`` elements; flag_i32: int32 0-dim.
        views: the result of ``layout.gather_row_views(cache)``, to reuse across calls.

    The e4m3 byte is decoded by bit manipulation (sign-extend to int32, shift by 20, mask):
    that is the fp32 number ``v * 2**-120`` exactly, subnormals included, and the scale byte
    ``e`` becomes the exact multiplier ``2**(e - 7)``. Exact for every scale byte; e4m3 NaN
    bytes (0x7F/0xFF, never written by :func:`quantize_and_insert`) decode as +-480*s.
    """
    shape = slots.shape
    n = slots.numel()
    if n == 0:
        return
    data_rows, d_blk, d_off, scale_rows, s_blk, s_base, s_off = (
        views if views is not None else layout.gather_row_views(cache)
    )
    bs = layout.block_size
    # The index math runs in the shape of ``slots`` (which may be a strided view) so that
    # nothing is reshaped (and copied); rows/tmp are contiguous and flattened for the gather.
    rows = rows_i64[:n].view(shape)
    tmp = tmp_i64[:n].view(shape)
    # Scale rows: blk*s_blk + s_base + off*s_off (invalid entries -> slot 0, zeroed below).
    torch.div(slots, bs, rounding_mode="floor", out=rows)
    torch.remainder(slots, bs, out=tmp)
    if invalid is not None:
        rows.masked_fill_(invalid, 0)
        tmp.masked_fill_(invalid, 0)
    tmp.mul_(s_off).add_(rows, alpha=s_blk).add_(s_base)
    torch.index_select(scale_rows, 0, tmp_i64[:n], out=scale_u8[:n])
    # Data rows: blk*d_blk + off*d_off.
    torch.remainder(slots, bs, out=tmp)
    if invalid is not None:
        tmp.masked_fill_(invalid, 0)
    rows.mul_(d_blk).add_(tmp, alpha=d_off)
    torch.index_select(data_rows, 0, rows_i64[:n], out=data_u8[:n])

    data = data_u8[:n].view(*shape, DATA_BYTES_PER_TOKEN)
    scl = scale_u8[:n].view(*shape, SCALE_BYTES_PER_TOKEN)[..., :NUM_TILES]
    scale_i32 = scale_i32[: n * NUM_TILES].view(*shape, NUM_TILES)
    nope_i = out[..., :NOPE_DIM].view(torch.int32)
    nope_i.copy_(data[..., :NOPE_DIM].view(torch.int8))
    nope_i.bitwise_left_shift_(20).bitwise_and_(_E4M3_IN_F32_MASK)

    scale_i32.copy_(scl)
    if invalid is not None:
        scale_i32.masked_fill_(invalid.unsqueeze(-1), 0)
    torch.amax(scale_i32.view(-1), 0, out=flag_i32)
    big = int(flag_i32) > _MAX_SINGLE_MULT_SCALE_BYTE
    if big:
        scale_i32.clamp_(max=_MAX_SINGLE_MULT_SCALE_BYTE)
    scale_i32.add_(120).bitwise_left_shift_(23)
    if invalid is not None:
        # Multiplier 0.0: the decoded e4m3 bits are always finite, so the row becomes 0.
        scale_i32.masked_fill_(invalid.unsqueeze(-1), 0)
    nope_f = out[..., :NOPE_DIM].unflatten(-1, (NUM_TILES, TILE_SIZE))
    nope_f.mul_(scale_i32.view(torch.float32).unsqueeze(-1))
    if big:
        # Remaining factor 2**(e - 134) for bytes above 134 (1.0 elsewhere).
        scale_i32.copy_(scl)
        scale_i32.sub_(_MAX_SINGLE_MULT_SCALE_BYTE).clamp_(min=0).add_(127)
        scale_i32.bitwise_left_shift_(23)
        nope_f.mul_(scale_i32.view(torch.float32).unsqueeze(-1))

    # bf16 -> fp32 is a 16-bit left shift of the bit pattern (faster than a float convert).
    rope_i = out[..., NOPE_DIM:].view(torch.int32)
    rope_i.copy_(data[..., NOPE_DIM:].view(torch.int16))
    rope_i.bitwise_left_shift_(16)
    if invalid is not None:
        out[..., NOPE_DIM:].masked_fill_(invalid.unsqueeze(-1), 0.0)


def dequantize_and_gather(
    cache: torch.Tensor, slots: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantize the named slots of a cache.

    Args:
        cache: uint8 ``[num_blocks, B, 584]`` or ``[num_blocks, B, 1, 584]`` (padded stride ok).
        slots: int32/int64 ``[M]`` slot ids ``blk*B + t``; ``-1`` gives a zero row.
        out: optional bf16 ``[M, 512]`` destination.

    Returns:
        bf16 ``[M, 512]``: 448 dequantized NoPE values + 64 RoPE values per slot.

    Raises:
        ValueError: bad shapes/dtypes/devices, or slot ids outside ``[-1, num_blocks*B)``.
    """
    layout = cache_layout(cache, "cache")
    _check_slots(slots, "slots", None, layout.num_slots, cache.device)
    m = slots.shape[0]
    if out is None:
        out = torch.empty(m, HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    elif out.shape != (m, HEAD_DIM) or out.dtype != torch.bfloat16 or out.device != cache.device:
        raise ValueError(
            f"out: expected shape ({m}, {HEAD_DIM}), dtype torch.bfloat16, device {cache.device}; "
            f"got {_describe(out)}"
        )
    if m == 0:
        return out
    dev = cache.device
    f32 = torch.empty(m, HEAD_DIM, dtype=torch.float32, device=dev)
    gather_dequant_into(
        f32,
        cache,
        layout,
        slots,
        slots < 0,
        rows_i64=torch.empty(m, dtype=torch.int64, device=dev),
        tmp_i64=torch.empty(m, dtype=torch.int64, device=dev),
        data_u8=torch.empty(m, DATA_BYTES_PER_TOKEN, dtype=torch.uint8, device=dev),
        scale_u8=torch.empty(m, SCALE_BYTES_PER_TOKEN, dtype=torch.uint8, device=dev),
        scale_i32=torch.empty(m * NUM_TILES, dtype=torch.int32, device=dev),
        flag_i32=torch.empty((), dtype=torch.int32, device=dev),
    )
    out.copy_(f32)
    return out
