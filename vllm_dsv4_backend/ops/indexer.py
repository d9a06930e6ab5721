# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-V4 lightning indexer in vectorized PyTorch (torch only, no vLLM).

One C4 layer step, in the order the backend calls these::

    indexer_q_rope_quant   q [T, 64, 128] bf16 -> RoPE'd, FP8 or MXFP4 q + weights
    indexer_logits         I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])
                           over the paged indexer K cache (132 B or 68 B entries)
    indexer_topk           causal top-k of I over compressed entries j < (p+1)//4
    local_to_global        local compressed index -> global cache slot (+ lengths)

Semantics follow vLLM 0.32 (``fused_indexer_q.py``, the C++ CPU kernels
``fused_indexer_q_rope_quant_cpu`` / ``fp8_paged_mqa_logits_cpu`` /
``topk_transform_512_cpu`` and ``compute_global_topk_indices_and_lens``); the
docstrings name every deliberate difference. Every function takes optional
``out`` buffers (the caller's workspace); outputs are then written in place
and returned. Work is chunked over tokens (and, for logits, over compressed
entries) so temporaries stay under ``max_chunk_elems`` float32 elements
whatever ``T x N_compressed`` is. Index constants (aranges) are cached per
device, so no factory op runs per call once warmed up.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_dsv4_backend.formats import indexer_cache as ic
from vllm_dsv4_backend.formats import mxfp4
from vllm_dsv4_backend.ops import rope
from vllm_dsv4_backend.ops.blas import gemm_one_thread, lone_gemm
from vllm_dsv4_backend.ops.checks import check_int32_slots

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "IndexerQ",
    "indexer_logits",
    "indexer_q_rope_quant",
    "indexer_topk",
    "local_to_global",
]

# Budget for the largest per-chunk temporary, in float32 elements (16 MiB).
DEFAULT_CHUNK_ELEMS = 1 << 22
# Query values per chunk in indexer_q_rope_quant (1 MiB of float32).
_Q_CHUNK_ELEMS = 1 << 18
_MAX_ENTRY_CHUNK = 4096
# Entry tiles of a fixed width and origin: BLAS rounds a column differently for a
# different matrix width, so a batch-dependent chunk width would make a row's
# logits depend on the other rows of the batch (tests/core/test_batch_invariance.py).
_ENTRY_TILE = 512
_INT64_MIN = -(2**63)
_INT32_MIN = -(2**31)

