# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Torch fallbacks for vLLM's DeepSeek-V4 C++ CPU ops missing from its AVX2 library.

vLLM 0.32's CPU wheel carries three kernel libraries and loads one by CPU
(``CpuPlatform.import_kernels``): ``_C`` (AVX512-BF16/AMX), ``_C_AVX512``
and ``_C_AVX2``. Only ``_C`` contains the DeepSeek-V4 kernels
(``csrc/cpu/sgl-kernels``: sparse MLA, cache stores, compressor, indexer,
mHC, router); loading it on a CPU without AVX512-BF16 dies with SIGILL. On
such a CPU vLLM's own DeepSeek-V4 CPU model therefore stops at its first
call (``torch.ops._C.convert_weight_packed`` while packing ``wo_a``).

:func:`register_missing` defines, in the ``_C`` namespace, a torch
implementation for each op of :data:`OPS` that the loaded library lacks,
with the C++ op's schema and call convention, so vLLM's unchanged
``DeepseekV4CPUAttention`` / compressor / indexer / mHC / router code runs.
Ops the library has are never touched, and nothing is registered when all
exist (AVX512-BF16 machines run vLLM's C++ kernels). It runs once, after
vLLM imported its kernels (the plugin arms it on the import of the
DeepSeek-V4 CPU model) and logs the list; :func:`registered` reports it.

The math comes from this package's torch ops (the oracle path of the
plugin): :mod:`~vllm_dsv4_backend.ops.torch_sparse_mla` (sparse MLA),
:mod:`~vllm_dsv4_backend.ops.rope` (q norm + RoPE + SWA insert, output
de-rotation), :mod:`~vllm_dsv4_backend.ops.compressor`,
:mod:`~vllm_dsv4_backend.ops.indexer`, and from vLLM's own torch references
(``mhc_pre_torch`` / ``mhc_post_torch``, copied op for op so this module
needs torch only); router and ``bmm`` are here.
Conventions that differ from the C++ kernels only in internal layout:
``convert_weight_packed`` returns a plain contiguous copy and
``bmm_cpu(..., is_vnni=True)`` consumes exactly that (the pair is only
used together, for ``wo_a``). Numerics are fp32 throughout, so results
agree with the C++ kernels to bf16 rounding, not bit for bit.

A process that registered fallbacks reports ``has_op(name) == True`` for
them; code that wants vLLM's real C++ kernel (tests comparing against it)
must check :func:`is_fallback`, or, without importing this module, the
``__vllm_dsv4_fallback__`` attribute (:data:`FALLBACK_FLAG`) of
``torch.ops._C.<name>``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_dsv4_backend._logging import init_logger
from vllm_dsv4_backend.ops import compressor

__all__ = [
    "FALLBACK_FLAG",
    "OPS",
    "is_fallback",
    "missing_ops",
    "register_missing",
    "registered",
    "router_with_shape_fallback",
]

logger = init_logger(__name__)

FALLBACK_FLAG = "__vllm_dsv4_fallback__"
_FP8_DS_MLA_BYTES = 584
_INDEXER_FP8_BYTES = 132
_C4_TOPK = 512  # topk_transform_512_cpu's fixed k (kC4Topk)

_lib: torch.library.Library | None = None
_registered: list[str] = []


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def _blocks_3d(
    cache_2d: torch.Tensor, block_size: int, entry_bytes: int, name: str
) -> torch.Tensor:
    """``[num_blocks, block_size, entry_bytes]`` byte view of vLLM's 2-D cache view.

    vLLM hands the kernels ``kv_cache.view(num_blocks, -1)``; its row stride is
    the (possibly padded) block stride. The bytes of a block are block-split
    (all values, then all scales), which the format modules decode from this
    shape.
    """
    if cache_2d.dim() != 2 or cache_2d.dtype != torch.uint8:
        raise ValueError(
            f"{name}: expected a 2-D uint8 cache view, got {tuple(cache_2d.shape)} {cache_2d.dtype}"
        )
    if cache_2d.shape[1] < block_size * entry_bytes:
        raise ValueError(
            f"{name}: expected rows of >= {block_size} * {entry_bytes} bytes, got "
            f"{tuple(cache_2d.shape)}"
        )
    return cache_2d.as_strided(
        (cache_2d.shape[0], block_size, entry_bytes),
        (cache_2d.stride(0), entry_bytes, 1),
        cache_2d.storage_offset(),
    )


