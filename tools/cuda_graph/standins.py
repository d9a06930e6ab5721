# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Torch stand-ins for vLLM's CUDA-only kernels, for the CUDA-graph harness.

``build_stub.py`` copies this file into the generated stand-in ``vllm``
package as ``vllm/_harness_standins.py``; vLLM's cut bodies and wrappers, and
the plugin's adapter (``layer.cuda_kernels.VllmCudaKernels``), reach it through
the recording kernel objects of ``recording.py`` (bound to the real kernels'
signatures), so vLLM's layer and the plugin's compute the same bits from the
same inputs.

Every stand-in really computes (RoPE, ue8m0/e4m3 quantization, the indexer
scores and top-k, the windowed compressor with RMSNorm and RoPE, sparse MLA
attention with a sink over fp8_ds_mla entries) and is **free of host syncs**
(no ``.item()``, ``nonzero`` or data-dependent shapes), so it can be captured
into a CUDA graph. That is why the plugin's own torch ops are used only where
they are sync-free (``ops.indexer.local_to_global``,
``formats.fp8_ds_mla.quantize``/``dequantize``): the others validate their
inputs on the host (e.g. ``ops/compressor.py`` ``bool((slots >= capacity).any())``,
``ops/torch_sparse_mla.py`` ``minmax.tolist()``, ``ops/indexer.py``
``int(positions.min())``), which CUDA-graph capture forbids.

Simplifications (both layers share them, so they cannot hide a difference
between the two): a cache entry is a row of 584 bytes
(``[448 e4m3 | 64 bf16 RoPE | 7 ue8m0 | pad]``) rather than FlashMLA's
block-interleaved layout; the indexer K cache holds fp32 rows; the
compressor's softmax pools the first ``head_dim`` columns of its state rows.
Negative slot ids are redirected to the cache's last row (a trash row no
index ever reads), which keeps every store sync-free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_dsv4_backend.formats import fp8_ds_mla, mxfp4
from vllm_dsv4_backend.ops import indexer as indexer_ops

ENTRY_BYTES = 584
FP8_MAX = 448.0

# Negative control (b): a deliberately wrong stand-in (the indexer top-k
# shifted by one entry).
FAULTS: dict[str, bool] = {"topk_off_by_one": False}
# Consumers nap this many GPU cycles first (torch.cuda._sleep) when > 0.
SLOW: dict[str, int] = {"cycles": 0}

# Allocation bookkeeping: a callable returning a context manager that the
# harness uses to measure (and exclude) what the stand-in kernels allocate.
_MEASURE: list[Callable[[], Any]] = []


# Adversarial micro-batch interleaving: when on, a micro-batch thread also
# hands over to the other just before the output projection reads the
# attention output (vLLM's hand-over points are the MoE all-to-all only), so
# the other micro-batch runs a whole attention layer while this one's output
# is still to be read. The only point inside the layer where vLLM's own
# layer stays correct: before it, the layer's events and the model-wide
# top-k buffer are shared by the micro-batches.
YIELD_BEFORE_O_PROJ: dict[str, bool] = {"on": False}


def maybe_yield_before_o_proj() -> None:
    if YIELD_BEFORE_O_PROJ["on"]:
        from vllm.v1.worker.ubatching import dbo_yield

        dbo_yield()


@contextlib.contextmanager
def kernel_region() -> Iterator[None]:
    """Marks a stand-in *kernel* body (its temporaries are not the layer's)."""
    if _MEASURE:
        with _MEASURE[0]():
            yield
    else:
        yield


def nap(t: torch.Tensor) -> None:
    """Make the consumer slow (CUDA only): a producer that is not fenced
    off then overwrites the bytes while they are being read."""
    if SLOW["cycles"] and t.is_cuda:
        torch.cuda._sleep(SLOW["cycles"])


# --- helpers -----------------------------------------------------------------------


def slots_or_trash(slots: torch.Tensor, num_rows: int) -> torch.Tensor:
    s = slots.to(torch.int64)
    return torch.where(s >= 0, s, torch.full_like(s, num_rows - 1))