_arange_cache: dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``0..n-1`` int64 as a view of a cached, grow-only per-device buffer."""
    t = _arange_cache.get(device)
    if t is None or t.numel() < n:
        t = torch.arange(max(n, 1024), dtype=torch.int64, device=device)
        _arange_cache[device] = t
    return t[:n]


def _describe(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    return f"shape {list(t.shape)} dtype {t.dtype} on {t.device}"


def _check(
    where: str,
    name: str,
    t: torch.Tensor | None,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None,
) -> None:
    """FlashInfer-style check: ``None`` in ``shape`` means any size."""
    ok = (
        isinstance(t, torch.Tensor)
        and t.dim() == len(shape)
        and all(s is None or s == d for s, d in zip(shape, t.shape))
        and t.dtype in dtypes
        and (device is None or t.device == device)
    )
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        names = " or ".join(str(d) for d in dtypes)
        dev = "" if device is None else f" on {device}"
        raise ValueError(
            f"{where}: argument '{name}' expected shape {want} dtype {names}{dev}, "
            f"got {_describe(t)}"
        )


def _check_quantized_q(
    where: str,
    name: str,
    q: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    lead: tuple[int | None, ...],
    head_dim: int,
    dtype: str,
    device: torch.device,
    fp8_scale_note: str,
) -> None:
    """An indexer q in the K cache's dtype: fp8 ``[*lead, head_dim]`` without a scale of
    its own (``fp8_scale_note`` says where it went), or mxfp4 ``[*lead, head_dim / 2]``
    packed uint8 with ``[*lead, head_dim / 32]`` uint8 block scales."""
    if dtype == ic.FP8:
        _check(where, name, q, (*lead, head_dim), (torch.float8_e4m3fn,), device)
        if q_scale is not None:
            raise ValueError(
                f"{where}: argument '{name}_scale' expected None for fp8 ({fp8_scale_note}), "
                f"got {_describe(q_scale)}"
            )
    else:
        _check(where, name, q, (*lead, head_dim // 2), (torch.uint8,), device)
        scale_shape = (*q.shape[:-1], head_dim // mxfp4.BLOCK_SIZE)  # type: ignore[union-attr]
        _check(where, f"{name}_scale", q_scale, scale_shape, (torch.uint8,), device)


_FLOAT_IN = (torch.bfloat16, torch.float32, torch.float16)
_INT_IN = (torch.int32, torch.int64)


class IndexerQ(NamedTuple):
    """Quantized indexer query, as ``indexer_q_rope_quant`` returns it.

    Attributes:
        q: FP8: ``[T, H, 128]`` float8_e4m3fn. MXFP4: ``[T, H, 64]`` uint8,
            packed e2m1 (element ``2k`` in the low nibble of byte ``k``).
        q_scale: FP8: ``None`` (folded into ``weights``). MXFP4: ``[T, H, 4]``
            uint8 ue8m0 bytes, one per 32 values (vLLM passes the same bytes
            as an int32 ``[T, H]`` view).
        weights: ``[T, H]`` float32. FP8: ``w * q_scale * softmax_scale *
            head_scale``; MXFP4: ``w * softmax_scale * head_scale``.
    """

    q: torch.Tensor
    q_scale: torch.Tensor | None
    weights: torch.Tensor


def indexer_q_rope_quant(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    weights: torch.Tensor,
    *,
    softmax_scale: float,
    head_scale: float,
    dtype: str,
    out: IndexerQ | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None,
) -> IndexerQ:
    """RoPE + quantize the indexer query; fold scales into the head weights.

    RoPE is GPT-J style (interleaved pairs) on the **last** ``R`` dims of each
    head, ``R = cos_sin_cache.shape[1]`` (64 for DeepSeek-V4), with vLLM's
    cache layout ``cos_sin_cache[pos] = [cos_0..cos_{R/2-1}, sin_0..sin_{R/2-1}]``;
    pair ``i`` is ``(x[D-R+2i], x[D-R+2i+1])``. The rotated dims are rounded to
    bf16 (vLLM does, before the amax); the leading ``D - R`` dims pass through
    unrounded.

    FP8: one ue8m0 scale per (token, head), ``2**ceil(log2(max(amax, 1e-4) /
    448))`` (exact exponent, see ``formats.indexer_cache``), values
    ``e4m3fn(clamp(x / scale, +-448))``, and
    ``weights_out = ((w * q_scale) * softmax_scale) * head_scale`` in float32.
    MXFP4: ``formats.mxfp4.quantize`` per 32 values (4 blocks per head), and
    ``weights_out = (w * softmax_scale) * head_scale`` (the q scales stay with
    the values).

    Args:
        q: ``[T, H, D]`` bfloat16 (float32 / float16 accepted), ``D`` = 128.
        positions: ``[T]`` int32/int64 positions (row of ``cos_sin_cache``).
        cos_sin_cache: ``[max_pos, R]`` float32 (bf16 accepted), ``R`` even,
            ``R <= D``.
        weights: ``[T, H]`` bf16/fp32 raw ``weights_proj`` output.
        softmax_scale: ``index_head_dim ** -0.5`` in DeepSeek-V4.
        head_scale: ``index_n_heads ** -0.5`` in DeepSeek-V4.
        dtype: ``"fp8"`` or ``"mxfp4"``.
        out: optional ``(q, q_scale, weights)`` buffers with the shapes/dtypes
            of :class:`IndexerQ` (``q_scale`` ``None`` for FP8).

    Returns:
        :class:`IndexerQ` ``(q, q_scale, weights)``.

    Raises:
        ValueError: bad shapes/dtypes/devices or ``out`` buffers; on CPU also a
            position outside ``cos_sin_cache``.
    """
    where = "indexer_q_rope_quant"
    ic.check_dtype(dtype, where)
    _check(where, "q", q, (None, None, None), _FLOAT_IN, None)
    dev = q.device
    t, h, d = q.shape
    _check(where, "positions", positions, (t,), _INT_IN, dev)
    _check(where, "cos_sin_cache", cos_sin_cache, (None, None), _FLOAT_IN, dev)
    _check(where, "weights", weights, (t, h), _FLOAT_IN, dev)
    rot = cos_sin_cache.shape[1]
    if rot % 2 != 0 or rot > d or (dtype == ic.MXFP4 and d % mxfp4.BLOCK_SIZE != 0):
        raise ValueError(
            f"{where}: expected an even RoPE width <= head dim (and head dim % 32 == 0 "
            f"for mxfp4), got cos_sin_cache {_describe(cos_sin_cache)} for q {_describe(q)}"
        )
    if out is not None:
        q_out, qs_out, w_out = out
        _check_quantized_q(where, "out.q", q_out, qs_out, (t, h), d, dtype, dev,
                           "the scale is folded into weights")
        _check(where, "out.weights", w_out, (t, h), (torch.float32,), dev)
    else:
        q_out = qs_out = w_out = None

    if dev.type == "cpu" and t > 0:  # free on CPU; elsewhere torch's index check fires
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError(
                f"{where}: argument 'positions' expected values in [0, "
                f"{cos_sin_cache.shape[0]}) (rows of cos_sin_cache), got [{lo}, {hi}]"
            )
    fp8 = dtype == ic.FP8
    if q_out is None:
        if fp8:
            q_out = torch.empty(t, h, d, dtype=torch.float8_e4m3fn, device=dev)
        else:
            q_out = torch.empty(t, h, d // 2, dtype=torch.uint8, device=dev)
            qs_out = torch.empty(t, h, d // mxfp4.BLOCK_SIZE, dtype=torch.uint8, device=dev)
        w_out = torch.empty(t, h, dtype=torch.float32, device=dev)

    # Token chunks keep the float32/float64 temporaries cache-sized.
    tc = max(1, _Q_CHUNK_ELEMS // max(1, h * d))
    half = rot // 2
    for t0 in range(0, t, tc):
        t1 = min(t, t0 + tc)
        x = q[t0:t1].to(torch.float32, copy=True)
        if rot > 0:
            cs = cos_sin_cache.index_select(0, positions[t0:t1].long()).to(torch.float32)
            xr = x[..., d - rot :]
            rope.gptj_rope_fma_(xr, cs[:, None, :half], cs[:, None, half:])
            xr.copy_(xr.bfloat16())  # the C++ kernel rounds the rotated q to bf16
        w = weights[t0:t1].to(torch.float32)
        if fp8:
            amax = x.abs().amax(dim=-1)
            e = ic.fp8_exponent(amax)
            scale = ((e + 127) << 23).view(torch.float32)
            scale = scale.masked_fill(~torch.isfinite(amax), float("nan"))
            q_out[t0:t1] = x.div_(scale.unsqueeze(-1)).clamp_(-ic.FP8_MAX, ic.FP8_MAX)
            torch.mul(w, scale, out=w_out[t0:t1])
        else:
            assert qs_out is not None
            mxfp4.quantize(x, out_packed=q_out[t0:t1], out_scale=qs_out[t0:t1])
            w_out[t0:t1] = w
    # Separate float32 multiplies in vLLM's order (not one folded constant).
    w_out.mul_(softmax_scale).mul_(head_scale)
    return IndexerQ(q_out, None if fp8 else qs_out, w_out)


def _dequant_q(
    q: torch.Tensor, q_scale: torch.Tensor | None, dtype: str
) -> torch.Tensor:
    if dtype == ic.FP8:
        return q.to(torch.float32)
    assert q_scale is not None
    return mxfp4.dequantize(q, q_scale)


def _dequant_k(
    vals: torch.Tensor, scales: torch.Tensor, dtype: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gathered K entries -> (float32 values ``[..., 128]``, FP8 scale ``[...]``).

    FP8 returns the e4m3 values unscaled plus the per-entry scale (applied to
    the logits); MXFP4 returns fully dequantized values and ``None``.
    """
    if dtype == ic.FP8:
        return vals.view(torch.float8_e4m3fn).to(torch.float32), scales.view(
            torch.float32
        ).squeeze(-1)
    return mxfp4.dequantize(vals, scales), None


