# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashMLA CUDA path (sparse decode over fp8_ds_mla, sparse prefill over bf16 KV).

Sources, tried in order, imported lazily and guarded (this module imports fine without CUDA,
vLLM or FlashMLA):

1. vLLM's bundled FlashMLA, ``vllm.v1.attention.ops.flashmla`` (wraps ``vllm._flashmla_C``,
   built from the vllm-project/FlashMLA fork with the MODEL1/584 B kernels; adds ``out=``).
   This is exactly what vLLM's own FLASHMLA_SPARSE_DSV4 backend calls.
2. The ``flash_mla`` package (upstream <= 2026-09-30, ``tokenspeed-flashmla``, or
   ``sgl-flash-mla`` called with ``use_legacy=True``, detected from the signature).

Requirements (checked by :func:`~vllm_dsv4_backend.ops.checks.check_flashmla_decode`):
SM90 or SM100, h_q in {64, 128}, topk multiples of 64, int32 indices, the cache block stride a
multiple of 576 B on SM100. FlashMLA does not range-check indices; neither does this path.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_dsv4_backend.ops.checks import DecodeInputs, PrefillInputs

__all__ = ["FlashMLAFns", "available", "load", "sparse_mla_decode_flashmla",
           "sparse_mla_prefill_flashmla"]


@dataclass(frozen=True)
class FlashMLAFns:
    """The resolved FlashMLA entry points and what their signatures accept."""

    source: str
    with_kvcache: Callable
    sparse_fwd: Callable
    get_metadata: Callable
    decode_params: frozenset[str]
    prefill_params: frozenset[str]


def _params(fn: Callable) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


@functools.lru_cache(maxsize=1)
def load() -> tuple[FlashMLAFns | None, str]:
    """Resolve FlashMLA; returns ``(fns, reason)`` with ``fns`` None when unavailable."""
    reasons = []
    try:
        m = importlib.import_module("vllm.v1.attention.ops.flashmla")
        ok, why = m.is_flashmla_sparse_supported()
        if ok:
            fns = FlashMLAFns(
                "vllm.v1.attention.ops.flashmla", m.flash_mla_with_kvcache,
                m.flash_mla_sparse_fwd, m.get_mla_metadata,
                _params(m.flash_mla_with_kvcache), _params(m.flash_mla_sparse_fwd),
            )
            return fns, "vLLM's bundled FlashMLA"
        reasons.append(f"vLLM's bundled FlashMLA: {why}")
    except Exception as e:  # noqa: BLE001 - any import failure means "not this source"
        reasons.append(f"vllm.v1.attention.ops.flashmla: {e!r}")
    try:
        m = importlib.import_module("flash_mla")
        fns = FlashMLAFns(
            "flash_mla", m.flash_mla_with_kvcache, m.flash_mla_sparse_fwd, m.get_mla_metadata,
            _params(m.flash_mla_with_kvcache), _params(m.flash_mla_sparse_fwd),
        )
        return fns, "flash_mla package"
    except Exception as e:  # noqa: BLE001
        reasons.append(f"flash_mla: {e!r}")
    return None, "; ".join(reasons)


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def available(device: torch.device) -> tuple[bool, str]:
    """Whether FlashMLA can serve a call on ``device`` (CUDA SM90/SM100 with a build)."""
    if device.type != "cuda":
        return False, f"FlashMLA needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return False, "torch.cuda is not available"
    cap = _capability(device)
    if cap is None or cap[0] not in (9, 10):
        return False, f"FlashMLA sparse kernels need SM90 or SM100, device has capability {cap}"
    fns, reason = load()
    return (fns is not None), reason


def capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA capability of ``device`` (None off CUDA)."""
    return _capability(device)


def _sched_meta(fns: FlashMLAFns) -> object:
    # Upstream/vLLM: get_mla_metadata() -> (FlashMLASchedMeta(), None); planning happens on
    # the first flash_mla_with_kvcache call that uses the holder.
    return fns.get_metadata()[0]


def _cache_4d(cache: torch.Tensor) -> torch.Tensor:
    # FlashMLA takes an fp8_ds_mla cache as [num_blocks, B, 1, 584]; the 3-D form gets the axis.
    return cache if cache.dim() == 4 else cache.unsqueeze(-2)


def sparse_mla_decode_flashmla(
    call: DecodeInputs,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    sched_meta: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_mla_with_kvcache`` in sparse fp8 mode on ``call``'s inputs (validated for
    FlashMLA).

    ``sched_meta``: a ``FlashMLASchedMeta`` to reuse across same-shaped calls in one step
    (FlashMLA plans on first use); a fresh one is made when None.
    Returns ``(out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q] fp32)``.
    """
    fns, reason = load()
    if fns is None:
        raise RuntimeError(f"flashmla kernel path unavailable: {reason}")
    k4 = _cache_4d(call.k_cache)
    e4 = None if call.extra_k_cache is None else _cache_4d(call.extra_k_cache)
    kwargs = dict(
        q=call.q, k_cache=k4, block_table=None, cache_seqlens=None, head_dim_v=512,
        tile_scheduler_metadata=sched_meta if sched_meta is not None else _sched_meta(fns),
        softmax_scale=call.dims.softmax_scale, causal=False, is_fp8_kvcache=True,
        indices=call.indices, attn_sink=call.attn_sink, extra_k_cache=e4,
        extra_indices_in_kvcache=call.extra_indices, topk_length=call.topk_length,
        extra_topk_length=call.extra_topk_length,
    )
    if "use_legacy" in fns.decode_params:
        kwargs["use_legacy"] = True
    pass_out = out is not None and "out" in fns.decode_params and out.is_contiguous()
    if pass_out:
        kwargs["out"] = out
    res = fns.with_kvcache(
        **{k: v for k, v in kwargs.items() if not fns.decode_params or k in fns.decode_params}
    )
    o, lse = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
    if out is not None and o.data_ptr() != out.data_ptr():
        out.copy_(o)
        o = out
    if lse_out is not None and lse is not None:
        lse_out.copy_(lse)
        lse = lse_out
    return o, lse


def sparse_mla_prefill_flashmla(
    call: PrefillInputs,
    *,
    out: torch.Tensor | None = None,
    max_logits_out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flash_mla_sparse_fwd`` on ``call``'s inputs (validated for FlashMLA).

    Returns ``(out [s_q, h_q, 512] bf16, max_logits [s_q, h_q], lse [s_q, h_q])`` fp32,
    natural units.
    """
    fns, reason = load()
    if fns is None:
        raise RuntimeError(f"flashmla kernel path unavailable: {reason}")
    p = fns.prefill_params
    kwargs = dict(q=call.q, kv=call.kv, indices=call.indices, sm_scale=call.dims.sm_scale,
                  d_v=512, attn_sink=call.attn_sink, topk_length=call.topk_length)
    if "use_legacy" in p:
        kwargs["use_legacy"] = True
    if "return_log2_lse" in p:
        kwargs["return_log2_lse"] = None  # natural-log stats
    if "return_softmax_lse" in p:
        kwargs["return_softmax_lse"] = True
    if "return_stats" in p:
        kwargs["return_stats"] = True
    if out is not None and "out" in p and out.is_contiguous():
        kwargs["out"] = out
    res = fns.sparse_fwd(**{k: v for k, v in kwargs.items() if k in p or not p})
    if not isinstance(res, tuple) or len(res) < 3 or res[1] is None or res[2] is None:
        raise RuntimeError(
            f"{fns.source}.flash_mla_sparse_fwd did not return (out, max_logits, lse); got "
            f"{type(res).__name__}"
        )
    o, ml, lse = res[0], res[1], res[2]
    if out is not None and o.data_ptr() != out.data_ptr():
        out.copy_(o)
        o = out
    if max_logits_out is not None:
        max_logits_out.copy_(ml)
        ml = max_logits_out
    if lse_out is not None:
        lse_out.copy_(lse)
        lse = lse_out
    return o, ml, lse