def rope_last(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved) RoPE on the last ``R`` dims, ``R = cos_sin.shape[1]``;
    ``x`` is ``[T, ..., D]`` fp32, ``positions`` ``[T]``."""
    r = cos_sin.shape[1]
    cs = cos_sin.index_select(0, positions.to(torch.int64)).float()
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [r // 2]
    cos, sin = cs[:, : r // 2].reshape(shape), cs[:, r // 2 :].reshape(shape)
    head = x[..., : x.shape[-1] - r]
    pairs = x[..., x.shape[-1] - r :].unflatten(-1, (r // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([head, rot], dim=-1)


def output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           fill: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The one allocation a real op makes (its output, counted as the
    layer's), filled by a stand-in computation (its temporaries are not)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    with kernel_region():
        out.copy_(fill())
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` accumulated in fp32 as a broadcast product and a sum: the same
    bits in eager mode and in a CUDA graph whatever the buffers' alignment (a
    cuBLAS GEMM may pick another algorithm), on any device."""
    return output((a.shape[0], b.shape[1]), out_dtype, a.device,
                  lambda: (a.float()[:, :, None] * b.float()[None, :, :]).sum(1))


def mm_out_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch.mm(a, b, out_dtype=...)`` (CUDA-only in torch)."""
    return matmul(a, b, out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


def ds_store(cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantize ``kv`` ``[n, 512]`` to fp8_ds_mla fields and write row ``slots``."""
    rows = cache.view(-1, ENTRY_BYTES)
    n = kv.shape[0]
    nope, scale, rope = fp8_ds_mla.quantize(kv)
    entry = torch.cat(
        [nope, rope.contiguous().view(torch.uint8).view(n, 128), scale,
         torch.zeros(n, 1, dtype=torch.uint8, device=kv.device)], dim=1)
    rows.index_copy_(0, slots_or_trash(slots, rows.shape[0]), entry)


