# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-V4 main-attention q/kv preparation and output de-rotation (torch only).

RoPE here is GPT-J style (interleaved pairs) on the **last** ``R`` dims with
vLLM's ``cos_sin_cache[pos] = [cos_0..cos_{R/2-1}, sin_0..sin_{R/2-1}]``
(``R = 64`` for DeepSeek-V4), computed in float32.
"""

from __future__ import annotations

import torch

from vllm_dsv4_backend.formats import fp8_ds_mla


def _cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    cs = cos_sin_cache.index_select(0, positions.long()).float()
    half = cs.shape[-1] // 2
    return cs[:, None, :half], cs[:, None, half:]


def gptj_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
               ) -> None:
    """Rotate ``x`` ``[T, H, R]`` float32 in place by ``+pos`` (or ``-pos``).

    ``cos``/``sin``: ``[T, 1, R/2]`` float32 (see :func:`_cos_sin`).
    """
    pairs = x.unflatten(-1, (-1, 2))
    xe, xo = pairs[..., 0].clone(), pairs[..., 1]
    s = -sin if inverse else sin
    pairs[..., 0].copy_(xe * cos - xo * s)
    pairs[..., 1].copy_(xo * cos + xe * s)


def gptj_rope_fma_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` ``[..., R]`` float32 in place by ``+pos`` with vLLM's CPU kernels' rounding.

    The C++ kernels (compressor store, indexer q quant) compute ``fma(x_e, cos, -(x_o*sin))``
    and ``fma(x_o, cos, x_e*sin)`` in float32. float64 reproduces that FMA for float32
    operands: the product is exact there and the sum is rounded once more to float32 (a double
    rounding that differs from the FMA only at exact float32 midpoints).

    ``cos``/``sin``: float32, broadcastable to ``[..., R/2]``.
    """
    pairs = x.unflatten(-1, (-1, 2))
    xe, xo = pairs[..., 0], pairs[..., 1]
    c64 = cos.double()
    new_e = xe.double().mul_(c64).sub_((xo * sin).double())
    new_o = xo.double().mul_(c64).add_((xe * sin).double())
    xe.copy_(new_e)
    xo.copy_(new_o)


def qnorm_rope_kv_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    swa_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    *,
    out_q: torch.Tensor,
) -> torch.Tensor:
    """Torch equivalent of vLLM's ``fused_qnorm_rope_kv_insert_cpu``.

    Q side: per-head RMSNorm without weight, GPT-J RoPE on the last
    ``R`` dims, written to ``out_q[:, :H]`` with pad heads ``out_q[:, H:]`` zero.
    KV side: GPT-J RoPE on the last ``R`` dims, then fp8_ds_mla quantize and
    insert at ``slot_mapping`` (-1 skipped).

    Args:
        q: ``[T, H, 512]`` bf16.
        kv: ``[T, 512]`` bf16 (448 NoPE + 64 RoPE), already kv-normed.
        positions: ``[T]`` int64.
        swa_cache: fp8_ds_mla cache ``[num_blocks, B, 584]`` (padded stride ok).
        slot_mapping: ``[>=T]`` int32/int64 SWA slots.
        cos_sin_cache: ``[max_pos, R]`` float32/bf16.
        eps: RMSNorm epsilon.
        out_q: ``[>=T, Hp, 512]`` bf16, ``Hp >= H``.

    Returns:
        ``out_q[:T]``.
    """
    num_tokens, heads, dim = q.shape
    if out_q.shape[0] < num_tokens or out_q.shape[1] < heads or out_q.shape[2] != dim:
        raise ValueError(
            f"out_q: expected [>={num_tokens}, >={heads}, {dim}], got {tuple(out_q.shape)}"
        )
    cos, sin = _cos_sin(cos_sin_cache, positions[:num_tokens])
    rope_dim = cos.shape[-1] * 2
    qf = q.float()
    qf = qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + eps)
    gptj_rope_(qf[..., dim - rope_dim:], cos, sin)
    out = out_q[:num_tokens]
    out[:, :heads].copy_(qf)
    if out.shape[1] > heads:
        out[:, heads:].zero_()

    kvf = kv[:num_tokens].float()
    gptj_rope_(kvf[:, None, dim - rope_dim:], cos, sin)
    fp8_ds_mla.quantize_and_insert(kvf.to(torch.bfloat16), swa_cache,
                                   slot_mapping[:num_tokens])
    return out


def inverse_rope_(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
                  ) -> torch.Tensor:
    """Undo the query's RoPE on attention outputs ``o`` ``[T, H, D]`` (last
    ``R`` dims), returning a float32 copy: V carries the keys' rotation, and
    ``wo_a`` expects position-free features."""
    cos, sin = _cos_sin(cos_sin_cache, positions[: o.shape[0]])
    rope_dim = cos.shape[-1] * 2
    of = o.to(torch.float32, copy=True)
    gptj_rope_(of[..., o.shape[-1] - rope_dim:], cos, sin, inverse=True)
    return of
