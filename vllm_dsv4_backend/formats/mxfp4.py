# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MXFP4: e2m1 values with one UE8M0 (power-of-two) scale per 32 values.

This is the byte format of DeepSeek-V4's lightning-indexer K cache and Q when
vLLM runs with ``use_fp4_indexer_cache=True`` (the 68 B/entry cache), and of
the reference model's ``fp4_act_quant`` QAT. Torch only; never imports vLLM.

Layout of ``quantize(x)`` for ``x[..., D]`` (``D % 32 == 0``):

- ``packed``: ``[..., D // 2]`` uint8. Byte ``k`` holds element ``2k`` in the
  **low** nibble and element ``2k + 1`` in the high nibble (the order of PTX
  ``cvt.rn.satfinite.e2m1x2.f32 d, hi, lo`` as vLLM's kernels call it).
- ``scale_exp``: ``[..., D // 32]`` uint8. Block ``b`` covers elements
  ``[32b, 32b + 32)``; the byte is ``e + 127`` for the scale ``2**e``.

A nibble is ``sign << 3 | code``; ``code`` indexes the e2m1 magnitudes
``(0, 0.5, 1, 1.5, 2, 3, 4, 6)``.

Encoding rules (bit-exact; what ``tests/core/test_mxfp4.py`` checks against a
scalar float64 oracle):

- ``amax = max(|x|)`` over the block, floored at ``6 * 2**-126``;
  ``e = clamp(ceil(log2(amax / 6)), -127, 127)``. ``e`` is computed exactly
  from the float32 bits (smallest ``e`` with ``amax <= 6 * 2**e``), not with a
  float ``log2``, which can round ``ceil`` down when ``amax / 6`` lies one ulp
  above a power of two. The floor makes ``e >= -126``; only an infinite
  ``amax`` reaches ``e = 127``.
- ``x / 2**e`` (exact: a power-of-two division) is rounded to the nearest e2m1
  value, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
  2.5 -> 2, 3.5 -> 4, 5 -> 4), and magnitudes above 6 saturate to 6.
- The sign is kept on zero results: ``-0.0`` and negative values that round
  to zero encode as ``0x8`` (IEEE rounding keeps the sign; so does PTX's cvt).
- ``+-inf`` saturates to ``+-6 * 2**127`` (scale byte 254); the finite values
  of that block flush to (signed) zero.
- **NaN**: a block holding any NaN gets scale byte ``0xFF``, the OCP MX
  encoding of a NaN scale, and ``dequantize`` returns NaN for all 32 values
  of such a block: a poisoned input never turns into finite numbers. The
  nibbles of a NaN block are still written (NaN elements encode as code 7);
  their value is unspecified.

``dequantize`` is exact: ``value(nibble) * 2**(byte - 127)`` in float32 (byte
0 gives the subnormal ``2**-127``; ``6 * 2**127`` overflows to ``inf``).
"""

from __future__ import annotations

import torch

from vllm_dsv4_backend._checks import describe

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "NAN_SCALE_BYTE",
    "SCALE_BIAS",
    "dequantize",
    "e2m1_codes",
    "quantize",
    "ue8m0_exponent",
]

BLOCK_SIZE = 32
SCALE_BIAS = 127
NAN_SCALE_BYTE = 0xFF
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_AMAX_FLOOR = 6.0 * 2.0**-126

_const_cache: dict[tuple[str, torch.device], torch.Tensor] = {}


def _const(name: str, device: torch.device) -> torch.Tensor:
    """Small per-device lookup tables, built once (no per-call allocation)."""
    key = (name, device)
    t = _const_cache.get(key)
    if t is None:
        if name == "values":
            mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
            t = torch.cat([mags, -mags])
        elif name == "scales":
            # 2**(b - 127) for every byte b; 0 -> subnormal 2**-127, 255 -> NaN.
            exps = torch.arange(256, dtype=torch.float64) - SCALE_BIAS
            t = torch.pow(2.0, exps).to(torch.float32)
            t[NAN_SCALE_BYTE] = float("nan")
        else:  # pragma: no cover - internal misuse
            raise KeyError(name)
        t = t.to(device)
        _const_cache[key] = t
    return t


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Exact MXFP4 block exponent for non-negative block maxima.

    Args:
        amax: ``[...]`` float32, ``max(|x|)`` per block (NaN allowed).

    Returns:
        ``[...]`` int32 ``e = clamp(ceil(log2(max(amax, 6*2**-126) / 6)),
        -127, 127)``; NaN maps to 127 (callers mark NaN blocks separately).
    """
    a = amax.clamp_min(_AMAX_FLOOR)
    bits = a.view(torch.int32)
    exp_field = bits >> 23
    mant = bits & 0x7FFFFF
    # a = (1 + f) * 2**(exp_field - 127) <= 6 * 2**e = 1.5 * 2**(e + 2)
    # holds for e = exp_field - 129 iff f <= 0.5, else for one more.
    e = exp_field - 129 + (mant > 0x400000).to(torch.int32)
    e.masked_fill_(exp_field == 255, 127)  # inf (and NaN) saturate the scale
    return e.clamp_(-127, 127)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to e2m1 nibbles (RNE, saturating at 6).

    Args:
        y: ``[...]`` float32 values in units of the block scale.

    Returns:
        ``[...]`` uint8 nibbles ``sign << 3 | code`` (NaN -> ``sign << 3 | 7``).
    """
    mag = y.abs()
    # Grid spacing is 0.5 below 2, 1 in [2, 4) and 2 from 4 on, and there the code
    # is round(mag / spacing) + (0, 2, 4). torch.round ties to the even integer and
    # the offsets are even, so ties land on the even code (RNE). The scalings by 2,
    # 1, 0.5 are exact; the clamp saturates at code 7 (6.0).
    # (Arithmetic on the two masks rather than torch.where with Python scalars,
    # which would create scalar tensors on every call.)
    below2 = (mag < 2).to(torch.float32)
    below4 = (mag < 4).to(torch.float32)
    inv_step = below4.mul(0.5).add_(below2).add_(0.5)  # 2, 1, 0.5
    offset = below4.add_(below2).mul_(-2.0).add_(4.0)  # 0, 2, 4
    code = torch.round(mag * inv_step).add_(offset).clamp_(max=7)
    code.masked_fill_(torch.isnan(mag), 7)  # NaN compares false everywhere above
    code = code.to(torch.uint8)
    sign = torch.signbit(y).to(torch.uint8) << 3
    return code | sign


def _check_float_input(name: str, x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"mxfp4.{name}: argument 'x' expected dtype float32, bfloat16 or float16, "
            f"got {describe(x)}"
        )
    if x.dim() < 1 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"mxfp4.{name}: argument 'x' expected shape [..., D] with D a multiple of "
            f"{BLOCK_SIZE}, got {describe(x)}"
        )


def quantize(
    x: torch.Tensor,
    *,
    out_packed: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP4 (blocks of 32 along the last dim).

    Args:
        x: ``[..., D]`` float32 / bfloat16 / float16, ``D % 32 == 0``.
        out_packed: optional ``[..., D // 2]`` uint8 buffer to write.
        out_scale: optional ``[..., D // 32]`` uint8 buffer to write.

    Returns:
        ``(packed, scale_exp)``: ``[..., D // 2]`` uint8 (element ``2k`` in the
        low nibble of byte ``k``) and ``[..., D // 32]`` uint8 (``e + 127``,
        ``0xFF`` for a block holding NaN). See the module docstring for the
        exact rounding rules.

    Raises:
        ValueError: wrong dtype, ``D`` not a multiple of 32, or an ``out_*``
            buffer of the wrong shape, dtype or device.
    """
    _check_float_input("quantize", x)
    lead = tuple(x.shape[:-1])
    d = x.shape[-1]
    nblk = d // BLOCK_SIZE
    for name, buf, shape in (
        ("out_packed", out_packed, (*lead, d // 2)),
        ("out_scale", out_scale, (*lead, nblk)),
    ):
        if buf is not None and (
            tuple(buf.shape) != shape or buf.dtype != torch.uint8 or buf.device != x.device
        ):
            raise ValueError(
                f"mxfp4.quantize: argument '{name}' expected shape {list(shape)} dtype "
                f"torch.uint8 on {x.device}, got {describe(buf)}"
            )

    xb = x.to(torch.float32).reshape(*lead, nblk, BLOCK_SIZE)
    amax = xb.abs().amax(dim=-1)
    e = ue8m0_exponent(amax)
    # 2**e from its float32 bits: e is in [-126, 127], all normal numbers.
    scale = ((e + SCALE_BIAS) << 23).view(torch.float32)
    codes = e2m1_codes(xb / scale.unsqueeze(-1))
    codes = codes.reshape(*lead, d // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)

    scale_byte = (e + SCALE_BIAS).to(torch.uint8)
    scale_byte.masked_fill_(torch.isnan(amax), NAN_SCALE_BYTE)

    if out_packed is None:
        out_packed = packed
    else:
        out_packed.copy_(packed)
    if out_scale is None:
        out_scale = scale_byte
    else:
        out_scale.copy_(scale_byte)
    return out_packed, out_scale


def dequantize(
    packed: torch.Tensor,
    scale_exp: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize MXFP4 to float32 (exact).

    Args:
        packed: ``[..., D // 2]`` uint8, element ``2k`` in the low nibble.
        scale_exp: ``[..., D // 32]`` uint8 UE8M0 bytes (``0xFF`` = NaN block).
        out: optional ``[..., D]`` float32 buffer to write.

    Returns:
        ``[..., D]`` float32 ``e2m1(nibble) * 2**(byte - 127)``.

    Raises:
        ValueError: dtypes other than uint8, mismatched leading shapes, a
            ``packed`` width that is not ``16 * scale_exp`` width, devices that
            differ, or a bad ``out``.
    """
    if packed.dtype != torch.uint8 or packed.dim() < 1:
        raise ValueError(
            f"mxfp4.dequantize: argument 'packed' expected dtype torch.uint8 with shape "
            f"[..., D // 2], got {describe(packed)}"
        )
    nblk = packed.shape[-1] * 2 // BLOCK_SIZE
    expected_scale = (*packed.shape[:-1], nblk)
    if packed.shape[-1] % (BLOCK_SIZE // 2) != 0 or (
        scale_exp.dtype != torch.uint8
        or tuple(scale_exp.shape) != expected_scale
        or scale_exp.device != packed.device
    ):
        raise ValueError(
            f"mxfp4.dequantize: argument 'scale_exp' expected shape {list(expected_scale)} "
            f"dtype torch.uint8 on {packed.device} (packed width a multiple of "
            f"{BLOCK_SIZE // 2}), got {describe(scale_exp)} for packed {describe(packed)}"
        )
    lead = tuple(packed.shape[:-1])
    d = packed.shape[-1] * 2
    if out is not None and (
        tuple(out.shape) != (*lead, d)
        or out.dtype != torch.float32
        or out.device != packed.device
    ):
        raise ValueError(
            f"mxfp4.dequantize: argument 'out' expected shape {[*lead, d]} dtype "
            f"torch.float32 on {packed.device}, got {describe(out)}"
        )
    dev = packed.device
    values = _const("values", dev)
    scales = _const("scales", dev)
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    pair = torch.stack([values[lo], values[hi]], dim=-1)
    pair = pair.reshape(*lead, nblk, BLOCK_SIZE)
    s = scales[scale_exp.long()].unsqueeze(-1)
    if out is None:
        return (pair * s).reshape(*lead, d)
    torch.mul(pair, s, out=out.view(*lead, nblk, BLOCK_SIZE))
    return out
