# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Torch ports of vLLM's DeepSeek-V4 Triton metadata kernels (torch only).

vLLM 0.32/0.33 builds the per-step DeepSeek-V4 attention metadata with small
Triton kernels. A CPU machine without triton-cpu cannot launch them, so the
plugin swaps the module globals that hold them for the functions below
(see ``vllm_dsv4_backend.vllm_compat``). Each function keeps the **call
signature of the vLLM launcher it replaces** (same positional order and
parameter names) and the exact store semantics of the Triton program:

* an element the kernel does not store is left untouched (callers pre-fill
  where the kernel relies on that, e.g. ``get_compressed_slot_mapping``);
* integer ``//`` and ``%`` follow Triton/C semantics (truncate toward zero),
  which only matters for out-of-contract negative positions but keeps the
  ports bit-identical to the kernels on every input;
* writes the Triton kernel would make past the end of the tensor view it was
  handed (raw-pointer arithmetic into the caller's larger buffer) are dropped.

Everything is vectorized (``searchsorted`` for the token -> request search the
kernels do per program); no host synchronisation, so the functions also run
on CUDA tensors. Only ``int32``/``int64`` index tensors are accepted.

Ported kernels (vLLM 0.32 module global -> function here; ``mla`` is
``vllm.v1.attention.backends.mla``):

* T1 ``v1.attention.ops.metadata.compute_token_to_req_indices``
  -> :func:`compute_token_to_req_indices`
* T2 ``mla.compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL``
  -> :func:`compressed_slot_mapping`
* T3 ``mla.indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL``
  -> :func:`build_prefill_chunk_metadata`
* T4 ``mla.sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL``
  -> :func:`swa_indices_and_lens`
* T5 ``mla.sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL``
  -> :func:`prefill_gather_lens`
* ``mla.sparse_swa._COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL``
  -> :func:`dspark_noncausal_swa_indices`
* ``models.deepseek_v4.sparse_mla._BUILD_C128A_TOPK_METADATA_KERNEL``
  -> :func:`build_c128a_topk_metadata`
* ``mla.indexer._PREPARE_UNIFORM_DECODE_KERNEL``
  -> :func:`prepare_uniform_decode`
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vllm_dsv4_backend._checks import check_tensor

__all__ = [
    "build_c128a_topk_metadata",
    "build_prefill_chunk_metadata",
    "compressed_slot_mapping",
    "compute_token_to_req_indices",
    "dspark_noncausal_swa_indices",
    "prefill_gather_lens",
    "prepare_uniform_decode",
    "swa_indices_and_lens",
]

PAD_ID = -1
_INT_DTYPES = (torch.int32, torch.int64)
#: A SWA index kernel's window rule: ``(window_size, tok, req, q_start, q_len, seq)``
#: (int64 ``[N]`` tensors but the int) -> the ``(start, end)`` positions of each row.
_Window = Callable[..., tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def _check(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int | tuple[int, ...],
    device: torch.device | None = None,
    dtypes: tuple[torch.dtype, ...] = _INT_DTYPES,
    min_len: int | None = None,
) -> None:
    """:func:`check_tensor` with this module's default (integer) dtypes."""
    check_tensor(name, t, ndim=ndim, dtype=dtypes, device=device, min_rows=min_len)


def _check_1d(device: torch.device, **tensors: torch.Tensor) -> None:
    """:func:`_check` of each keyword argument (named as the port's argument, checked in
    order): a 1-D integer tensor on ``device``."""
    for name, t in tensors.items():
        _check(name, t, ndim=1, device=device)


def _check_int(name: str, value: int, *, minimum: int) -> int:
    if isinstance(value, torch.Tensor) or int(value) != value or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


def _check_ints(minimum: int, **values: int) -> tuple[int, ...]:
    """:func:`_check_int` of each keyword argument, in order; the values as ints."""
    return tuple(_check_int(name, v, minimum=minimum) for name, v in values.items())


def _tdiv(a: torch.Tensor, b: int | torch.Tensor) -> torch.Tensor:
    # Triton integer division truncates toward zero; torch's // floors.
    return torch.div(a, b, rounding_mode="trunc")


def _tmod(a: torch.Tensor, b: int | torch.Tensor) -> torch.Tensor:
    # Triton integer remainder takes the sign of the dividend (C fmod).
    return torch.fmod(a, b)


def _request_of(
    bounds: torch.Tensor, num_reqs: int, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request of each flat index for the row ranges ``[bounds[r], bounds[r+1])``.

    Args:
        bounds: ``[>= num_reqs + 1]`` int32/int64, non-decreasing.
        num_reqs: number of ranges considered.
        idx: ``[N]`` int64 flat indices.

    Returns:
        ``(req, inside)``: ``req`` ``[N]`` int64 clamped into ``[0, num_reqs-1]``
        (0 when ``num_reqs == 0``); ``inside`` ``[N]`` bool, True where
        ``bounds[req] <= idx < bounds[req + 1]``. Empty ranges are never hit.
    """
    if num_reqs == 0:
        zeros = torch.zeros_like(idx)
        return zeros, torch.zeros_like(idx, dtype=torch.bool)
    b = bounds[: num_reqs + 1].to(torch.int64)
    # Number of ranges that end at or before idx == first range ending after
    # it: the same answer as the kernels' binary search on ``end <= token``.
    req = torch.searchsorted(b[1:].contiguous(), idx, right=True)
    inside = req < num_reqs
    req = req.clamp_(max=num_reqs - 1)
    inside &= idx >= b[req]
    return req, inside


# ----------------------------------------------------------------------------
# T1: token -> request index
# ----------------------------------------------------------------------------
def compute_token_to_req_indices(
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    num_mapped_tokens: int,
    num_tokens: int,
) -> torch.Tensor:
    """Map each of the first ``num_tokens`` tokens to its request index.

    Port of ``vllm.v1.attention.ops.metadata.compute_token_to_req_indices``.

    Args:
        query_start_loc: ``[R + 1]`` int32, cumulative query starts
            (non-decreasing; zero-length padding requests allowed).
        out: ``[>= num_tokens]`` int32, written in ``[:num_tokens]``.
        num_mapped_tokens: tokens ``>= num_mapped_tokens`` map to 0.
        num_tokens: number of entries written.

    Returns:
        ``out[:num_tokens]``: token t maps to the request r with
        ``query_start_loc[r] <= t < query_start_loc[r + 1]``; a token at or past
        ``query_start_loc[R]`` (but below ``num_mapped_tokens``) maps to ``R - 1``.
    """
    _check("query_start_loc", query_start_loc, ndim=1, min_len=1)
    _check("out", out, ndim=1, device=query_start_loc.device)
    num_tokens = _check_int("num_tokens", num_tokens, minimum=0)
    if out.shape[0] < num_tokens:
        raise ValueError(f"out: expected at least {num_tokens} rows, got shape {tuple(out.shape)}")
    num_reqs = query_start_loc.shape[0] - 1
    if num_tokens == 0:
        return out[:0]
    # The metadata build runs this once per KV cache group and step: the fewest ops
    # that give the kernel's answer (its binary search on ``end <= token``).
    if num_reqs == 0:
        # The kernel's search returns min(0, num_reqs - 1) = -1 here.
        req = torch.full((num_tokens,), -1, device=out.device, dtype=torch.int64)
    else:
        tok = torch.arange(num_tokens, device=out.device, dtype=query_start_loc.dtype)
        req = torch.searchsorted(query_start_loc[1:].contiguous(), tok, right=True)
        req.clamp_(max=num_reqs - 1)
    mapped = int(num_mapped_tokens)
    if mapped < num_tokens:
        req[max(mapped, 0):] = 0
    out[:num_tokens].copy_(req)
    return out[:num_tokens]


# ----------------------------------------------------------------------------
# T2: compressed slot mapping
# ----------------------------------------------------------------------------
def compressed_slot_mapping(
    compressed_slot_mapping: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    compress_ratio: int,
    dcp_world_size: int = 1,
    cp_interleave: int = 1,
) -> None:
    """Slot of each token's compressed state, written by the window's last token.

    Port of ``CompressedSlotMappingKernel`` (``mla/compressor_utils.py``), called
    by ``get_compressed_slot_mapping`` after it filled the buffer with -1.

    Args:
        compressed_slot_mapping: ``[N]`` int64, written for every token of
            requests ``0 .. B-1`` (``B = block_table.shape[0]``) that lies below N.
        slot_mapping: ``[>= tokens]`` int64, the tokens' own (uncompressed) slots;
            -1 marks a replayed/padded/other-rank token.
        query_start_loc: ``[>= B + 1]`` int32.
        seq_lens: ``[>= B]`` int32, total length incl. this step's query.
        block_table: ``[B, max_blocks]`` int32, compressed-cache block ids.
        block_size: compressed entries per block (``256 // compress_ratio``).
        compress_ratio: 4 or 128 (any ratio >= 1 works).
        dcp_world_size, cp_interleave: decode-context-parallel layout.

    Semantics per token at position ``pos``: valid iff ``(pos + 1) % ratio == 0``
    and its own slot is not -1; then ``local = pos // (ci * W) * ci + pos % ci``,
    ``j = local // ratio`` and the slot is
    ``block_table[r, j // block_size] * block_size + j % block_size`` (int64),
    else -1.
    """
    out = compressed_slot_mapping
    _check("compressed_slot_mapping", out, ndim=1)
    dev = out.device
    _check_1d(dev, slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens)
    _check("block_table", block_table, ndim=2, device=dev)
    block_size, ratio, world, ci = _check_ints(
        1, block_size=block_size, compress_ratio=compress_ratio, dcp_world_size=dcp_world_size,
        cp_interleave=cp_interleave,
    )
    num_reqs = block_table.shape[0]
    if query_start_loc.shape[0] < num_reqs + 1 or seq_lens.shape[0] < num_reqs:
        raise ValueError(
            f"query_start_loc/seq_lens: expected >= {num_reqs + 1}/{num_reqs} entries "
            f"for block_table {tuple(block_table.shape)}, got "
            f"{tuple(query_start_loc.shape)}/{tuple(seq_lens.shape)}"
        )
    n = out.shape[0]
    if num_reqs == 0 or n == 0:
        return
    # Three calls per step (C4, C128, the indexer's C4): half the ops of a literal
    # port, the same integers. pos = seq_len - query_len + (t - query_start)
    # = seq_len - query_end + t.
    t = torch.arange(n, device=dev, dtype=torch.int64)
    req, inside = _request_of(query_start_loc, num_reqs, t)
    ends = query_start_loc[1 : num_reqs + 1].to(torch.int64)
    pos = (seq_lens[:num_reqs].to(torch.int64) - ends)[req].add_(t)

    # Past the end of slot_mapping the kernel would read out of bounds; PAD.
    n_slots = slot_mapping.shape[0]
    if n_slots >= n:
        slot_ok = slot_mapping[:n] != PAD_ID
    else:
        slot_ok = torch.zeros(n, device=dev, dtype=torch.bool)
        slot_ok[:n_slots] = slot_mapping != PAD_ID
    valid = (pos + 1).fmod_(ratio) == 0
    valid &= slot_ok
    valid &= inside

    local_pos = pos if ci * world == 1 else _tdiv(pos, ci * world) * ci + _tmod(pos, ci)
    comp_pos = _tdiv(local_pos, ratio)
    blk = _tdiv(comp_pos, block_size).mul_(valid)
    slots = block_table[req, blk].to(torch.int64).mul_(block_size)
    slots.add_(_tmod(comp_pos, block_size))
    slots = torch.where(valid, slots, PAD_ID)
    out.copy_(torch.where(inside, slots.to(out.dtype), out))


# ----------------------------------------------------------------------------
# T3: indexer prefill chunk metadata
# ----------------------------------------------------------------------------
def build_prefill_chunk_metadata(
    query_start_loc: torch.Tensor,
    uncompressed_seq_lens: torch.Tensor,
    cu_compressed_seq_lens: torch.Tensor,
    row_start_cu_compressed_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    cu_compressed_seq_len_ks: torch.Tensor,
    cu_compressed_seq_len_ke: torch.Tensor,
    query_slice_start: int,
    query_slice_stop: int,
    DCP_RANK: int,  # noqa: N803 - the vLLM launcher's parameter name
    DCP_WORLD: int,  # noqa: N803
    DCP_INTERLEAVE: int,  # noqa: N803
    *,
    num_reqs: int,
    COMPRESS_RATIO: int,  # noqa: N803
) -> None:
    """Per-query-token K-row bounds and per-K-row request ids of one prefill chunk.

    Port of ``BuildPrefillChunkMetadataKernel`` (``mla/indexer.py``).

    Args:
        query_start_loc: ``[num_reqs + 1]`` int32, chunk-relative (starts at 0).
        uncompressed_seq_lens: ``[num_reqs]`` int32 total lengths.
        cu_compressed_seq_lens: ``[num_reqs + 1]`` int32 cumulative compressed
            lengths (row ranges of ``token_to_seq``).
        row_start_cu_compressed_seq_lens: ``[num_reqs]`` int32 row start of each
            request in the gathered K buffer (the same tensor without DCP).
        token_to_seq: ``[Σ compressed]`` int32, written: request of each K row.
        cu_compressed_seq_len_ks: ``[qs_stop - qs_start]`` int32, written:
            ``row_start[r]`` for each query token in the slice.
        cu_compressed_seq_len_ke: same shape, written:
            ``row_start[r] + (prefix_r + 1 + i) // COMPRESS_RATIO`` for the i-th
            query token of request r (DCP-localised when ``DCP_WORLD > 1``).
        query_slice_start, query_slice_stop: the chunk-relative query tokens
            ``[start, stop)`` whose rows are produced (output row 0 = start).
        DCP_RANK, DCP_WORLD, DCP_INTERLEAVE: decode-context-parallel layout.
        num_reqs: requests in the chunk.
        COMPRESS_RATIO: indexer compression ratio (4).
    """
    ks, ke = cu_compressed_seq_len_ks, cu_compressed_seq_len_ke
    _check("cu_compressed_seq_len_ks", ks, ndim=1)
    dev = ks.device
    _check("cu_compressed_seq_len_ke", ke, ndim=1, device=dev)
    num_reqs = _check_int("num_reqs", num_reqs, minimum=0)
    _check("query_start_loc", query_start_loc, ndim=1, device=dev, min_len=num_reqs + 1)
    _check("uncompressed_seq_lens", uncompressed_seq_lens, ndim=1, device=dev, min_len=num_reqs)
    _check(
        "cu_compressed_seq_lens",
        cu_compressed_seq_lens,
        ndim=1,
        device=dev,
        min_len=num_reqs + 1,
    )
    _check(
        "row_start_cu_compressed_seq_lens",
        row_start_cu_compressed_seq_lens,
        ndim=1,
        device=dev,
        min_len=num_reqs,
    )
    _check("token_to_seq", token_to_seq, ndim=1, device=dev)
    if ke.shape != ks.shape:
        raise ValueError(
            f"cu_compressed_seq_len_ke: expected shape {tuple(ks.shape)} "
            f"(as cu_compressed_seq_len_ks), got {tuple(ke.shape)}"
        )
    ratio = _check_int("COMPRESS_RATIO", COMPRESS_RATIO, minimum=1)
    world = _check_int("DCP_WORLD", DCP_WORLD, minimum=1)
    rank = _check_int("DCP_RANK", DCP_RANK, minimum=0)
    inter = _check_int("DCP_INTERLEAVE", DCP_INTERLEAVE, minimum=1)
    qs_start = int(query_slice_start)
    qs_stop = int(query_slice_stop)
    if num_reqs == 0:
        return

    # Query-token rows.
    n_out = ks.shape[0]
    if n_out > 0:
        j = torch.arange(n_out, device=dev, dtype=torch.int64)
        abs_pos = j + qs_start
        req, inside = _request_of(query_start_loc, num_reqs, abs_pos)
        inside &= abs_pos < qs_stop
        qsl = query_start_loc.to(torch.int64)
        offset = abs_pos - qsl[req]
        q_len = qsl[req + 1] - qsl[req]
        start_pos = uncompressed_seq_lens.to(torch.int64)[req] - q_len
        length = _tdiv(start_pos + 1 + offset, ratio)
        if world > 1:
            base = _tdiv(_tdiv(length, inter), world) * inter
            rem = length - base * world
            rem = (rem - rank * inter).clamp(min=0).clamp(max=inter)
            length = base + rem
        row_start = row_start_cu_compressed_seq_lens.to(torch.int64)[req]
        ks.copy_(torch.where(inside, row_start.to(ks.dtype), ks))
        ke.copy_(torch.where(inside, (row_start + length).to(ke.dtype), ke))

    # K rows -> request.
    n_rows = token_to_seq.shape[0]
    if n_rows > 0:
        k = torch.arange(n_rows, device=dev, dtype=torch.int64)
        req, inside = _request_of(cu_compressed_seq_lens, num_reqs, k)
        token_to_seq.copy_(torch.where(inside, req.to(token_to_seq.dtype), token_to_seq))


# ----------------------------------------------------------------------------
# T4: SWA indices and lengths (+ DSpark non-causal variant)
# ----------------------------------------------------------------------------
def _window_rows(
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    window_size: int,
    index_width: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    num_tokens: int,
    token_offset: int,
    window: _Window,
) -> None:
    """Shared body of the SWA index kernels: the DSpark kernel's launcher signature
    (:func:`swa_indices_and_lens`'s without the image and replay arguments) plus
    the kernel's ``window``, which gives the (start, end) positions of each row."""
    window_size = _check_int("window_size", window_size, minimum=1)
    _check("swa_indices", swa_indices, ndim=(2, 3), dtypes=(torch.int32, torch.int64))
    dev = swa_indices.device
    _check_1d(dev, swa_lens=swa_lens, query_start_loc=query_start_loc, seq_lens=seq_lens,
              token_to_req_indices=token_to_req_indices)
    _check("is_valid_token", is_valid_token, ndim=1, device=dev, dtypes=(torch.bool,))
    _check("block_table", block_table, ndim=2, device=dev)
    num_tokens, token_offset = _check_ints(0, num_tokens=num_tokens, token_offset=token_offset)
    block_size = _check_int("block_size", block_size, minimum=1)
    index_width = _check_int("index_width", index_width, minimum=0)
    rows = swa_indices.view(swa_indices.shape[0], -1)
    if rows.shape[0] < num_tokens or rows.shape[1] < index_width:
        raise ValueError(
            f"swa_indices: expected at least [{num_tokens}, {index_width}] rows x "
            f"columns, got shape {tuple(swa_indices.shape)}"
        )
    if swa_lens.shape[0] < num_tokens:
        raise ValueError(
            f"swa_lens: expected at least {num_tokens} rows, got {tuple(swa_lens.shape)}"
        )
    need = token_offset + num_tokens
    for name, t in (
        ("is_valid_token", is_valid_token),
        ("token_to_req_indices", token_to_req_indices),
    ):
        if t.shape[0] < need:
            raise ValueError(
                f"{name}: expected at least {need} entries (token_offset + num_tokens), "
                f"got {tuple(t.shape)}"
            )
    if num_tokens == 0:
        return
    tok = torch.arange(num_tokens, device=dev, dtype=torch.int64) + token_offset
    valid = is_valid_token[tok]
    req = token_to_req_indices[tok].to(torch.int64)
    # A padded token's request index is arbitrary: keep the gathers in range.
    req = torch.where(valid, req, torch.zeros_like(req))
    qsl = query_start_loc.to(torch.int64)
    q_start = qsl[req]
    q_len = qsl[req + 1] - q_start
    seq = seq_lens.to(torch.int64)[req]
    start, end = window(window_size, tok, req, q_start, q_len, seq)
    length = end - start
    swa_lens[:num_tokens] = torch.where(valid, length, torch.zeros_like(length)).to(swa_lens.dtype)
    if index_width == 0:
        return
    offs = torch.arange(index_width, device=dev, dtype=torch.int64)
    p = start.unsqueeze(1) + offs
    live = (offs < length.unsqueeze(1)) & valid.unsqueeze(1)
    blk = torch.where(live, _tdiv(p, block_size), torch.zeros_like(p))
    block_no = block_table[req.unsqueeze(1), blk].to(torch.int64)
    slots = block_no * block_size + _tmod(p, block_size)
    slots = torch.where(live, slots, torch.full_like(slots, PAD_ID))
    rows[:num_tokens, :index_width] = slots.to(rows.dtype)


def swa_indices_and_lens(
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    window_size: int,
    index_width: int,
    left_visible: torch.Tensor,
    right_visible: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    replay_start: torch.Tensor,
    *,
    num_tokens: int,
    token_offset: int,
    has_image: bool = False,
) -> None:
    """Paged SWA-cache slot ids of each token's causal window.

    Port of ``ComputeSWAIndicesAndLensKernel`` (``mla/sparse_swa.py``).

    Args:
        swa_indices: ``[>= num_tokens, 1, >= index_width]`` (or 2-D) int32,
            rows ``[:num_tokens]`` columns ``[:index_width]`` written: slots of
            positions ``start .. end-1`` ascending, then -1.
        swa_lens: ``[>= num_tokens]`` int32, written ``end - start`` (0 for an
            invalid token; may be <= 0 when ``replay_start`` passes the token).
        window_size: W (128 for DeepSeek-V4).
        index_width: columns written per row.
        left_visible, right_visible: ``[tokens]`` int32 in-image visibility,
            read only when ``has_image``.
        query_start_loc: ``[R + 1]`` int32; seq_lens: ``[R]`` int32.
        token_to_req_indices: ``[tokens]`` int32; is_valid_token: ``[tokens]`` bool.
        block_table: ``[R, max_blocks]`` int32 SWA-cache block ids.
        block_size: SWA-cache block size (tokens).
        replay_start: ``[R]`` int32, first position with window KV.
        num_tokens: rows produced; token_offset: input row of output row 0.
        has_image: read ``left_visible``/``right_visible``.

    Semantics for a valid token at position ``pos`` (``pos = seq_len - q_len +
    token - q_start``) with ``left``/``right`` (0 without images):
    ``start = max(pos - (W-1) - max(left - (W-1), 0), 0, replay_start[r])``,
    ``end = pos + right + 1``. An invalid token gets ``len 0`` and an all -1 row.
    """
    window_size = _check_int("window_size", window_size, minimum=1)
    if has_image:
        dev = swa_indices.device
        _check_1d(dev, left_visible=left_visible, right_visible=right_visible)
    _check("replay_start", replay_start, ndim=1, device=swa_indices.device)

    def causal_window(window_size, tok, req, q_start, q_len, seq):
        pos = seq - q_len + tok - q_start
        if has_image:
            left = left_visible[tok].to(torch.int64)
            right = right_visible[tok].to(torch.int64)
        else:
            left = torch.zeros_like(pos)
            right = torch.zeros_like(pos)
        left_add = (left - (window_size - 1)).clamp(min=0)
        start = (pos - (window_size - 1) - left_add).clamp(min=0)
        start = torch.maximum(start, replay_start.to(torch.int64)[req])
        return start, pos + right + 1

    _window_rows(
        swa_indices, swa_lens, window_size, index_width, query_start_loc, seq_lens,
        token_to_req_indices, is_valid_token, block_table, block_size,
        num_tokens=num_tokens, token_offset=token_offset, window=causal_window,
    )


def _noncausal_window(window_size, tok, req, q_start, q_len, seq):
    prefix = seq - q_len
    return (prefix - window_size).clamp(min=0), seq


dspark_noncausal_swa_indices = functools.partial(_window_rows, window=_noncausal_window)
# Named and documented like a function (the T6 kernel patch's TorchKernel shows both).
dspark_noncausal_swa_indices.__name__ = "dspark_noncausal_swa_indices"  # type: ignore[attr-defined]
dspark_noncausal_swa_indices.__doc__ = """Non-causal SWA slot ids of a DSpark draft block.

Port of ``ComputeDSparkNoncausalSWAIndicesKernel``: every token of a request sees
``[max(prefix - W, 0), seq_len)`` (the window before the block plus the whole block).
Arguments, shapes and invalid-token handling as :func:`swa_indices_and_lens` without
``left_visible``, ``right_visible``, ``replay_start`` and ``has_image``.
"""


# ----------------------------------------------------------------------------
# T5: prefill gather lengths
# ----------------------------------------------------------------------------
def prefill_gather_lens(
    prefill_gather_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    replay_start: torch.Tensor,
    num_prefills: int,
    num_decodes: int,
    window_size: int,
) -> None:
    """Rows each prefill gathers from its SWA window plus its own query.

    Port of ``ComputePrefillMetadataKernel`` (``mla/sparse_swa.py``).

    Args:
        prefill_gather_lens: ``[>= num_prefills]`` int32, written
            ``q_len + min(max(prefix - replay_start, 0), W - 1)`` per prefill.
        seq_lens: ``[R]`` int32; query_start_loc: ``[R + 1]`` int32;
        replay_start: ``[R]`` int32 (decodes first, prefills from
            ``num_decodes`` on).
        num_prefills, num_decodes: batch split; window_size: W.
    """
    out = prefill_gather_lens
    _check("prefill_gather_lens", out, ndim=1)
    dev = out.device
    num_prefills = _check_int("num_prefills", num_prefills, minimum=0)
    num_decodes = _check_int("num_decodes", num_decodes, minimum=0)
    window_size = _check_int("window_size", window_size, minimum=1)
    n_req = num_decodes + num_prefills
    _check("seq_lens", seq_lens, ndim=1, device=dev, min_len=n_req)
    _check("query_start_loc", query_start_loc, ndim=1, device=dev, min_len=n_req + 1)
    _check("replay_start", replay_start, ndim=1, device=dev, min_len=n_req)
    if out.shape[0] < num_prefills:
        raise ValueError(
            f"prefill_gather_lens: expected at least {num_prefills} rows, got {tuple(out.shape)}"
        )
    if num_prefills == 0:
        return
    r = slice(num_decodes, n_req)
    qsl = query_start_loc.to(torch.int64)
    q_len = qsl[num_decodes + 1 : n_req + 1] - qsl[r]
    prefix = seq_lens.to(torch.int64)[r] - q_len
    visible = (prefix - replay_start.to(torch.int64)[r]).clamp(min=0)
    out[:num_prefills] = (q_len + visible.clamp(max=window_size - 1)).to(out.dtype)


# ----------------------------------------------------------------------------
# C128A top-k metadata
# ----------------------------------------------------------------------------
def build_c128a_topk_metadata(
    global_decode_buffer: torch.Tensor,
    decode_lens_buffer: torch.Tensor,
    prefill_buffer: torch.Tensor,
    positions: torch.Tensor,
    compress_ratio: int,
    max_compressed_tokens: int,
    num_decode_tokens: int,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Dense "top-k" of C128 layers: every compressed entry a token can see.

    Port of ``BuildC128ATopkMetadataKernel`` (``deepseek_v4/sparse_mla.py``).
    With ``n = min((pos + 1) // ratio, max_compressed_tokens)``:

    Args:
        global_decode_buffer: ``[>= num_decode_tokens, >= max_compressed_tokens]``
            int32, decode rows written: global compressed-cache slots of entries
            ``0 .. n-1`` (``block_table[r, j // bs] * bs + j % bs``), then -1.
        decode_lens_buffer: ``[>= num_decode_tokens]`` int32, written: the number
            of valid columns, 0 when the token's ``slot_mapping`` is -1.
        prefill_buffer: ``[>= T - num_decode_tokens, >= max_compressed_tokens]``
            int32, prefill rows written: local ids ``0 .. n-1``, then -1.
        positions: ``[T]`` int64; decodes first.
        compress_ratio: 128; max_compressed_tokens: columns written per row.
        num_decode_tokens: leading decode tokens in ``positions``.
        token_to_req_indices: ``[>= num_decode_tokens]`` int32.
        block_table: ``[num_decodes, max_blocks]`` int32 compressed-cache blocks.
        block_size: compressed entries per block (``256 // 128 = 2``).
        slot_mapping: ``[>= num_decode_tokens]`` int64 token slots.
    """
    _check("positions", positions, ndim=1)
    dev = positions.device
    for name, t in (
        ("global_decode_buffer", global_decode_buffer),
        ("prefill_buffer", prefill_buffer),
    ):
        _check(name, t, ndim=2, device=dev)
    _check_1d(dev, decode_lens_buffer=decode_lens_buffer,
              token_to_req_indices=token_to_req_indices)
    _check("block_table", block_table, ndim=2, device=dev)
    _check("slot_mapping", slot_mapping, ndim=1, device=dev)
    ratio = _check_int("compress_ratio", compress_ratio, minimum=1)
    width, n_dec = _check_ints(
        0, max_compressed_tokens=max_compressed_tokens, num_decode_tokens=num_decode_tokens
    )
    block_size = _check_int("block_size", block_size, minimum=1)
    n_tok = positions.shape[0]
    if n_dec > n_tok:
        raise ValueError(
            f"num_decode_tokens: expected <= positions.shape[0] = {n_tok}, got {n_dec}"
        )
    n_pre = n_tok - n_dec
    for name, t, rows in (
        ("global_decode_buffer", global_decode_buffer, n_dec),
        ("prefill_buffer", prefill_buffer, n_pre),
    ):
        if t.shape[0] < rows or t.shape[1] < width:
            raise ValueError(f"{name}: expected at least [{rows}, {width}], got {tuple(t.shape)}")
    for name, t in (
        ("decode_lens_buffer", decode_lens_buffer),
        ("token_to_req_indices", token_to_req_indices),
        ("slot_mapping", slot_mapping),
    ):
        if t.shape[0] < n_dec:
            raise ValueError(f"{name}: expected at least {n_dec} rows, got {tuple(t.shape)}")
    if n_tok == 0:
        return
    n_comp = _tdiv(positions.to(torch.int64) + 1, ratio).clamp(max=width)
    offs = torch.arange(width, device=dev, dtype=torch.int64)
    if n_dec > 0:
        live = offs < n_comp[:n_dec].unsqueeze(1)
        req = token_to_req_indices[:n_dec].to(torch.int64).unsqueeze(1)
        blk = torch.where(live, _tdiv(offs, block_size), torch.zeros_like(offs))
        block_no = block_table[req, blk].to(torch.int64)
        slots = torch.where(
            live, block_no * block_size + _tmod(offs, block_size), torch.full_like(blk, -1)
        )
        global_decode_buffer[:n_dec, :width] = slots.to(global_decode_buffer.dtype)
        count = live.sum(dim=1)
        ok = slot_mapping[:n_dec] >= 0
        decode_lens_buffer[:n_dec] = torch.where(ok, count, torch.zeros_like(count)).to(
            decode_lens_buffer.dtype
        )
    if n_pre > 0 and width > 0:
        local = torch.where(offs < n_comp[n_dec:].unsqueeze(1), offs, torch.full_like(offs, -1))
        prefill_buffer[:n_pre, :width] = local.to(prefill_buffer.dtype)


# ----------------------------------------------------------------------------
# indexer uniform-decode preparation
# ----------------------------------------------------------------------------
def prepare_uniform_decode(
    seq_lens: torch.Tensor,
    decode_seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    expanded_block_table: torch.Tensor,
    decode_lens: torch.Tensor,
    num_decode_tokens: int,
    max_decode_len: int,
) -> None:
    """Flatten uniform multi-token decodes into single-token decode rows.

    Port of ``PrepareUniformDecodeKernel`` (``mla/indexer.py``). Token ``i``
    belongs to request ``i // max_decode_len`` as its ``i % max_decode_len``-th
    query token.

    Args:
        seq_lens: ``[>= num_decode_tokens / max_decode_len]`` int32.
        decode_seq_lens: ``[>= num_decode_tokens]`` int32, written:
            ``max(seq_len - max_decode_len + local + 1, 0)``.
        block_table: ``[R, C_in]`` int32 with ``C_in >= C``.
        expanded_block_table: ``[>= num_decode_tokens, C]`` int32, rows written
            with the request's first ``C`` block-table columns.
        decode_lens: ``[>= num_decode_tokens]`` int32, written 1.
        num_decode_tokens: rows produced; max_decode_len: tokens per request.
    """
    _check("seq_lens", seq_lens, ndim=1)
    dev = seq_lens.device
    _check("decode_seq_lens", decode_seq_lens, ndim=1, device=dev)
    _check("block_table", block_table, ndim=2, device=dev)
    _check("expanded_block_table", expanded_block_table, ndim=2, device=dev)
    _check("decode_lens", decode_lens, ndim=1, device=dev)
    n = _check_int("num_decode_tokens", num_decode_tokens, minimum=0)
    mdl = _check_int("max_decode_len", max_decode_len, minimum=1)
    cols = expanded_block_table.shape[1]
    if block_table.shape[1] < cols:
        raise ValueError(
            f"block_table: expected at least {cols} columns (expanded_block_table "
            f"{tuple(expanded_block_table.shape)}), got {tuple(block_table.shape)}"
        )
    n_req = -(-n // mdl)
    for name, t, rows in (
        ("decode_seq_lens", decode_seq_lens, n),
        ("expanded_block_table", expanded_block_table, n),
        ("decode_lens", decode_lens, n),
        ("seq_lens", seq_lens, n_req),
        ("block_table", block_table, n_req),
    ):
        if t.shape[0] < rows:
            raise ValueError(f"{name}: expected at least {rows} rows, got {tuple(t.shape)}")
    if n == 0:
        return
    idx = torch.arange(n, device=dev, dtype=torch.int64)
    req = idx // mdl
    local = idx - req * mdl
    lens = (seq_lens.to(torch.int64)[req] - mdl + local + 1).clamp(min=0)
    decode_seq_lens[:n] = lens.to(decode_seq_lens.dtype)
    expanded_block_table[:n] = block_table[req, :cols].to(expanded_block_table.dtype)
    decode_lens[:n] = 1
