# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared argument validation for the sparse MLA ops (torch only).

Every check raises ``ValueError`` naming the argument and giving the expected and received
shape / dtype / device (FlashInfer ``check_shape_dtype_device`` style). :func:`check_tensor`
is the package's one tensor check (defined in ``vllm_dsv4_backend._checks`` so the
``formats`` layer below can use it too). The generic checks
(:func:`check_decode_args`, :func:`check_prefill_args`) are FlashMLA's interface contract,
the same for the torch path and the adapter to vLLM's C++ CPU kernel.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_dsv4_backend._checks import check_tensor, describe
from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.formats.fp8_ds_mla import CacheLayout

__all__ = [
    "HEAD_DIM",
    "DecodeDims",
    "PrefillDims",
    "check_decode_args",
    "check_decode_index_range",
    "check_int32_slots",
    "check_prefill_args",
    "check_shape_dtype_device",
    "check_tensor",
    "describe",
]

HEAD_DIM = fp8_ds_mla.HEAD_DIM  # 512 = d_qk = d_v
INT32_MAX = 2**31 - 1


def check_int32_slots(where: str, slots: torch.Tensor, block_size: int) -> None:
    """Raise ``ValueError`` if a global slot id (``block_id * block_size + offset``,
    computed in int64) does not fit FlashMLA's int32 ``indices``.

    Copying such an id into an int32 table would wrap it to another slot, or to a
    negative (skipped) one, without a word. Only block ids ``>= 2**31 / block_size``
    (33.5M blocks of 64 entries) get there, far past any cache that fits in memory,
    so this is one reduction per table, not a practical limit.
    """
    if slots.numel() and int(slots.max()) > INT32_MAX:
        raise ValueError(
            f"{where}: global slot id {int(slots.max())} (block id * block_size {block_size} "
            f"+ offset) does not fit FlashMLA's int32 indices (max {INT32_MAX}): the block "
            f"table names a block id above {INT32_MAX // block_size}"
        )


def check_shape_dtype_device(
    t: object,
    name: str,
    shape: Sequence[int | None] | None,
    dtype: torch.dtype | Sequence[torch.dtype] | None,
    device: torch.device | None,
    *,
    shape_doc: str | None = None,
) -> torch.Tensor:
    """FlashInfer-style positional form of :func:`check_tensor` (``None`` in ``shape`` is a
    wildcard)."""
    return check_tensor(name, t, shape=shape, dtype=dtype, device=device, shape_doc=shape_doc)


def _check_index_dtype(t: object, name: str) -> None:
    if isinstance(t, torch.Tensor) and t.dtype == torch.int64:
        raise ValueError(
            f"{name}: int32 is required (FlashMLA's index dtype), got dtype torch.int64 "
            f"with shape {list(t.shape)}; convert with .to(torch.int32)"
        )


def _check_cache(cache: object, name: str, device: torch.device) -> CacheLayout:
    layout = fp8_ds_mla.cache_layout(cache, name)  # type: ignore[arg-type]
    if cache.device != device:  # type: ignore[union-attr]
        raise ValueError(
            f"{name}: expected device {device} (q's), got {describe(cache)}"  # type: ignore[arg-type]
        )
    return layout


def _check_scale(softmax_scale: object, name: str) -> float:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise ValueError(f"{name}: expected a Python float, got {type(softmax_scale).__name__}")
    return float(softmax_scale)


@dataclass(frozen=True)
class DecodeDims:
    """Validated sizes of a decode call.

    ``layout`` / ``extra_layout`` are the caches' ``fp8_ds_mla.CacheLayout`` (``extra_layout``
    None without an extra cache; then ``extra_topk == 0``).
    """

    batch: int
    s_q: int
    h_q: int
    topk: int
    extra_topk: int
    layout: CacheLayout
    extra_layout: CacheLayout | None
    softmax_scale: float


