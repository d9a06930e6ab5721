# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU layer's step tables: the index tables vLLM 0.32's CPU layer
rebuilds in every layer, built once per step and KV cache group.

Each depends only on the step's positions and one cache group's metadata:
the sliding-window slot table (:func:`window_slots`), C128's
(:func:`dense_compressed_slots`) and short-context C4's compressed slot
tables, the compressors' gather tables (:func:`gather_slots`) and the
short-context top-k rows (:func:`visible_rows`). The plugin builds each once
per step and cache group (:class:`StepTables`, one per model:
:func:`tables_for`), with fewer ops and the same values (``int64``, ``-1``
pads included), and every layer of the group reads it from there; the
kernels get the same inputs. ``tests/vllm/test_cpu_slot_tables.py`` holds
each to vLLM's own formula.

Imports no vLLM: the tables are torch index arithmetic on vLLM's metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_dsv4_backend import testing
from vllm_dsv4_backend.workspace import WorkspaceManager

__all__ = [
    "StepTables",
    "cached_arange",
    "dense_compressed_slots",
    "gather_slots",
    "map_slots",
    "short_context",
    "tables_for",
    "visible_rows",
    "window_slots",
]


class StepTables:
    """Per-model cache of one step's index tables (slot tables, compressor
    gather tables, short-context top-k rows), one per table kind and metadata
    object. The tables are read-only inputs of the kernels and copies.

    A table depends on the step's positions and on one KV cache group's
    metadata (its block table). Layers of the same group get the same
    metadata object; a model has several groups (the tiny model's SWA caches
    form two, layers 0/2 and 1/3), so the cache keeps one entry per kind and
    metadata object, not one per kind (that thrashed: every layer rebuilt its
    window table). Cleared as every model step begins (the layer's region
    holder), and an entry holds its metadata and positions objects and is
    reused only for those very objects, so a table can never outlive the step
    it was built for.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int, int], tuple[Any, torch.Tensor, torch.Tensor]] = {}

    def clear(self) -> None:
        self._entries.clear()

    def get(self, kind: str, md: Any, positions: torch.Tensor, build: Any) -> torch.Tensor:
        key = (kind, id(md), id(positions))
        hit = self._entries.get(key)
        if hit is not None and hit[0] is md and hit[1] is positions:
            return hit[2]
        value = build()
        self._entries[key] = (md, positions, value)
        return value


_step_tables: dict[int, StepTables] = {}


def tables_for(workspace: WorkspaceManager) -> StepTables:
    """The step tables of ``workspace``'s model (one per model per process)."""
    return _step_tables.setdefault(id(workspace), StepTables())


def short_context(indexer_md: Any, compress_ratio: int, topk_tokens: int) -> bool:
    """vLLM's rule (``DeepseekV4CPUIndexer.forward``): no row sees more than
    ``topk_tokens`` compressed entries, so the indexer fills "every visible
    entry" instead of scoring."""
    return indexer_md.max_seq_len // compress_ratio <= topk_tokens


def cached_arange(owner: Any, name: str, n: int, device: torch.device,
                  dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``arange(n)`` kept on ``owner`` as ``name`` (a plain attribute, not a module
    buffer) and rebuilt only when the device or length changes, so a table build
    allocates no index vector."""
    cached = owner.__dict__.get(name)
    if cached is None or cached.device != device or cached.shape[0] != n:
        cached = torch.arange(n, device=device, dtype=dtype)
        owner.__dict__[name] = cached
    return cached


def map_slots(
    local: torch.Tensor, req_idx: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``map_local_to_global_slots_cpu`` (vLLM's, same int64 result) in fewer
    ops: every intermediate but the block ids and the result is updated in
    place, and the -1 rows are masked once at the end."""
    invalid = local < 0
    offset = local.clamp(min=0).to(torch.int64)
    block_pos = torch.div(offset, block_size, rounding_mode="floor")
    offset.remainder_(block_size)
    slot = block_table[req_idx.unsqueeze(-1), block_pos].to(torch.int64)
    return slot.mul_(block_size).add_(offset).masked_fill_(invalid, -1)


def window_slots(layer: Any, swa_md: Any, positions: torch.Tensor) -> torch.Tensor:
    """vLLM's causal sliding-window slot table ``[T, W]`` (int64, -1 pads) of
    ``layer`` (its ``window_size``), the same values as its ``forward_mqa``
    builds, in half the ops: column ``j`` holds window position
    ``max(p - W + 1, 0) + j``, -1 past ``p``."""
    window = layer.window_size
    offsets = cached_arange(layer, "_win_offsets", window, positions.device)
    pos = positions.unsqueeze(-1)
    local = (positions - (window - 1)).clamp_(min=0).unsqueeze(-1) + offsets
    # Columns past p (only when p < W - 1) are -1; they read block 0 like
    # vLLM's clamped -1 before being masked.
    invalid = local > pos
    local.masked_fill_(invalid, 0)
    block_size = swa_md.block_size
    block_pos = torch.div(local, block_size, rounding_mode="floor")
    local.remainder_(block_size)
    slot = swa_md.block_table[swa_md.token_to_req_indices.unsqueeze(-1), block_pos]
    slot = slot.to(torch.int64)
    return slot.mul_(block_size).add_(local).masked_fill_(invalid, -1)


def dense_compressed_slots(
    layer: Any, swa_md: Any, flash_md: Any, positions: torch.Tensor
) -> torch.Tensor:
    """vLLM's C128 table of ``layer`` (its ``max_model_len`` and
    ``compress_ratio``): every visible compressed entry, as global slots."""
    num_tokens = positions.shape[0]
    device = positions.device
    width = -(-layer.max_model_len // layer.compress_ratio)
    # compress_lag(): 0 unless a test shifts the boundary (negative control).
    num_compressed = torch.div(
        positions + 1 - testing.compress_lag(), layer.compress_ratio, rounding_mode="floor"
    ).clamp(max=width)
    arange_w = torch.arange(width, device=device)
    local_topk = torch.where(
        arange_w.unsqueeze(0) < num_compressed.unsqueeze(-1),
        arange_w.unsqueeze(0).expand(num_tokens, width),
        torch.full((num_tokens, width), -1, device=device, dtype=torch.int64),
    )
    return map_slots(
        local_topk, swa_md.token_to_req_indices, flash_md.block_table,
        flash_md.block_size // layer.compress_ratio,
    )


def gather_slots(
    compressor: Any, state_md: Any, positions: torch.Tensor, window: int
) -> torch.Tensor:
    """A compressor's gather table: vLLM's ``map_local_to_global_slots_cpu``
    of the window ``p - window + 1 .. p`` of every token (-1 before position 0)."""
    offsets = cached_arange(compressor, "_dsv4_offsets", window, positions.device)
    local = (positions - (window - 1)).unsqueeze(-1) + offsets
    num_actual = state_md.slot_mapping.shape[0]
    return map_slots(local, state_md.token_to_req_indices[:num_actual],
                     state_md.block_table, state_md.block_size)


def visible_rows(indexer: Any, positions: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The short-context top-k rows of ``indexer`` (its ``topk_tokens``,
    ``compress_ratio`` and top-k buffer's dtype): every visible entry, ``-1``
    past ``(p + 1) // compress_ratio``."""
    buf = indexer.topk_indices_buffer
    arange = cached_arange(indexer, "_dsv4_arange", indexer.topk_tokens, buf.device, buf.dtype)
    visible = torch.div(positions[:num_tokens] + 1, indexer.compress_ratio,
                        rounding_mode="floor")
    return torch.where(arange < visible.unsqueeze(-1), arange, -1)
