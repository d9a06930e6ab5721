# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-step slot-id tables for DeepSeek-V4's sparse attention (torch only).

Both tables turn positions into *global* paged-cache slot ids
(``block_table[req, j // block_size] * block_size + j % block_size``) laid out
valid-first then -1, which is what FlashMLA's ``indices`` + ``topk_length``
expect. They run once per step in the metadata builders (not per layer) and
write into caller-owned buffers so the addresses are stable across steps.
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv4_backend._checks import check_tensor
from vllm_dsv4_backend.ops.checks import check_int32_slots


def _map_to_global(
    local: torch.Tensor,
    valid: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> None:
    safe = torch.where(valid, local, torch.zeros_like(local)).long()
    block_idx = (safe // block_size).clamp_(max=block_table.shape[1] - 1)
    blocks = block_table[token_to_req.long().unsqueeze(1), block_idx].long()
    slots = blocks * block_size + safe % block_size
    # A -1 (unallocated) block-table entry must never turn into a real slot.
    valid = valid & (blocks >= 0)
    slots = torch.where(valid, slots, torch.full_like(slots, -1))
    check_int32_slots("visible_slots", slots, block_size)
    out.copy_(slots)


def visible_slots(
    out_indices: torch.Tensor,
    out_lens: torch.Tensor,
    *,
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    arange: torch.Tensor,
    compress_ratio: int | None,
) -> None:
    """Slot ids of the cache entries each token sees.

    ``compress_ratio`` None (:data:`window_slots`): the sliding window of raw
    positions ``max(0, p - W + 1) .. p`` in the SWA cache. An int
    (:data:`all_visible_compressed_slots`, C128/HCA layers): every compressed
    entry, ``j`` visible to position ``p`` iff ``j < (p + 1) // ratio``, the
    first ``W`` of them.

    Args:
        out_indices: ``[T, W]`` int32, written: global slots of the ``n`` visible
            entries ascending, then -1.
        out_lens: ``[T]`` int32, written: ``n`` (``min(W, p + 1)`` for the window,
            ``min(W, (p + 1) // ratio)`` for compressed entries).
        positions: ``[T]`` int64 absolute positions.
        token_to_req: ``[T]`` int request row of each token in ``block_table``.
        block_table: ``[R, max_blocks]`` int32 block ids (SWA or compressed cache).
        block_size: tokens (entries) per block (compressed: 256 / ratio in vLLM).
        arange: ``[W]`` int32 ``0..W-1`` (persistent, to avoid re-creating it).
        compress_ratio: None (window) or the layer's compression ratio.
    """
    num_tokens, width = out_indices.shape
    check_tensor("out_lens", out_lens, shape=(num_tokens,), dtype=torch.int32)
    if num_tokens == 0:
        return
    pos = positions.long()
    if compress_ratio is None:
        start = (pos - width + 1).clamp(min=0)
        local = start.unsqueeze(1) + arange.long().unsqueeze(0)
        valid = local <= pos.unsqueeze(1)
        lens = torch.minimum(pos + 1, torch.full_like(pos, width))
    else:
        lens = torch.div(pos + 1, compress_ratio, rounding_mode="floor").clamp_(max=width)
        local = arange.long().unsqueeze(0).expand(num_tokens, width)
        valid = local < lens.unsqueeze(1)
    _map_to_global(local, valid, token_to_req, block_table, block_size, out_indices)
    out_lens.copy_(lens)


#: Sliding-window slot ids: :func:`visible_slots` without ``compress_ratio``.
window_slots = functools.partial(visible_slots, compress_ratio=None)

#: Every compressed entry a token may see: :func:`visible_slots` with the
#: required keyword ``compress_ratio``.
all_visible_compressed_slots = visible_slots