def check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    softmax_scale: float,
    extra_k_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_topk_length: torch.Tensor | None,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
) -> DecodeDims:
    """Validate ``sparse_mla_decode`` arguments Does not read index values.

    Expected: q bf16 ``[b, s_q, h_q, 512]``; caches uint8 fp8_ds_mla ``[nb, B, (1,) 584]``;
    indices int32 ``[b, s_q, topk]``; topk_length int32 ``[b]``; attn_sink fp32 ``[h_q]``;
    extra_indices int32 ``[b, s_q, extra_topk]`` (given iff extra_k_cache is);
    extra_topk_length int32 ``[b]`` (only with an extra cache); out bf16 ``[b, s_q, h_q, 512]``;
    lse_out fp32 ``[b, h_q, s_q]``. Everything on q's device.
    """
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    dev = q.device
    check_shape_dtype_device(
        q, "q", (None, None, None, HEAD_DIM), torch.bfloat16, dev,
        shape_doc=f"[b, s_q, h_q, {HEAD_DIM}]",
    )
    b, s_q, h_q = (int(x) for x in q.shape[:3])
    layout = _check_cache(k_cache, "k_cache", dev)
    _check_index_dtype(indices, "indices")
    check_shape_dtype_device(
        indices, "indices", (b, s_q, None), torch.int32, dev, shape_doc=f"[{b}, {s_q}, topk]"
    )
    topk = int(indices.shape[2])
    if topk_length is not None:
        _check_index_dtype(topk_length, "topk_length")
        check_shape_dtype_device(topk_length, "topk_length", (b,), torch.int32, dev)
    if attn_sink is not None:
        check_shape_dtype_device(attn_sink, "attn_sink", (h_q,), torch.float32, dev)
    scale = _check_scale(softmax_scale, "softmax_scale")

    extra_layout = None
    extra_topk = 0
    if (extra_k_cache is None) != (extra_indices is None):
        raise ValueError(
            "extra_k_cache / extra_indices: expected both or neither; got "
            f"extra_k_cache={'None' if extra_k_cache is None else 'tensor'}, "
            f"extra_indices={'None' if extra_indices is None else 'tensor'}"
        )
    if extra_k_cache is not None:
        extra_layout = _check_cache(extra_k_cache, "extra_k_cache", dev)
        _check_index_dtype(extra_indices, "extra_indices")
        check_shape_dtype_device(
            extra_indices, "extra_indices", (b, s_q, None), torch.int32, dev,
            shape_doc=f"[{b}, {s_q}, extra_topk]",
        )
        extra_topk = int(extra_indices.shape[2])  # type: ignore[union-attr]
    if extra_topk_length is not None:
        if extra_k_cache is None:
            raise ValueError(
                "extra_topk_length: expected None without extra_k_cache, got a tensor with "
                + describe(extra_topk_length)
            )
        _check_index_dtype(extra_topk_length, "extra_topk_length")
        check_shape_dtype_device(extra_topk_length, "extra_topk_length", (b,), torch.int32, dev)
    if out is not None:
        check_shape_dtype_device(out, "out", (b, s_q, h_q, HEAD_DIM), torch.bfloat16, dev)
    if lse_out is not None:
        check_shape_dtype_device(lse_out, "lse_out", (b, h_q, s_q), torch.float32, dev)
    return DecodeDims(b, s_q, h_q, topk, extra_topk, layout, extra_layout, scale)


def check_decode_index_range(
    indices: torch.Tensor, topk_length: torch.Tensor | None, num_slots: int, name: str
) -> None:
    """Raise ``ValueError`` if a used index is ``< -1`` or ``>= num_slots``.

    "Used" means the first ``topk_length[b]`` entries of each row (all when None); FlashMLA
    never reads the rest, so garbage there is allowed. One vectorized pass plus one host
    sync (FlashMLA itself does not check).
    """
    if indices.numel() == 0:
        return
    bad = (indices < -1) | (indices >= num_slots)
    if topk_length is not None:
        pos = torch.arange(indices.shape[-1], device=indices.device)
        bad &= pos < topk_length.view(-1, *([1] * (indices.dim() - 1)))
    if bool(bad.any()):
        vals = indices[bad]
        raise ValueError(
            f"{name}: expected slot ids in [-1, {num_slots}) (num_blocks * block_size; only -1 "
            f"is invalid), got {int(vals.numel())} out-of-range value(s), e.g. "
            f"{vals[:4].tolist()}"
        )


@dataclass(frozen=True)
class PrefillDims:
    """Validated sizes of a prefill call."""

    s_q: int
    h_q: int
    s_kv: int
    topk: int
    sm_scale: float


def check_prefill_args(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    out: torch.Tensor | None,
    max_logits_out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
) -> PrefillDims:
    """Validate ``sparse_mla_prefill`` arguments.

    Expected: q bf16 ``[s_q, h_q, 512]``; kv bf16 ``[s_kv, 1, 512]``; indices int32
    ``[s_q, 1, topk]``; attn_sink fp32 ``[h_q]``; topk_length int32 ``[s_q]``; out bf16
    ``[s_q, h_q, 512]``; max_logits_out / lse_out fp32 ``[s_q, h_q]``; all on q's device.
    """
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    dev = q.device
    check_shape_dtype_device(
        q, "q", (None, None, HEAD_DIM), torch.bfloat16, dev, shape_doc=f"[s_q, h_q, {HEAD_DIM}]"
    )
    s_q, h_q = int(q.shape[0]), int(q.shape[1])
    check_shape_dtype_device(
        kv, "kv", (None, 1, HEAD_DIM), torch.bfloat16, dev, shape_doc=f"[s_kv, 1, {HEAD_DIM}]"
    )
    _check_index_dtype(indices, "indices")
    check_shape_dtype_device(
        indices, "indices", (s_q, 1, None), torch.int32, dev, shape_doc=f"[{s_q}, 1, topk]"
    )
    if attn_sink is not None:
        check_shape_dtype_device(attn_sink, "attn_sink", (h_q,), torch.float32, dev)
    if topk_length is not None:
        _check_index_dtype(topk_length, "topk_length")
        check_shape_dtype_device(topk_length, "topk_length", (s_q,), torch.int32, dev)
    scale = _check_scale(sm_scale, "sm_scale")
    if out is not None:
        check_shape_dtype_device(out, "out", (s_q, h_q, HEAD_DIM), torch.bfloat16, dev)
    if max_logits_out is not None:
        check_shape_dtype_device(max_logits_out, "max_logits_out", (s_q, h_q), torch.float32, dev)
    if lse_out is not None:
        check_shape_dtype_device(lse_out, "lse_out", (s_q, h_q), torch.float32, dev)
    return PrefillDims(s_q, h_q, int(kv.shape[0]), int(indices.shape[2]), scale)