def indexer_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    dtype: str | None = None,
    token_to_req: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    max_chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> torch.Tensor:
    """Indexer scores over the paged indexer K cache.

    ``I[t, j] = sum_h weights[t, h] * relu(q[t, h] . k[j])`` with ``q`` and
    ``k`` dequantized exactly (FP8: e4m3 values, the q scale already in
    ``weights``, the k scale applied per entry; MXFP4: e2m1 * ue8m0 on both
    sides), accumulated in float32. Entry ``j`` of token ``t`` lives at slot
    ``page_table[t][j // B] * B + j % B``.

    ``I[t, j] = -inf`` for ``j >= seq_lens[t]`` and for entries whose page is
    unmapped (negative page id, or ``j // B`` past the table): those entries
    are never read into a result (a NaN-poisoned unused page cannot leak into
    a valid score). vLLM's ``fp8_paged_mqa_logits_cpu`` leaves such entries
    uninitialized instead.

    Args:
        q: FP8: ``[T, H, 128]`` float8_e4m3fn; MXFP4: ``[T, H, 64]`` uint8.
        q_scale: FP8: ``None``; MXFP4: ``[T, H, 4]`` uint8 ue8m0 (or vLLM's
            int32 ``[T, H]`` view of the same bytes).
        weights: ``[T, H]`` float32 (from :func:`indexer_q_rope_quant`).
        k_cache: ``[num_blocks, B, entry_bytes]`` (or ``[num_blocks, B, 1,
            entry_bytes]``) uint8 in ``dtype``'s layout; padded block stride ok.
        seq_lens: ``[T]`` int32/int64, number of compressed entries token ``t``
            may see (``(pos + 1) // 4`` for causal C4).
        block_table: ``[R, max_blocks]`` int32/int64 with ``token_to_req``, or
            a per-token page table ``[T, max_blocks]`` when ``token_to_req`` is
            ``None`` (the ``fp8_paged_mqa_logits_cpu`` convention).
        dtype: ``"fp8"`` or ``"mxfp4"`` (cache and q format); default: from
            ``q.dtype`` (float8_e4m3fn -> fp8, uint8 -> mxfp4).
        token_to_req: optional ``[T]`` int32/int64 row of ``block_table``.
        max_seq_len: logits width ``W``; default ``out.shape[1]`` or
            ``max(seq_lens)`` (a device sync).
        out: optional ``[T, >= W]`` float32 buffer; columns ``[0, W)`` written.
        max_chunk_elems: bound on the ``[tokens, H, entries]`` temporary.

    Returns:
        ``[T, W]`` float32 logits (a view of ``out`` when given).

    Raises:
        ValueError: bad shapes/dtypes/devices.
    """
    where = "indexer_logits"
    if dtype is None:
        dtype = ic.MXFP4 if q.dtype == torch.uint8 else ic.FP8
    ic.check_dtype(dtype, where)
    values_v, scales_v = ic.block_views(k_cache, dtype, where)
    dev = k_cache.device
    head_dim = ic.HEAD_DIM
    if (dtype == ic.MXFP4 and q_scale is not None and q_scale.dtype == torch.int32
            and q_scale.dim() == 2):
        # vLLM's CPU ops pack a head's four block scales into one int32: the same bytes.
        q_scale = q_scale.contiguous().unsqueeze(-1).view(torch.uint8)
    _check_quantized_q(where, "q", q, q_scale, (None, None), head_dim, dtype, dev,
                       "fold the q scale into weights")
    t, h = q.shape[0], q.shape[1]
    _check(where, "weights", weights, (t, h), (torch.float32,), dev)
    _check(where, "seq_lens", seq_lens, (t,), _INT_IN, dev)
    if token_to_req is None:
        _check(where, "block_table", block_table, (t, None), _INT_IN, dev)
    else:
        _check(where, "block_table", block_table, (None, None), _INT_IN, dev)
        _check(where, "token_to_req", token_to_req, (t,), _INT_IN, dev)
    if max_seq_len is None:
        if out is not None:
            max_seq_len = out.shape[1] if out.dim() == 2 else 0
        else:
            max_seq_len = int(seq_lens.max()) if t > 0 else 0
    width = max(int(max_seq_len), 0)
    if out is not None:
        _check(where, "out", out, (t, None), (torch.float32,), dev)
        if out.shape[1] < width:
            raise ValueError(
                f"{where}: argument 'out' expected at least {width} columns, got "
                f"{_describe(out)}"
            )
        res = out[:, :width]
    else:
        res = torch.empty(t, width, dtype=torch.float32, device=dev)
    if t == 0 or width == 0:
        return res

    bs = values_v.shape[1]
    max_blocks = block_table.shape[1]
    if values_v.shape[0] == 0 or max_blocks == 0:
        return res.fill_(float("-inf"))

    nc = _ENTRY_TILE
    tc = max(1, min(t, max_chunk_elems // max(1, h * nc)))
    lens_all = seq_lens.long()
    # On CPU reading the lengths is free: skip entry chunks no token can see.
    host_lens = lens_all if dev.type == "cpu" else None
    ar = _arange(-(-width // nc) * nc, dev)
    for t0 in range(0, t, tc):
        t1 = min(t, t0 + tc)
        lens = lens_all[t0:t1]
        shared_row = None
        if host_lens is not None and token_to_req is not None:
            # Prefill: a chunk whose tokens all belong to one request reads one K
            # sequence; gather and dequantize it once and use one GEMM.
            reqs = token_to_req[t0:t1]
            if bool((reqs == reqs[0]).all()):
                shared_row = block_table[int(reqs[0])]
        if shared_row is None:
            if token_to_req is None:
                pages = block_table[t0:t1]
            else:
                pages = block_table.index_select(0, token_to_req[t0:t1].long())
        qf = _dequant_q(q[t0:t1], None if q_scale is None else q_scale[t0:t1], dtype)
        # The shared-row mm is one GEMM whatever the chunk, and a bmm of fewer tokens than
        # threads is split too: on one thread either rounds as the tokens' bmm in a batch.
        one = lone_gemm(1 if shared_row is not None else t1 - t0, dev)
        w = weights[t0:t1].unsqueeze(1)
        end = width
        if host_lens is not None:
            end = min(width, max(0, int(host_lens[t0:t1].max())))
            if end < width:
                res[t0:t1, end:].fill_(float("-inf"))
        with gemm_one_thread(one):  # only MKL's GEMMs see it (ops/blas.py)
            for j0 in range(0, end, nc):
                j1 = j0 + nc
                jw = min(j1, width) - j0
                j = ar[j0:j1]
                page_col = j // bs
                in_table = page_col < max_blocks
                page_col = page_col.clamp(max=max_blocks - 1)
                causal = j.unsqueeze(0) < lens.unsqueeze(1)
                if shared_row is not None:
                    page = shared_row.index_select(0, page_col).long()
                    mapped = (page >= 0) & in_table
                    page.masked_fill_(~mapped, 0)
                    vals, scs = ic.gather_raw(values_v, scales_v, page, j % bs)
                    kf, k_scale = _dequant_k(vals, scs, dtype)  # [n, 128], [n] | None
                    s = torch.mm(qf.flatten(0, 1), kf.t()).unflatten(0, (t1 - t0, h))
                    valid = causal & mapped.unsqueeze(0)
                else:
                    page = pages.index_select(1, page_col).long()
                    valid = causal & (page >= 0) & in_table
                    page.masked_fill_(~valid, 0)
                    vals, scs = ic.gather_raw(values_v, scales_v, page, (j % bs).expand_as(page))
                    kf, k_scale = _dequant_k(vals, scs, dtype)  # [tc, n, 128], [tc, n] | None
                    s = torch.bmm(qf, kf.transpose(1, 2))  # [tc, H, n]
                lg = torch.bmm(w, s.relu_()).squeeze(1)  # [tc, n]
                if k_scale is not None:
                    # relu(q.(k*s)) = s*relu(q.k) for the positive power-of-two FP8 scale:
                    # the same numbers, one multiply per entry instead of per value.
                    lg.mul_(k_scale)
                res[t0:t1, j0:j0 + jw] = lg[:, :jw].masked_fill_(~valid[:, :jw], float("-inf"))
    return res


def indexer_topk(
    logits: torch.Tensor,
    positions: torch.Tensor | None,
    topk: int,
    *,
    compress_ratio: int = 4,
    seq_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> torch.Tensor:
    """Causal top-k over compressed entries, as local indices.

    A query at position ``p`` sees entries ``j < n = (p + 1) // compress_ratio``
    (or ``n = seq_lens[t]`` when given), capped at the logits width.

    - ``n <= topk``: the row is ``0, 1, .., n-1`` then ``-1`` (vLLM's
      short-context rule: every visible entry is selected, scores unused).
    - ``n > topk``: the ``topk`` best entries by score, the **same set as
      vLLM's C++ ``topk_transform_512_cpu``, ties included** (see
      :func:`_stream_heap_select`: every entry above the k-th largest score
      ``v``, plus the latest-indexed entries equal to ``v`` among those up to
      the first prefix holding ``topk`` entries ``>= v``), returned **sorted
      by score descending, equal scores by ascending index** (the C++ kernel
      returns its heap's array order instead; consumers use the set).
      ``-inf`` is an ordinary (lowest) score and ``-0.0`` ties ``+0.0``, as
      in the kernel's float compares. NaN scores rank as ``-inf`` (the
      kernel's heap has no defined result for NaN).

    Args:
        logits: ``[T, W]`` float32 (bf16/fp16 accepted) scores; columns
            ``>= n`` are ignored whatever they hold.
        positions: ``[T]`` int32/int64 query positions (ignored when
            ``seq_lens`` is given; may then be ``None``).
        topk: ``index_topk`` (512 for V4-Flash, 1024 for V4-Pro), ``> 0``.
        compress_ratio: 4 for the C4 indexer.
        seq_lens: optional ``[T]`` int32/int64 visible counts.
        out: optional ``[T, topk]`` int32 buffer.
        max_chunk_elems: bound on the per-chunk ``[rows, W]`` int64 key tensor.

    Returns:
        ``[T, topk]`` int32 local indices, -1 padded.

    Raises:
        ValueError: bad shapes/dtypes/devices, ``topk <= 0``,
            ``compress_ratio <= 0``.
    """
    where = "indexer_topk"
    _check(where, "logits", logits, (None, None), _FLOAT_IN, None)
    dev = logits.device
    t, width = logits.shape
    if not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"{where}: argument 'topk' expected a positive int, got {topk!r}")
    if seq_lens is None:
        if not isinstance(compress_ratio, int) or compress_ratio <= 0:
            raise ValueError(
                f"{where}: argument 'compress_ratio' expected a positive int, got "
                f"{compress_ratio!r}"
            )
        _check(where, "positions", positions, (t,), _INT_IN, dev)
        assert positions is not None
        n_all = torch.div(positions.long() + 1, compress_ratio, rounding_mode="floor")
    else:
        _check(where, "seq_lens", seq_lens, (t,), _INT_IN, dev)
        n_all = seq_lens.long()
    n_all = n_all.clamp(0, width)
    if out is None:
        out = torch.empty(t, topk, dtype=torch.int32, device=dev)
    else:
        _check(where, "out", out, (t, topk), (torch.int32,), dev)
    if t == 0:
        return out

    ar = _arange(max(topk, width), dev)
    ar_k = ar[:topk]
    rev = (width - 1) - ar[:width]  # larger for lower j: equal scores in index order
    need_rank = width > topk  # else every row has n <= width <= topk
    # On CPU the visible counts are free to read: rank only the columns a chunk
    # can see (the logits may be much wider than any row's n).
    host_n = n_all if dev.type == "cpu" else None
    rows = max(1, min(t, max_chunk_elems // max(1, width)))
    for t0 in range(0, t, rows):
        t1 = min(t, t0 + rows)
        n = n_all[t0:t1].unsqueeze(1)
        o = out[t0:t1]
        # Short-context fill for every row first; long rows overwritten below.
        o.copy_(ar_k.unsqueeze(0).expand_as(o))
        o.masked_fill_(ar_k.unsqueeze(0) >= n, -1)
        if not need_rank:
            continue
        cols = width
        if host_n is not None:
            cols = int(host_n[t0:t1].max())
            if cols <= topk:
                continue
        x = logits[t0:t1, :cols].to(torch.float32) + 0.0  # fresh copy; -0.0 -> +0.0
        x = torch.nan_to_num_(x, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        bits = x.view(torch.int32)
        # Order-preserving float32 -> int32 map (negative floats flip magnitude);
        # -inf maps above INT32_MIN, which then marks the invisible columns.
        key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key32.masked_fill_(ar[:cols].unsqueeze(0) >= n, _INT32_MIN)
        # (score, lower index first) in one int64: the kernel's set wherever the
        # k-th largest score v has no more copies than the slots left for it.
        key = (key32.to(torch.int64) << 32) | rev[:cols].unsqueeze(0)
        top, idx = torch.topk(key, topk, dim=1, largest=True, sorted=True)
        if host_n is None:
            # No host sync off CPU: every row takes the exact tie rule.
            _apply_tie_rule(key, key32, ar[:cols], topk, idx)
        else:
            v = (top[:, -1:] >> 32).to(torch.int32)
            ambiguous = (key32 == v).sum(dim=1) > ((top >> 32) == v).sum(dim=1)
            if bool(ambiguous.any()):
                r = ambiguous.nonzero().squeeze(1)
                sub = idx[r]
                _apply_tie_rule(key[r], key32[r], ar[:cols], topk, sub)
                idx[r] = sub
        # Rows with n <= topk keep the fill (their selection above is garbage).
        o.copy_(torch.where(n > topk, idx, o))
    return out


def _apply_tie_rule(
    key: torch.Tensor, key32: torch.Tensor, ar: torch.Tensor, k: int, idx: torch.Tensor
) -> None:
    """Overwrite ``idx`` with the kernel's set (:func:`_stream_heap_select`), in
    ``key`` order (score descending, equal scores by index); ``key`` is consumed."""
    sel = _stream_heap_select(key32, ar, k)
    key.masked_fill_(~sel, _INT64_MIN)
    idx.copy_(torch.topk(key, k, dim=1, largest=True, sorted=True).indices)


def _stream_heap_select(key: torch.Tensor, ar: torch.Tensor, k: int) -> torch.Tensor:
    """The set vLLM's C++ top-k (``topk_transform_512_cpu``) keeps, as a mask.

    The kernel streams a min-heap over a row: the first ``k`` entries fill
    it; entry ``i >= k`` replaces the heap minimum only if strictly greater,
    and the minimum it evicts is the lowest-indexed of the minimal scores
    (the heap compares ``(score, index)``). Closed form, with ``v`` the k-th
    largest score: entries ``> v`` all stay (one evicted would make the heap
    minimum exceed ``v`` for good); the heap minimum first reaches ``v`` at
    ``tau``, the first index whose prefix holds ``k`` entries ``>= v``.
    Until then every entry equal to ``v`` gets in (the minimum is below
    ``v``) and none is evicted; after it an entry equal to ``v`` is refused
    and each entry ``> v`` evicts the lowest-indexed ``v`` left. So the
    ``m = k - #(> v)`` entries equal to ``v`` that stay are the highest-
    indexed ones at or before ``tau``. (Neither "lower index wins" nor
    "higher index wins" alone: all-equal rows keep their first ``k``.)

    Args:
        key: ``[R, C]`` int32 order-preserving score keys; entries a row
            cannot see hold ``INT32_MIN`` (below every score). The rule
            holds for rows that see more than ``k`` entries; other rows get
            some ``k`` entries (callers use their short-context fill).
        ar: ``[C]`` int64 ``0..C-1``.
        k: entries to keep (``< C``).

    Returns:
        ``[R, C]`` bool, exactly ``k`` True per row.
    """
    v = torch.topk(key, k, dim=1, largest=True, sorted=False).values.amin(dim=1, keepdim=True)
    gt = key > v
    eq = key == v
    ge_count = torch.cumsum(gt | eq, dim=1, dtype=torch.int32)
    # ge_count is non-decreasing: the first index reaching k is the count below k.
    tau = (ge_count < k).sum(dim=1, keepdim=True)
    entered = eq & (ar.unsqueeze(0) <= tau)
    entered_count = torch.cumsum(entered, dim=1, dtype=torch.int32)
    later = entered_count[:, -1:] - entered_count  # entered ties after j
    keep = k - gt.sum(dim=1, keepdim=True, dtype=torch.int32)
    return gt | (entered & (later < keep))


def local_to_global(
    topk_local: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    out_indices: torch.Tensor | None = None,
    out_lens: torch.Tensor | None = None,
    *,
    is_valid_token: torch.Tensor | None = None,
    check_slot_range: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map local compressed indices to global cache slots, count valid entries.

    ``global = block_table[token_to_req[t], j // block_size] * block_size +
    j % block_size`` for ``j >= 0``; -1 stays -1, as in vLLM's
    ``compute_global_topk_indices_and_lens``. Beyond it: a negative
    (unallocated) block-table entry or ``j // block_size`` past the table also
    gives -1 instead of a garbage slot. ``lens[t]`` counts the entries with
    ``j >= 0`` (vLLM's count, so FlashMLA's ``topk_length`` still covers the
    whole valid prefix; an unmapped entry inside it reads as -1 = skipped), and
    is 0 where ``is_valid_token`` is False (padding tokens).

    Args:
        topk_local: ``[T, K]`` int32/int64 local indices, -1 = none.
        token_to_req: ``[T]`` int32/int64 row of ``block_table`` per token.
        block_table: ``[R, max_blocks]`` int32/int64 block ids of the
            compressed cache.
        block_size: entries per compressed-cache block (> 0).
        out_indices: optional ``[T, K]`` int32 buffer (``topk_local`` itself is
            allowed: the mapping is computed before writing).
        out_lens: optional ``[T]`` int32 buffer.
        is_valid_token: optional ``[T]`` bool.
        check_slot_range: refuse a slot id beyond int32 (reads the ids on the
            host); ``False`` keeps the op free of host syncs, as a CUDA-graph
            capture needs (the kernel the graph harness stands in for has no
            such check either).

    Returns:
        ``(global_indices [T, K] int32, lens [T] int32)``.

    Raises:
        ValueError: bad shapes/dtypes/devices, ``block_size <= 0``, or a
            global slot id that does not fit int32 (``>= 2**31``).
    """
    where = "local_to_global"
    _check(where, "topk_local", topk_local, (None, None), _INT_IN, None)
    dev = topk_local.device
    t, k = topk_local.shape
    _check(where, "token_to_req", token_to_req, (t,), _INT_IN, dev)
    _check(where, "block_table", block_table, (None, None), _INT_IN, dev)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(
            f"{where}: argument 'block_size' expected a positive int, got {block_size!r}"
        )
    if is_valid_token is not None:
        _check(where, "is_valid_token", is_valid_token, (t,), (torch.bool,), dev)
    if out_indices is None:
        out_indices = torch.empty(t, k, dtype=torch.int32, device=dev)
    else:
        _check(where, "out_indices", out_indices, (t, k), (torch.int32,), dev)
    if out_lens is None:
        out_lens = torch.empty(t, dtype=torch.int32, device=dev)
    else:
        _check(where, "out_lens", out_lens, (t,), (torch.int32,), dev)
    if t == 0:
        return out_indices, out_lens

    local = topk_local.long()
    valid = local >= 0
    max_blocks = block_table.shape[1]
    if max_blocks == 0 or block_table.shape[0] == 0:
        out_indices.fill_(-1)
    else:
        safe = local.clamp(min=0)
        col = safe // block_size
        ok = valid & (col < max_blocks)
        rows = token_to_req.long().clamp(0, block_table.shape[0] - 1).unsqueeze(1)
        blocks = block_table[rows, col.clamp_(max=max_blocks - 1)].long()
        ok &= blocks >= 0
        slots = blocks.mul_(block_size).add_(safe % block_size).masked_fill_(~ok, -1)
        if check_slot_range:
            check_int32_slots(where, slots, block_size)
        out_indices.copy_(slots)
    lens = valid.sum(dim=1)
    if is_valid_token is not None:
        lens.masked_fill_(~is_valid_token, 0)
    out_lens.copy_(lens)
    return out_indices, out_lens



def _bench_case(
    dtype: str, t: int, ctx: int, prefill: bool, dev: torch.device, reps: int
) -> list[float]:  # pragma: no cover - manual tool
    """Best-of-``reps`` ms of the four indexer ops for one synthetic step."""
    import time

    gen = torch.Generator().manual_seed(0)
    heads, bs, topk = 64, 64, 512
    n = ctx // 4
    nblk = -(-n // bs)
    reqs = 1 if prefill else t
    nb = reqs * nblk + 1
    cache = torch.zeros(nb, bs, ic.entry_bytes(dtype), dtype=torch.uint8, device=dev)
    ic.quantize_and_insert(torch.randn(nb * bs, 128, generator=gen).to(dev), cache,
                           torch.arange(nb * bs, device=dev), dtype)
    bt = torch.randperm(nb, generator=gen)[: reqs * nblk].view(reqs, nblk).int().to(dev)
    if prefill:  # the last t tokens of one request
        pos, ttr = torch.arange(ctx - t, ctx), torch.zeros(t, dtype=torch.long)
    else:  # one token per request, all at the end of their context
        pos, ttr = torch.full((t,), ctx - 1), torch.arange(t)
    pos, ttr = pos.to(dev), ttr.to(dev)
    q = torch.randn(t, heads, 128, generator=gen).bfloat16().to(dev)
    w = torch.randn(t, heads, generator=gen).bfloat16().to(dev)
    cs = torch.randn(ctx, 64, generator=gen).to(dev)
    lens = torch.div(pos + 1, 4, rounding_mode="floor")
    if dtype == ic.FP8:
        bufs = (torch.empty(t, heads, 128, dtype=torch.float8_e4m3fn, device=dev), None,
                torch.empty(t, heads, device=dev))
    else:
        bufs = (torch.empty(t, heads, 64, dtype=torch.uint8, device=dev),
                torch.empty(t, heads, 4, dtype=torch.uint8, device=dev),
                torch.empty(t, heads, device=dev))
    logits = torch.empty(t, n, device=dev)
    local = torch.empty(t, topk, dtype=torch.int32, device=dev)
    glob = torch.empty_like(local)
    glens = torch.empty(t, dtype=torch.int32, device=dev)
    best = [float("inf")] * 4
    for rep in range(reps + 1):  # the first run warms up
        marks = [time.perf_counter()]
        qq = indexer_q_rope_quant(q, pos, cs, w, softmax_scale=128**-0.5,
                                  head_scale=heads**-0.5, dtype=dtype, out=bufs)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        indexer_logits(qq.q, qq.q_scale, qq.weights, cache, lens, bt, dtype=dtype,
                       token_to_req=ttr, out=logits)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        indexer_topk(logits, pos, topk, out=local)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        local_to_global(local, ttr, bt, bs, glob, glens)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        if rep:
            best = [min(b, 1e3 * (y - x)) for b, x, y in zip(best, marks, marks[1:])]
    return best


def _benchmark(argv: list[str] | None = None) -> None:  # pragma: no cover - manual tool
    """Print wall times of one indexer step: ``python -m vllm_dsv4_backend.ops.indexer``."""
    import argparse

    p = argparse.ArgumentParser(description=_benchmark.__doc__)
    p.add_argument("--dtype", choices=[ic.FP8, ic.MXFP4], nargs="+", default=[ic.FP8, ic.MXFP4])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    cases = [("decode", 32, 8192, False), ("decode", 32, 65536, False),
             ("prefill", 1024, 4096, True), ("prefill", 512, 16384, True)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {dev}; "
          f"64 index heads x 128, block 64, topk 512; best of {args.reps}, ms")
    for dtype in args.dtype:
        for label, t, ctx, prefill in cases:
            b = _bench_case(dtype, t, ctx, prefill, dev, args.reps)
            print(f"{dtype:5s} {label:7s} T={t:5d} ctx={ctx:6d} N={ctx // 4:6d}  "
                  f"q_rope_quant {b[0]:8.2f}  logits {b[1]:9.2f}  topk {b[2]:8.2f}  "
                  f"local_to_global {b[3]:7.2f}")


if __name__ == "__main__":  # pragma: no cover
    _benchmark()
