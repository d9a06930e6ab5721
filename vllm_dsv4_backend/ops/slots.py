# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-step slot-id tables for DeepSeek-V4's sparse attention (torch only).

Both functions turn positions into *global* paged-cache slot ids
(``block_table[req, j // block_size] * block_size + j % block_size``) laid out
valid-first then -1, which is what FlashMLA's ``indices`` + ``topk_length``
expect. They run once per step in the metadata builders (not per layer) and
write into caller-owned buffers so the addresses are stable across steps.
"""

from __future__ import annotations

import torch

from vllm_dsv4_backend._checks import check_tensor


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
    out.copy_(torch.where(valid, slots, torch.full_like(slots, -1)))


def window_slots(
    out_indices: torch.Tensor,
    out_lens: torch.Tensor,
    *,
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    arange: torch.Tensor,
) -> None:
    """Sliding-window slot ids.

    Args:
        out_indices: ``[T, W]`` int32, written: slots of positions
            ``max(0, p - W + 1) .. p`` ascending, then -1.
        out_lens: ``[T]`` int32, written: ``min(W, p + 1)``.
        positions: ``[T]`` int64 absolute positions.
        token_to_req: ``[T]`` int request row of each token in ``block_table``.
        block_table: ``[R, max_blocks]`` int32 SWA-cache block ids.
        block_size: tokens per SWA-cache block.
        arange: ``[W]`` int32 ``0..W-1`` (persistent, to avoid re-creating it).
    """
    num_tokens, width = out_indices.shape
    check_tensor("out_lens", out_lens, shape=(num_tokens,), dtype=torch.int32)
    if num_tokens == 0:
        return
    pos = positions.long()
    start = (pos - width + 1).clamp(min=0)
    local = start.unsqueeze(1) + arange.long().unsqueeze(0)
    valid = local <= pos.unsqueeze(1)
    _map_to_global(local, valid, token_to_req, block_table, block_size, out_indices)
    out_lens.copy_(torch.minimum(pos + 1, torch.full_like(pos, width)))


def all_visible_compressed_slots(
    out_indices: torch.Tensor,
    out_lens: torch.Tensor,
    *,
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    compress_ratio: int,
    arange: torch.Tensor,
) -> None:
    """Every compressed entry a token may see (C128/HCA layers).

    Entry ``j`` is visible to position ``p`` iff ``j < (p + 1) // ratio``.

    Args:
        out_indices: ``[T, W]`` int32, written: global compressed slots of
            ``j = 0 .. n-1`` then -1, ``n = min(W, (p + 1) // ratio)``.
        out_lens: ``[T]`` int32, written: ``n``.
        block_size: compressed entries per block (256 / ratio in vLLM).
        arange: ``[W]`` int32 ``0..W-1``.
    """
    num_tokens, width = out_indices.shape
    check_tensor("out_lens", out_lens, shape=(num_tokens,), dtype=torch.int32)
    if num_tokens == 0:
        return
    n = torch.div(positions.long() + 1, compress_ratio, rounding_mode="floor").clamp_(max=width)
    local = arange.long().unsqueeze(0).expand(num_tokens, width)
    valid = local < n.unsqueeze(1)
    _map_to_global(local, valid, token_to_req, block_table, block_size, out_indices)
    out_lens.copy_(n)