def _softplus_sqrt(logits: torch.Tensor) -> torch.Tensor:
    # Same threshold as vLLM's dsv4_topk Triton kernel.
    x = logits.float()
    return torch.sqrt(torch.where(x > 20.0, x, torch.log1p(torch.exp(x))))


def _renorm(w: torch.Tensor, scale: float) -> torch.Tensor:
    s = w.sum(dim=-1, keepdim=True)
    return w * (scale / torch.where(s > 0, s, torch.ones_like(s)))


# ----------------------------------------------------------------------------
# implementations (signatures = the C++ ops')
# ----------------------------------------------------------------------------
def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` weight -> the layout :func:`bmm_cpu` reads (a contiguous copy)."""
    return weight.contiguous().clone()


def bmm_cpu(
    out: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    is_vnni: bool,
    scale: torch.Tensor | None,
) -> None:
    """``out[G, M, N] = mat1[G, M, K] @ mat2[G, N, K]^T`` (fp32 accumulation).

    ``mat2`` is :func:`convert_weight_packed`'s output when ``is_vnni``; an
    unpacked ``mat2`` is the same tensor here.
    """
    if scale is not None:
        raise NotImplementedError(
            "bmm_cpu fallback: FP8 scaled bmm is not implemented (scale must be None)"
        )
    if mat1.dim() != 3 or mat2.dim() != 3 or mat1.shape[0] != mat2.shape[0]:
        raise ValueError(
            f"bmm_cpu: expected mat1 [G, M, K] and mat2 [G, N, K], got "
            f"{tuple(mat1.shape)} and {tuple(mat2.shape)}"
        )
    res = torch.bmm(mat1.float(), mat2.float().transpose(1, 2))
    out.copy_(res)


def fused_qnorm_rope_kv_insert_cpu(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    swa_kv_cache_2d: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_head_padded: int,
    eps: float,
    cache_block_size: int,
) -> torch.Tensor:
    """q: weight-free RMSNorm + GPT-J RoPE -> ``[T, q_head_padded, 512]`` (pad heads 0);
    kv: GPT-J RoPE + fp8_ds_mla insert at ``slot_mapping`` (-1 skipped), with the C++
    writer's flush of fp8 subnormals to signed zero (:func:`_flush_fp8_subnormals`)."""
    from vllm_dsv4_backend.ops import rope

    num_tokens = q.shape[0]
    cache = _blocks_3d(swa_kv_cache_2d, cache_block_size, _FP8_DS_MLA_BYTES, "swa_kv_cache_2d")
    slots = slot_mapping
    if slots.shape[0] < num_tokens:  # DP padding: tokens without a slot are not stored
        slots = torch.cat([slots, slots.new_full((num_tokens - slots.shape[0],), -1)])
    out_q = q.new_empty((num_tokens, q_head_padded, q.shape[2]))
    res = rope.qnorm_rope_kv_insert(
        q, kv, positions, cache, slots, cos_sin_cache, eps, out_q=out_q
    )
    _flush_fp8_subnormals(swa_kv_cache_2d, kv[:num_tokens], slots[:num_tokens], cache_block_size)
    return res


def _flush_fp8_subnormals(
    cache_2d: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, block_size: int
) -> None:
    """Write signed zero for every NoPE value whose scaled magnitude is below e4m3's
    smallest normal (``2**-6``), in the entries just written at ``slots``.

    vLLM's C++ SWA writer flushes those to zero *before* rounding (so a value just
    below ``2**-6`` becomes ``-0``/``+0``, not the ``2**-6`` that round-to-nearest
    gives), where ``formats.fp8_ds_mla`` (the plugin's own writer) keeps fp8
    subnormals. This makes the fallback write the kernel's bytes (the golden
    calls of tests/core/test_golden_kernels.py). The NoPE values are ``kv``'s
    first 448 (RoPE touches only the last 64); entry ``t`` of a block row holds
    their fp8 bytes at ``[576 t, 576 t + 448)`` and its 7 tile-scale exponent
    bytes at ``[576 B + 8 t, 576 B + 8 t + 7)``.
    """
    rows = torch.nonzero(slots >= 0).squeeze(1)
    if rows.numel() == 0:
        return
    valid = slots[rows].long()
    blk = (valid // block_size).unsqueeze(1)
    tok = (valid % block_size).unsqueeze(1)
    dev = cache_2d.device
    val_cols = tok * 576 + torch.arange(448, device=dev).unsqueeze(0)
    scale_cols = 576 * block_size + tok * 8 + torch.arange(7, device=dev).unsqueeze(0)
    exps = cache_2d[blk, scale_cols].to(torch.int32) - 127  # [n, 7] tile exponents
    x = kv[rows, :448].float()
    scaled = x.view(-1, 7, 64) * torch.exp2(-exps.float()).unsqueeze(-1)
    tiny = (scaled.abs() < 2.0**-6).view(-1, 448)
    vals = cache_2d[blk.expand_as(val_cols), val_cols]
    signed_zero = torch.where(torch.signbit(x), 0x80, 0).to(torch.uint8)
    cache_2d[blk.expand_as(val_cols), val_cols] = torch.where(tiny, signed_zero, vals)


def inverse_gptj_rope_o_proj_cpu(
    o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """Undo the query RoPE on the last ``rope_dim`` dims of ``o`` ``[T, H, D]`` -> fp32."""
    from vllm_dsv4_backend.ops import rope

    if cos_sin_cache.shape[-1] != rope_dim:
        raise ValueError(
            f"cos_sin_cache: expected last dim rope_dim={rope_dim}, got "
            f"{tuple(cos_sin_cache.shape)}"
        )
    return rope.inverse_rope_(o, positions, cos_sin_cache)


def flash_mla_with_kvcache_cpu(
    out: torch.Tensor,
    q: torch.Tensor,
    window_cache_2d: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache_2d: torch.Tensor,
    compressed_slots: torch.Tensor,
    compressed_block_size: int,
    attn_sink: torch.Tensor,
    scale: float,
) -> None:
    """Sparse MLA over the SWA window slots and the compressed slots, one softmax
    with the sink: ``out[T, H, 512]``. Slots ``< 0`` or past the cache are skipped."""
    from vllm_dsv4_backend.ops import torch_sparse_mla

    def as_indices(slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        num_slots = cache.shape[0] * cache.shape[1]
        bad = (slots < 0) | (slots >= num_slots)
        return torch.where(bad, torch.full_like(slots, -1), slots).to(torch.int32).unsqueeze(1)

    win = _blocks_3d(window_cache_2d, window_block_size, _FP8_DS_MLA_BYTES, "window_cache_2d")
    idx = as_indices(window_slots, win)
    extra = extra_idx = None
    if compressed_slots.shape[-1] > 0:
        extra = _blocks_3d(
            compressed_cache_2d, compressed_block_size, _FP8_DS_MLA_BYTES, "compressed_cache_2d"
        )
        extra_idx = as_indices(compressed_slots, extra)
    q4 = q.unsqueeze(1)
    out4 = out.unsqueeze(1)
    sink = attn_sink.float()
    torch_sparse_mla.sparse_mla_decode(
        q4, win, idx, None, sink, scale, extra, extra_idx, None, out=out4, need_lse=False
    )


# The compressor ops of ops.compressor take the C++ ops' arguments: registered as they are.
save_partial_states_cpu = compressor.save_partial_states
compress_norm_rope_store_cpu = compressor.compress_norm_rope_store_main
compress_norm_rope_store_indexer_cpu = functools.partial(
    compressor.compress_norm_rope_store, indexer_kv_dtype="fp8"
)


def _mhc_pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    rms_eps: float,
    hc_pre_eps: float,
    hc_sinkhorn_eps: float,
    hc_post_mult_value: float,
    sinkhorn_repeat: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM 0.32's ``mhc_pre_torch`` (``model_executor/kernels/mhc/torch.py``), op
    for op, so the result is unchanged; copied so this module needs torch only
    (the golden-kernel tests run it where vLLM is not importable).

    Returns ``(post [T, hc, 1] f32, comb [T, hc, hc] f32, layer_input [T, d])``.
    """
    hc_mult = residual.shape[-2]
    hidden_size = residual.shape[-1]
    residual_flat = residual.view(-1, hc_mult, hidden_size)
    num_tokens = residual_flat.shape[0]
    x = residual_flat.view(num_tokens, hc_mult * hidden_size).to(torch.float32)
    mixes = torch.matmul(x, fn.t())
    sqrsum = x.square().sum(dim=-1, keepdim=True)
    mixes = mixes * torch.rsqrt(sqrsum / (hc_mult * hidden_size) + rms_eps)

    pre_logits = mixes[:, :hc_mult] * hc_scale[0] + hc_base[:hc_mult]
    pre_mix = torch.sigmoid(pre_logits) + hc_pre_eps
    post_logits = (
        mixes[:, hc_mult : 2 * hc_mult] * hc_scale[1] + hc_base[hc_mult : 2 * hc_mult]
    )
    post_mix = torch.sigmoid(post_logits) * hc_post_mult_value
    comb_logits = mixes[:, 2 * hc_mult :].view(num_tokens, hc_mult, hc_mult) * hc_scale[
        2
    ] + hc_base[2 * hc_mult :].view(1, hc_mult, hc_mult)
    comb_mix = torch.softmax(comb_logits, dim=-1) + hc_sinkhorn_eps
    comb_mix = comb_mix / (comb_mix.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
    for _ in range(sinkhorn_repeat - 1):
        comb_mix = comb_mix / (comb_mix.sum(dim=-1, keepdim=True) + hc_sinkhorn_eps)
        comb_mix = comb_mix / (comb_mix.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
    layer_input = torch.sum(pre_mix.unsqueeze(-1) * residual_flat.to(torch.float32), dim=1).to(
        residual.dtype
    )
    return (
        post_mix.view(num_tokens, hc_mult, 1),
        comb_mix.view(num_tokens, hc_mult, hc_mult),
        layer_input.view(num_tokens, hidden_size),
    )


def hc_pre_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int,
    sinkhorn_iters: int,
    rms_eps: float,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre: ``(layer_input [T, d] bf16, post [T, hc] f32, comb [T, hc, hc] f32)``.

    vLLM's ``mhc_pre_torch`` (:func:`_mhc_pre`) with the C++ op's conventions:
    one ``hc_eps`` for the pre and Sinkhorn epsilons and a post multiplier of 2.
    """
    if x.dim() != 3 or x.shape[1] != hc_mult:
        raise ValueError(f"x: expected [T, hc_mult={hc_mult}, d], got {tuple(x.shape)}")
    post, comb, layer_input = _mhc_pre(
        x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps, hc_eps, 2.0, sinkhorn_iters
    )
    return layer_input.contiguous(), post.reshape(x.shape[0], hc_mult).contiguous(), comb


def hc_post_fused_cpu(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """mHC post: ``comb^T @ residual + post * x`` -> ``[T, hc, d]`` in residual's dtype
    (vLLM 0.32's ``mhc_post_torch``, op for op)."""
    mixed_residual = torch.einsum(
        "...ij,...ih->...jh", comb.to(torch.float32), residual.to(torch.float32)
    )
    post_term = post.unsqueeze(-1).to(torch.float32) * x.unsqueeze(-2).to(torch.float32)
    return (mixed_residual + post_term).to(residual.dtype)


def hc_head_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """HC head: gates ``sigmoid(rmsnorm(x_flat) @ fn^T * scale + base) + hc_eps``,
    ``out = sum_i gate_i * x_i`` -> ``[T, d]`` in x's dtype (vLLM's Triton reference)."""
    t, hc, d = x.shape
    xf = x.reshape(t, hc * d).float()
    xn = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    gates = torch.sigmoid((xn @ hc_fn.float().t()) * hc_scale.float() + hc_base.float()) + hc_eps
    out = (gates.unsqueeze(-1) * x.float()).sum(dim=1)
    return out.to(x.dtype)


def biased_topk_cpu(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    scoring_func: str,
    num_fused_shared_experts: int,
    routed_scaling_factor: float | None,
    apply_routed_scaling_factor_on_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 noaux_tc routing: ``w = sqrt(softplus(logit))``, pick the top-k of
    ``w + bias`` (ties: lower expert id), return the unbiased ``w`` (renormalized,
    times the scaling factor) ``[T, k]`` f32 and ids ``[T, k]`` int32."""
    if scoring_func != "sqrtsoftplus":
        raise NotImplementedError(
            f"biased_topk_cpu fallback: scoring_func {scoring_func!r} (only sqrtsoftplus)"
        )
    if num_fused_shared_experts != 0:
        raise NotImplementedError("biased_topk_cpu fallback: fused shared experts")
    w = _softplus_sqrt(gating_output)
    key = w + correction_bias.float().unsqueeze(0)
    key = torch.where(torch.isnan(key), torch.full_like(key, -1e30), key)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = w.gather(1, order)
    if renormalize:
        scale = (
            routed_scaling_factor
            if apply_routed_scaling_factor_on_output and routed_scaling_factor
            else 1.0
        )
        weights = _renorm(weights, scale)
    elif apply_routed_scaling_factor_on_output and routed_scaling_factor:
        weights = weights * routed_scaling_factor
    return weights.float().contiguous(), order.to(torch.int32).contiguous()


def hash_topk_cpu(
    gating_output: torch.Tensor,
    tid2eid: torch.Tensor,
    topk: int,
    scoring_func: str,
    num_fused_shared_experts: int,
    num_experts: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing: experts ``tid2eid[t, :k]``, weights ``sqrt(softplus(logit))`` of
    those experts renormalized to ``routed_scaling_factor``."""
    if scoring_func != "sqrtsoftplus":
        raise NotImplementedError(
            f"hash_topk_cpu fallback: scoring_func {scoring_func!r} (only sqrtsoftplus)"
        )
    if num_fused_shared_experts != 0:
        raise NotImplementedError("hash_topk_cpu fallback: fused shared experts")
    ids = tid2eid[:, :topk].to(torch.int64)
    if bool(((ids < 0) | (ids >= num_experts)).any()):
        raise ValueError(f"tid2eid: expert ids must lie in [0, {num_experts})")
    weights = _renorm(_softplus_sqrt(gating_output).gather(1, ids), routed_scaling_factor)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def fused_indexer_q_rope_quant_cpu(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_q_fp8: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    index_weights_out: torch.Tensor,
) -> None:
    """Indexer q: GPT-J RoPE + per-(token, head) FP8 quant; q scale folded into weights."""
    from vllm_dsv4_backend.ops import indexer

    indexer.indexer_q_rope_quant(
        index_q,
        positions,
        index_q_cos_sin_cache,
        index_weights,
        softmax_scale=index_weights_softmax_scale,
        head_scale=index_weights_head_scale,
        dtype="fp8",
        out=(index_q_fp8, None, index_weights_out),
    )


def fp8_paged_mqa_logits_cpu(
    q_fp8: torch.Tensor,
    kvcache_fp8: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Indexer logits ``[T, max_seq_len]`` f32 over the paged FP8 132 B indexer cache."""
    from vllm_dsv4_backend.ops import indexer

    cache = _blocks_3d(kvcache_fp8, block_size, _INDEXER_FP8_BYTES, "kvcache_fp8")
    return indexer.indexer_logits(
        q_fp8, None, weight, cache, seq_lens, page_table, dtype="fp8", max_seq_len=max_seq_len
    )


def topk_transform_512_cpu(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: torch.Tensor | None,
) -> None:
    """Causal top-512 of ``scores``: local ids into ``out_raw_indices``, global slots
    (via the per-token ``page_tables``) into ``out_page_indices``.

    The C++ kernel's selection, ties included (``indexer.indexer_topk``: its
    streaming-heap rule); the order within a row is score descending rather
    than the kernel's heap order. Like the kernel: always 512 entries (columns
    past 512 of wider outputs are left alone), ``seq_lens`` clamped to
    ``[0, scores.shape[1]]``, rows with ``seq_len <= 512`` are ``0..seq_len-1``
    then -1, and ``page = page_tables[t, j >> log2(page_size)] * page_size +
    (j & (page_size - 1))`` (a page id past the table, which the kernel would
    read out of bounds, gives -1).
    """
    from vllm_dsv4_backend.ops import indexer

    if out_page_indices.dim() != 2 or out_page_indices.shape[1] < _C4_TOPK:
        raise ValueError(
            f"out_page_indices: expected [T, >= {_C4_TOPK}], got {tuple(out_page_indices.shape)}"
        )
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a positive power of 2, got {page_size}")
    local = indexer.indexer_topk(scores, None, _C4_TOPK, seq_lens=seq_lens)
    if out_raw_indices is not None:
        out_raw_indices[:, :_C4_TOPK].copy_(local)
    j = local.long()
    page_idx = j.clamp(min=0) // page_size
    ok = (j >= 0) & (page_idx < page_tables.shape[1])
    if page_tables.shape[1] == 0:
        out_page_indices[:, :_C4_TOPK].fill_(-1)
        return
    rows = torch.arange(local.shape[0], device=local.device).unsqueeze(1)
    pages = page_tables[rows, page_idx.clamp(max=page_tables.shape[1] - 1)].long()
    glob = pages * page_size + (j & (page_size - 1))
    out_page_indices[:, :_C4_TOPK].copy_(glob.masked_fill_(~ok, -1))


@dataclass(frozen=True)
class FallbackOp:
    name: str
    schema: str
    impl: Callable


OPS: tuple[FallbackOp, ...] = (
    FallbackOp("convert_weight_packed", "(Tensor weight) -> Tensor", convert_weight_packed),
    FallbackOp(
        "bmm_cpu",
        "(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()",
        bmm_cpu,
    ),
    FallbackOp(
        "fused_qnorm_rope_kv_insert_cpu",
        "(Tensor q, Tensor kv, Tensor positions, Tensor(a!) swa_kv_cache_2d, "
        "Tensor slot_mapping, Tensor cos_sin_cache, int q_head_padded, float eps, "
        "int cache_block_size) -> Tensor",
        fused_qnorm_rope_kv_insert_cpu,
    ),
    FallbackOp(
        "inverse_gptj_rope_o_proj_cpu",
        "(Tensor o, Tensor positions, Tensor cos_sin_cache, int rope_dim) -> Tensor",
        inverse_gptj_rope_o_proj_cpu,
    ),
    FallbackOp(
        "flash_mla_with_kvcache_cpu",
        "(Tensor(a!) out, Tensor q, Tensor window_cache_2d, Tensor window_slots, "
        "int window_block_size, Tensor compressed_cache_2d, Tensor compressed_slots, "
        "int compressed_block_size, Tensor attn_sink, float scale) -> ()",
        flash_mla_with_kvcache_cpu,
    ),
    FallbackOp(
        "save_partial_states_cpu",
        "(Tensor kv, Tensor score, Tensor ape, Tensor positions, Tensor(a!) state_cache, "
        "Tensor slot_mapping) -> ()",
        save_partial_states_cpu,
    ),
    FallbackOp(
        "compress_norm_rope_store_cpu",
        "(Tensor state_cache, Tensor gather_slots, Tensor positions, Tensor kv_slot_mapping, "
        "Tensor rms_norm_weight, float rms_norm_eps, Tensor cos_sin_cache, "
        "Tensor(a!) kv_cache_2d, int kv_cache_block_size, int compress_ratio) -> ()",
        compress_norm_rope_store_cpu,
    ),
    FallbackOp(
        "compress_norm_rope_store_indexer_cpu",
        "(Tensor state_cache, Tensor gather_slots, Tensor positions, Tensor kv_slot_mapping, "
        "Tensor rms_norm_weight, float rms_norm_eps, Tensor cos_sin_cache, "
        "Tensor(a!) kv_cache_2d, int kv_cache_block_size, int compress_ratio) -> ()",
        compress_norm_rope_store_indexer_cpu,
    ),
    FallbackOp(
        "hc_pre_fused_cpu",
        "(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, int hc_mult, "
        "int sinkhorn_iters, float rms_eps, float hc_eps) -> (Tensor, Tensor, Tensor)",
        hc_pre_fused_cpu,
    ),
    FallbackOp(
        "hc_post_fused_cpu",
        "(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
        hc_post_fused_cpu,
    ),
    FallbackOp(
        "hc_head_fused_cpu",
        "(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, float hc_eps, "
        "float norm_eps) -> Tensor",
        hc_head_fused_cpu,
    ),
    FallbackOp(
        "biased_topk_cpu",
        "(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, int topk, "
        "bool renormalize, str scoring_func, int num_fused_shared_experts, "
        "float? routed_scaling_factor, bool apply_routed_scaling_factor_on_output) "
        "-> (Tensor, Tensor)",
        biased_topk_cpu,
    ),
    FallbackOp(
        "hash_topk_cpu",
        "(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
        "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) "
        "-> (Tensor, Tensor)",
        hash_topk_cpu,
    ),
    FallbackOp(
        "fused_indexer_q_rope_quant_cpu",
        "(Tensor positions, Tensor index_q, Tensor index_q_cos_sin_cache, "
        "Tensor(a!) index_q_fp8, Tensor index_weights, float index_weights_softmax_scale, "
        "float index_weights_head_scale, Tensor(b!) index_weights_out) -> ()",
        fused_indexer_q_rope_quant_cpu,
    ),
    FallbackOp(
        "fp8_paged_mqa_logits_cpu",
        "(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, Tensor seq_lens, "
        "Tensor page_table, int block_size, int max_seq_len) -> Tensor",
        fp8_paged_mqa_logits_cpu,
    ),
    FallbackOp(
        "topk_transform_512_cpu",
        "(Tensor scores, Tensor seq_lens, Tensor page_tables, Tensor(a!) out_page_indices, "
        "int page_size, Tensor(b!)? out_raw_indices) -> ()",
        topk_transform_512_cpu,
    ),
)


# ---------------------------------------------------------------------------------------
# router shapes vLLM's AVX512 kernels refuse (patch router_expert_counts)
# ---------------------------------------------------------------------------------------
def _router_key(name: str, args: tuple) -> tuple[int, int]:
    # (num_experts, top_k) from the op's positional arguments (cpu_router passes them so)
    if name == "hash_topk_cpu":
        return int(args[0].shape[1]), int(args[2])
    return int(args[1].shape[1]), int(args[3])


def router_with_shape_fallback(name: str, real: Callable) -> Callable:
    """``real`` (vLLM's ``hash_topk_cpu`` / ``biased_topk_cpu``, the SGLang AVX512 ports)
    for the expert counts and top-k it takes; this module's torch version of the op for
    the ones it refuses ("<op>: unsupported ...", raised before it computes anything),
    with one WARNING per refused shape. vLLM 0.32's kernels take DeepSeek's expert counts
    only (64 or more); a DeepSeek-V4 with fewer experts (the trained tiny model: 4, top
    2) would otherwise stop at its first MoE layer."""
    impl = {"hash_topk_cpu": hash_topk_cpu, "biased_topk_cpu": biased_topk_cpu}[name]
    refused: set[tuple[int, int]] = set()

    @functools.wraps(real)
    def route(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        key = _router_key(name, args)
        if key not in refused:
            try:
                return real(*args)
            except RuntimeError as e:
                if not str(e).startswith(f"{name}: unsupported"):
                    raise
                refused.add(key)
                logger.warning(
                    "vLLM's %s refuses num_experts=%d, top_k=%d (%s); the plugin's torch "
                    "%s routes this model's MoE (patch router_expert_counts)",
                    name, key[0], key[1], e, name,
                )
        return impl(*args)  # type: ignore[operator]

    route.__vllm_dsv4_refused__ = refused  # type: ignore[attr-defined]
    return route


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops._C, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def missing_ops() -> list[str]:
    """Ops of :data:`OPS` that ``torch.ops._C`` does not provide in this process."""
    return [op.name for op in OPS if not _has_op(op.name)]


def registered() -> list[str]:
    """Fallbacks this process registered."""
    return list(_registered)


def is_fallback(name: str) -> bool:
    """True if ``torch.ops._C.<name>`` is one of our torch fallbacks in this process."""
    return name in _registered


def register_missing() -> list[str]:
    """Register a torch fallback for every missing op (idempotent); return their names.

    Call only after vLLM loaded its kernel library (``vllm._custom_ops`` import):
    registering first would make the real library's registration fail.
    """
    global _lib
    todo = [op for op in OPS if op.name not in _registered and not _has_op(op.name)]
    if not todo:
        return []
    if _lib is None:
        _lib = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901
    for op in todo:
        _lib.define(op.name + op.schema)
        _lib.impl(op.name, op.impl, "CPU")
        _registered.append(op.name)
        # Torch-only code (e.g. ops.vllm_cpu) can tell a fallback from vLLM's
        # kernel without importing this module: getattr(packet, FALLBACK_FLAG).
        setattr(getattr(torch.ops._C, op.name), FALLBACK_FLAG, True)
    logger.warning(
        "vLLM's loaded CPU kernel library lacks %d DeepSeek-V4 ops (it is not the "
        "AVX512-BF16 build): registered vllm_dsv4_backend torch fallbacks for %s",
        len(todo),
        ", ".join(op.name for op in todo),
    )
    return [op.name for op in todo]