def ds_load(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` (any shape, clamped at 0) dequantized: ``[*slots, 512]`` fp32."""
    rows = cache.view(-1, ENTRY_BYTES)
    flat = slots.reshape(-1).to(torch.int64).clamp(min=0)
    e = rows.index_select(0, flat)
    n = e.shape[0]
    kv = fp8_ds_mla.dequantize(e[:, :448], e[:, 576:583],
                               e[:, 448:576].contiguous().view(torch.bfloat16).view(n, 64))
    return kv.float().view(*slots.shape, 512)


def sparse_attn(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, Any]],
                scale: float, sink: torch.Tensor | None) -> torch.Tensor:
    """Sparse MLA with a sink: ``q`` ``[N, H, 512]``; each part is (fp8_ds_mla
    cache, ``[N, k]`` slot ids with -1 = none, ``[N]`` valid lengths or None).
    Returns ``[N, H, 512]`` bf16."""
    keys, masks = [], []
    for cache, idx, lens in parts:
        idx = idx.reshape(q.shape[0], -1)
        valid = idx >= 0
        if lens is not None:
            ar = torch.arange(idx.shape[1], device=idx.device)
            valid = valid & (ar[None, :] < lens.reshape(-1, 1))
        keys.append(ds_load(cache, idx))
        masks.append(valid)
    k = torch.cat(keys, dim=1)
    mask = torch.cat(masks, dim=1)
    logits = (q.float()[:, :, None, :] * k[:, None, :, :]).sum(-1) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    s = sink.float().view(1, -1) if sink is not None else torch.full(
        (1, q.shape[1]), float("-inf"), device=q.device)
    m = torch.maximum(logits.amax(-1), s)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m[..., None])
    denom = p.sum(-1) + torch.exp(s - m)
    out = (p[..., None] * k[:, None, :, :]).sum(2) / denom.clamp_min(1e-30)[..., None]
    return out.to(torch.bfloat16)


# --- FlashMLA ------------------------------------------------------------------------


def flash_mla_with_kvcache(*, q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                           topk_length: torch.Tensor | None, softmax_scale: float,
                           attn_sink: torch.Tensor | None, out: torch.Tensor,
                           extra_k_cache: torch.Tensor | None = None,
                           extra_indices_in_kvcache: torch.Tensor | None = None,
                           extra_topk_length: torch.Tensor | None = None,
                           **_: Any) -> tuple[torch.Tensor, None]:
    """FlashMLA sparse decode: ``q`` ``[b, 1, H, 512]`` into ``out``."""
    b, _s, h, d = q.shape
    nap(indices)
    with kernel_region():
        parts: list[tuple[torch.Tensor, torch.Tensor, Any]] = [(k_cache, indices, topk_length)]
        if extra_k_cache is not None:
            assert extra_indices_in_kvcache is not None
            nap(extra_indices_in_kvcache)
            parts.append((extra_k_cache, extra_indices_in_kvcache, extra_topk_length))
        res = sparse_attn(q.reshape(b, h, d), parts, softmax_scale, attn_sink)
        out.view(b, h, d).copy_(res)
    return out, None


# --- indexer -------------------------------------------------------------------------


def indexer_q_fp8(*, positions: torch.Tensor, q: torch.Tensor, cos_sin_cache: torch.Tensor,
                  weights: torch.Tensor, weights_softmax_scale: float,
                  weights_head_scale: float, q_fp8: torch.Tensor,
                  weights_out: torch.Tensor) -> None:
    """Index q RoPE + per-(token, head) ue8m0 scale + e4m3; scale folded into
    the head weights (the rule of ``ops.indexer.indexer_q_rope_quant``)."""
    with kernel_region():
        x = rope_last(q.float(), positions, cos_sin_cache).to(torch.bfloat16).float()
        amax = x.abs().amax(-1).clamp_min(1e-4) / FP8_MAX
        mant, ex = torch.frexp(amax)
        e = ex - (mant == 0.5).to(ex.dtype)
        scale = torch.ldexp(torch.ones_like(amax), e)
        q_fp8.copy_((x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        weights_out.copy_(((weights.float() * scale) * weights_softmax_scale)
                          * weights_head_scale)


def indexer_q_fp8_triton(*, positions: torch.Tensor, index_q: torch.Tensor,
                         index_q_cos_sin_cache: torch.Tensor, index_weights: torch.Tensor,
                         index_weights_softmax_scale: float, index_weights_head_scale: float,
                         index_q_fp8: torch.Tensor, index_weights_out: torch.Tensor,
                         fp8_max: float, use_fnuz: bool) -> None:
    """``_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL`` (e4m3fn only)."""
    if use_fnuz or fp8_max != FP8_MAX or index_q_fp8.dtype != torch.float8_e4m3fn:
        raise NotImplementedError("the harness stands for the CUDA e4m3fn build")
    indexer_q_fp8(positions=positions, q=index_q, cos_sin_cache=index_q_cos_sin_cache,
                  weights=index_weights, weights_softmax_scale=index_weights_softmax_scale,
                  weights_head_scale=index_weights_head_scale, q_fp8=index_q_fp8,
                  weights_out=index_weights_out)


def indexer_q_fp8_cutedsl(*, positions: torch.Tensor, q: torch.Tensor,
                          cos_sin_cache: torch.Tensor, weights: torch.Tensor,
                          weights_softmax_scale: float, weights_head_scale: float,
                          q_fp8: torch.Tensor, weights_out: torch.Tensor) -> None:
    """``_INDEXER_Q_FP8_KERNEL``: takes the e4m3 bytes as ``uint8`` (vLLM's
    wrapper passes ``q_fp8.view(torch.uint8)``)."""
    if q_fp8.dtype != torch.uint8:
        from vllm._harness_recording import ContractError

        raise ContractError(f"_INDEXER_Q_FP8_KERNEL: q_fp8 must be uint8 bytes, got {q_fp8.dtype}")
    indexer_q_fp8(positions=positions, q=q, cos_sin_cache=cos_sin_cache, weights=weights,
                  weights_softmax_scale=weights_softmax_scale,
                  weights_head_scale=weights_head_scale,
                  q_fp8=q_fp8.view(torch.float8_e4m3fn), weights_out=weights_out)


def indexer_q_mxfp4(*, positions: torch.Tensor, q: torch.Tensor, cos_sin_cache: torch.Tensor,
                    weights: torch.Tensor, weights_softmax_scale: float,
                    weights_head_scale: float, q_packed: torch.Tensor, q_scale: torch.Tensor,
                    weights_out: torch.Tensor) -> None:
    """Index q RoPE + MXFP4 (blocks of 32, ue8m0 scale bytes; the rounding of
    ``formats.mxfp4``); the head weights carry only the softmax and head
    scales (vLLM's wrapper: per-block scales cannot fold into a weight)."""
    from vllm._harness_recording import ContractError

    for name, t in (("q_packed", q_packed), ("q_scale", q_scale)):
        if t.dtype != torch.uint8:
            raise ContractError(f"MXFP4 index q kernel: {name} must be uint8, got {t.dtype}")
    with kernel_region():
        x = rope_last(q.float(), positions, cos_sin_cache).to(torch.bfloat16).float()
        mxfp4.quantize(x, out_packed=q_packed, out_scale=q_scale)
        weights_out.copy_((weights.float() * weights_softmax_scale) * weights_head_scale)


def indexer_q_mxfp4_triton(*, positions: torch.Tensor, index_q: torch.Tensor,
                           index_q_cos_sin_cache: torch.Tensor, index_weights: torch.Tensor,
                           index_weights_softmax_scale: float,
                           index_weights_head_scale: float, index_q_packed: torch.Tensor,
                           index_q_scale: torch.Tensor, index_weights_out: torch.Tensor
                           ) -> None:
    """``_FUSED_INDEXER_Q_ROPE_MXFP4_TRITON_KERNEL``."""
    indexer_q_mxfp4(positions=positions, q=index_q, cos_sin_cache=index_q_cos_sin_cache,
                    weights=index_weights, weights_softmax_scale=index_weights_softmax_scale,
                    weights_head_scale=index_weights_head_scale, q_packed=index_q_packed,
                    q_scale=index_q_scale, weights_out=index_weights_out)


def store_full_kv(**_: Any) -> None:
    raise NotImplementedError("store_full_kv (plain-row caches): not part of the harness")


class IndexerOp:
    """vLLM's ``SparseAttnIndexer`` (DeepGEMM MQA logits + top-k): scores
    ``sum_h w[t,h] relu(q[t,h] . k[j])`` over the token's compressed indexer
    K entries ``j < (pos + 1) // ratio``, top-k by score into the model's
    ``topk_indices_buffer`` as local ids (-1 = none)."""

    def __init__(self, k_cache: Any, topk_indices_buffer: torch.Tensor, topk: int,
                 compress_ratio: int) -> None:
        self.k_cache = k_cache
        self.topk_indices_buffer = topk_indices_buffer
        self.topk = topk
        self.compress_ratio = compress_ratio

    def __call__(self, hidden_states: torch.Tensor, q_quant: Any, k: Any,
                 weights: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return self.topk_indices_buffer  # a dummy run (MRV1's capture): nothing to score
        md = attn_metadata[self.k_cache.prefix]
        q = q_quant[0] if isinstance(q_quant, tuple) else q_quant
        nap(q)
        with kernel_region():
            if isinstance(q_quant, tuple):
                # MXFP4: packed values [T, H, D/2] and the four ue8m0 scale bytes
                # of each (token, head) as one int32 [T, H] (vLLM's wrapper).
                packed, scale = q_quant
                q = mxfp4.dequantize(packed, scale.contiguous().view(torch.uint8)
                                     .view(*packed.shape[:-1], -1))
            t = q.shape[0]
            width = md.max_compressed  # host int, fixed per batch shape
            rows = self.k_cache.kv_cache.view(-1, q.shape[-1])
            ar = torch.arange(width, device=q.device)
            bs = md.block_size
            bt = md.block_table.index_select(0, md.token_to_req_indices[:t].to(torch.int64))
            blk = bt.gather(1, (ar // bs).clamp(max=bt.shape[1] - 1)[None, :].expand(t, -1)
                            .to(torch.int64))
            slots = blk.to(torch.int64) * bs + (ar % bs)[None, :]
            keys = rows.index_select(0, slots.reshape(-1)).view(t, width, -1)
            scores = (q.float()[:, :, None, :] * keys[:, None, :, :]).sum(-1).relu()
            logits = (scores * weights.float()[..., None]).sum(1)
            n = torch.div(md.positions[:t] + 1, self.compress_ratio, rounding_mode="floor")
            logits = logits.masked_fill(ar[None, :] >= n[:, None], float("-inf"))
            kk = min(self.topk, width)
            vals, idx = torch.topk(logits, kk, dim=1)
            idx = torch.where(torch.isinf(vals), torch.full_like(idx, -1), idx)
            if FAULTS["topk_off_by_one"]:
                idx = torch.where(idx >= 0, idx + 1, idx)
            buf = self.topk_indices_buffer
            buf[:t, :kk].copy_(idx.to(buf.dtype))
            if kk < buf.shape[1]:
                buf[:t, kk:].fill_(-1)
        return buf


class FillShortContext:
    """vLLM's Triton ``fill_short_context_topk_indices[(grid,)](...)``: every
    visible compressed entry, -1 after."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def run(output: torch.Tensor, positions: torch.Tensor, TOP_K: int,
                COMPRESS_RATIO: int, **_: Any) -> None:
            n = grid[0]
            ar = torch.arange(TOP_K, device=output.device)
            vis = torch.div(positions[:n] + 1, COMPRESS_RATIO, rounding_mode="floor")
            output[:n].copy_(torch.where(ar[None, :] < vis[:, None], ar[None, :], -1)
                             .to(output.dtype))

        return run


def local_to_global(local: torch.Tensor, token_to_req: torch.Tensor, block_table: torch.Tensor,
                    block_size: int, is_valid: torch.Tensor, out_indices: torch.Tensor,
                    out_lens: torch.Tensor) -> None:
    """The plugin's ``ops.indexer.local_to_global`` (sync-free)."""
    nap(local)
    with kernel_region():
        # The kernel reads the first T rows of the step's token_to_req (vLLM
        # passes the whole metadata tensor).
        indexer_ops.local_to_global(local, token_to_req[: local.shape[0]], block_table,
                                    block_size,
                                    out_indices=out_indices, out_lens=out_lens,
                                    is_valid_token=is_valid, check_slot_range=False)


def global_topk_kernel(*, global_topk_indices: torch.Tensor, topk_lens: torch.Tensor,
                       topk_indices: torch.Tensor, token_to_req_indices: torch.Tensor,
                       block_table: torch.Tensor, block_size: int,
                       is_valid_token: torch.Tensor) -> None:
    """``_COMPUTE_GLOBAL_TOPK_INDICES_AND_LENS_KERNEL``."""
    local_to_global(topk_indices, token_to_req_indices, block_table, block_size,
                    is_valid_token, global_topk_indices, topk_lens)


# --- compressor ------------------------------------------------------------------------


def save_partial_states(*, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                        positions: torch.Tensor, state_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, compress_ratio: int, **_: Any) -> None:
    """``_SAVE_PARTIAL_STATES_KERNEL``: state row = ``[kv | score + ape[pos % r]]``."""
    with kernel_region():
        rows = state_cache.view(-1, state_cache.shape[-1])
        ape_rows = ape.index_select(0, positions.to(torch.int64).remainder(compress_ratio))
        row = torch.cat([kv.float(), score.float() + ape_rows], dim=1)
        rows.index_copy_(0, slots_or_trash(slot_mapping, rows.shape[0]), row)


def compress_rows(state_cache: torch.Tensor, token_to_req: torch.Tensor,
                  positions: torch.Tensor, block_table: torch.Tensor, compress_ratio: int,
                  head_dim: int, overlap: bool) -> torch.Tensor:
    """Softmax(score)-weighted pool of the window's state rows (positions
    ``p - coff*r + 1 .. p``), ``[T, head_dim]`` fp32."""
    t = positions.shape[0]
    win = (2 if overlap else 1) * compress_ratio
    bs = state_cache.shape[1]
    width = state_cache.shape[-1] // 2
    offs = torch.arange(win, device=positions.device) - (win - 1)
    qpos = positions.to(torch.int64)[:, None] + offs[None, :]
    valid = qpos >= 0
    qc = qpos.clamp(min=0)
    bt = block_table.index_select(0, token_to_req[:t].to(torch.int64))
    blk = bt.gather(1, (qc // bs).clamp(max=bt.shape[1] - 1)).to(torch.int64)
    slots = blk * bs + qc % bs
    rows = state_cache.view(-1, state_cache.shape[-1]).index_select(0, slots.reshape(-1))
    rows = rows.view(t, win, -1)
    kv = rows[..., :head_dim]
    score = rows[..., width : width + head_dim].masked_fill(~valid[..., None], float("-inf"))
    return (torch.softmax(score, dim=1) * kv).sum(1)


def norm_rope_store(*, compressed_kv: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, rms_norm_weight: torch.Tensor,
                    rms_norm_eps: float, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                    compress_ratio: int, head_dim: int) -> None:
    """RMSNorm, RoPE at the window start, store (fp8_ds_mla for 512, fp32 rows
    for the indexer's 128)."""
    t = positions.shape[0]
    x = rms_norm(compressed_kv[:t], rms_norm_weight, rms_norm_eps)
    pos = torch.div(positions, compress_ratio, rounding_mode="floor") * compress_ratio
    x = rope_last(x, pos, cos_sin_cache)
    if head_dim == 512:
        ds_store(kv_cache, slot_mapping, x)
    else:
        rows = kv_cache.view(-1, head_dim)
        rows.index_copy_(0, slots_or_trash(slot_mapping, rows.shape[0]), x)


def compress_store(*, state_cache: torch.Tensor, token_to_req_indices: torch.Tensor,
                   positions: torch.Tensor, block_table: torch.Tensor,
                   cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                   k_cache_metadata: Any, head_dim: int, compress_ratio: int, overlap: bool,
                   rms_norm_weight: torch.Tensor, rms_norm_eps: float, **_: Any) -> None:
    """vLLM's one-call compress -> norm -> RoPE -> store (Triton for the
    indexer's head 128; the CuTe DSL kernel's C4 branch for head 512)."""
    with kernel_region():
        c = compress_rows(state_cache, token_to_req_indices, positions, block_table,
                          compress_ratio, head_dim, overlap)
        norm_rope_store(compressed_kv=c, positions=positions,
                        slot_mapping=k_cache_metadata.slot_mapping,
                        rms_norm_weight=rms_norm_weight, rms_norm_eps=rms_norm_eps,
                        cos_sin_cache=cos_sin_cache, kv_cache=kv_cache,
                        compress_ratio=compress_ratio, head_dim=head_dim)


def c4_compress_store(*, state_cache: torch.Tensor, token_to_req_indices: torch.Tensor,
                      positions: torch.Tensor, slot_mapping: torch.Tensor,
                      block_table: torch.Tensor, block_size: int,
                      rms_norm_weight: torch.Tensor, rms_norm_eps: float,
                      cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                      kv_slot_mapping: torch.Tensor, compress_ratio: int, head_dim: int,
                      rope_head_dim: int) -> None:
    """``_SPARSE_ATTN_COMPRESS_NORM_ROPE_STORE_C4_KERNEL`` (overlapping windows)."""
    with kernel_region():
        c = compress_rows(state_cache, token_to_req_indices, positions, block_table,
                          compress_ratio, head_dim, True)
        norm_rope_store(compressed_kv=c, positions=positions, slot_mapping=kv_slot_mapping,
                        rms_norm_weight=rms_norm_weight, rms_norm_eps=rms_norm_eps,
                        cos_sin_cache=cos_sin_cache, kv_cache=kv_cache,
                        compress_ratio=compress_ratio, head_dim=head_dim)


def c128_compress(*, state_cache: torch.Tensor, num_actual: int,
                  token_to_req_indices: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, block_table: torch.Tensor, head_dim: int,
                  compressed_kv: torch.Tensor | None) -> torch.Tensor:
    """``_SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL`` into ``compressed_kv``
    (allocated here when the caller passes none, as the real kernel does)."""
    if compressed_kv is None:
        compressed_kv = torch.empty((num_actual, head_dim), dtype=torch.float32,
                                    device=state_cache.device)
    with kernel_region():
        compressed_kv.copy_(compress_rows(state_cache, token_to_req_indices,
                                          positions[:num_actual], block_table, 128,
                                          head_dim, False))
    return compressed_kv


c128_compress.allocates = ("compressed_kv",)  # type: ignore[attr-defined]


def c128_store(*, compressed_kv: torch.Tensor, positions: torch.Tensor,
               rms_norm_weight: torch.Tensor, rms_norm_eps: float,
               cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
               kv_slot_mapping: torch.Tensor, compress_ratio: int, head_dim: int,
               **_: Any) -> None:
    """``_SPARSE_ATTN_NORM_ROPE_STORE_KERNEL`` from ``compressed_kv``."""
    nap(compressed_kv)
    with kernel_region():
        norm_rope_store(compressed_kv=compressed_kv, positions=positions,
                        slot_mapping=kv_slot_mapping, rms_norm_weight=rms_norm_weight,
                        rms_norm_eps=rms_norm_eps, cos_sin_cache=cos_sin_cache,
                        kv_cache=kv_cache, compress_ratio=compress_ratio, head_dim=head_dim)
