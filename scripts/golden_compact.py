# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How ``scripts/record_golden.py`` cuts a kernel call down to a few token rows
and cache blocks that still replay exactly.

:data:`LAYOUT` says, per op of :data:`vllm_dsv4_backend.vllm_compat.cpu_ops.OPS`,
which arguments are indexed by token row, which are paged caches (and how their
slots address blocks) and which are cos/sin tables; the functions below cut a
call by it: caches restricted to the blocks the kept rows use (slots renumbered),
the rows kept (what dropped rows wrote reset), the cos/sin tables stored at the
rows' positions only. The recorder applies them to live calls, ``subset`` to
recorded ones. torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_dsv4_backend.vllm_compat.cpu_ops import OPS


# ----------------------------------------------------------------------------
# per-op layout: which arguments are indexed by token row, which are caches
# ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheSpec:
    """A paged cache argument: blocks on dim 0, addressed by ``slots`` args.

    ``block_size``: the int argument naming entries per block, or ``"dim1"``
    (state caches ``[nb, bs, D]``). ``by_block``: ``slots`` hold block ids
    (``page_table``), not ``block * bs + offset`` slots. ``fmt`` (writers
    only): entry byte layout used to reset entries of rows not kept.
    """

    name: str
    slots: tuple[str, ...]
    block_size: str
    writer: bool = False
    fmt: str | None = None
    by_block: bool = False


@dataclass(frozen=True)
class OpLayout:
    rows_in: dict[str, int] = field(default_factory=dict)  # arg -> row dim
    rows_out: dict[str, int] = field(default_factory=dict)  # output -> row dim
    caches: tuple[CacheSpec, ...] = ()
    rope: tuple[str, ...] = ()  # cos/sin tables read at the rows' positions


def _compress_norm_rope_store(kv_fmt: str) -> OpLayout:
    """The compressor's store ops (attention and indexer alike): state read at the
    gathered slots, compressed entries written in ``kv_fmt`` at ``kv_slot_mapping``."""
    return OpLayout(
        {"gather_slots": 0, "positions": 0, "kv_slot_mapping": 0},
        {},
        (
            CacheSpec("state_cache", ("gather_slots",), "dim1"),
            CacheSpec("kv_cache_2d", ("kv_slot_mapping",), "kv_cache_block_size", True, kv_fmt),
        ),
        ("cos_sin_cache",),
    )


_T0 = {"return": 0}
LAYOUT: dict[str, OpLayout] = {
    "convert_weight_packed": OpLayout(),
    "bmm_cpu": OpLayout({"out": 1, "mat1": 1}, {"out": 1}),
    "fused_qnorm_rope_kv_insert_cpu": OpLayout(
        {"q": 0, "kv": 0, "positions": 0, "slot_mapping": 0},
        _T0,
        (CacheSpec("swa_kv_cache_2d", ("slot_mapping",), "cache_block_size", True, "fp8_ds_mla"),),
        ("cos_sin_cache",),
    ),
    "inverse_gptj_rope_o_proj_cpu": OpLayout({"o": 0, "positions": 0}, _T0, (), ("cos_sin_cache",)),
    "flash_mla_with_kvcache_cpu": OpLayout(
        {"out": 0, "q": 0, "window_slots": 0, "compressed_slots": 0},
        {"out": 0},
        (
            CacheSpec("window_cache_2d", ("window_slots",), "window_block_size"),
            CacheSpec("compressed_cache_2d", ("compressed_slots",), "compressed_block_size"),
        ),
    ),
    "save_partial_states_cpu": OpLayout(
        {"kv": 0, "score": 0, "positions": 0, "slot_mapping": 0},
        {},
        (CacheSpec("state_cache", ("slot_mapping",), "dim1", True, "state"),),
    ),
    "compress_norm_rope_store_cpu": _compress_norm_rope_store("fp8_ds_mla"),
    "compress_norm_rope_store_indexer_cpu": _compress_norm_rope_store("indexer_fp8"),
    "hc_pre_fused_cpu": OpLayout({"x": 0}, {"return_0": 0, "return_1": 0, "return_2": 0}),
    "hc_post_fused_cpu": OpLayout({"x": 0, "residual": 0, "post": 0, "comb": 0}, _T0),
    "hc_head_fused_cpu": OpLayout({"x": 0}, _T0),
    "biased_topk_cpu": OpLayout(
        {"hidden_states": 0, "gating_output": 0}, {"return_0": 0, "return_1": 0}
    ),
    "hash_topk_cpu": OpLayout({"gating_output": 0, "tid2eid": 0}, {"return_0": 0, "return_1": 0}),
    "fused_indexer_q_rope_quant_cpu": OpLayout(
        {
            "positions": 0,
            "index_q": 0,
            "index_q_fp8": 0,
            "index_weights": 0,
            "index_weights_out": 0,
        },
        {"index_q_fp8": 0, "index_weights_out": 0},
        (),
        ("index_q_cos_sin_cache",),
    ),
    "fp8_paged_mqa_logits_cpu": OpLayout(
        {"q_fp8": 0, "weight": 0, "seq_lens": 0, "page_table": 0},
        _T0,
        (CacheSpec("kvcache_fp8", ("page_table",), "block_size", by_block=True),),
    ),
    "topk_transform_512_cpu": OpLayout(
        {"scores": 0, "seq_lens": 0, "page_tables": 0, "out_page_indices": 0, "out_raw_indices": 0},
        {"out_page_indices": 0, "out_raw_indices": 0},
    ),
}
assert set(LAYOUT) == {op.name for op in OPS}, "LAYOUT must cover cpu_ops.OPS exactly"


def _block_size(spec: CacheSpec, args: dict[str, Any]) -> int:
    cache = args[spec.name]
    return int(cache.shape[1]) if spec.block_size == "dim1" else int(args[spec.block_size])


def _entry_ranges(fmt: str, block_size: int, t: int) -> list[tuple[int, int]]:
    """Byte ranges of entry ``t`` in one block row of a 2-D cache view (block-split
    layout: all values, then all scales)."""
    if fmt == "fp8_ds_mla":
        return [(576 * t, 576 * t + 576), (576 * block_size + 8 * t, 576 * block_size + 8 * t + 8)]
    if fmt == "indexer_fp8":
        return [(128 * t, 128 * t + 128), (128 * block_size + 4 * t, 128 * block_size + 4 * t + 4)]
    raise ValueError(fmt)


# ----------------------------------------------------------------------------
# compaction: restrict caches to the blocks some rows use, keep those rows
# ----------------------------------------------------------------------------
def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _take_rows(t: torch.Tensor, dim: int, rows: torch.Tensor) -> torch.Tensor:
    return t.index_select(dim, rows).contiguous()  # a new tensor: its own storage


def _take_rows_views(args: dict[str, Any], names: list[str], rows: torch.Tensor) -> None:
    """Row-slice args that are column views of one ``[T, C]`` buffer (vLLM's
    ``kv_score.split()``) into views of one new buffer, like the original."""
    base_t = args[names[0]]
    stride0 = base_t.stride(0)
    lo = min(args[n].storage_offset() for n in names)
    width = max(args[n].storage_offset() - lo + args[n].shape[1] for n in names)
    base = torch.as_strided(base_t, (base_t.shape[0], width), (stride0, 1), lo)
    new = base.index_select(0, rows).contiguous()
    for n in names:
        off = args[n].storage_offset() - lo
        args[n] = new[:, off : off + args[n].shape[1]]


def restrict_blocks(
    op: str, args: dict[str, Any], rows: torch.Tensor
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Caches cut to the blocks that ``rows`` reference (original order) and the
    slot arguments renumbered into them (-1 stays -1; other rows' slots are
    renumbered too, to -1 where their block is gone). Returns the new args and
    the kept original block ids per cache. Caches that are the same tensor
    (SWA-only layers pass the window cache twice) stay one tensor."""
    lay = LAYOUT[op]
    out = dict(args)
    kept: dict[str, torch.Tensor] = {}
    done: dict[int, str] = {}
    for spec in lay.caches:
        cache = args[spec.name]
        bs = _block_size(spec, args)
        used = []
        for s in spec.slots:
            v = args[s].index_select(0, rows).reshape(-1).long()
            v = v[v >= 0]
            used.append(v if spec.by_block else v // bs)
        blocks = torch.unique(torch.cat(used)) if used else torch.zeros(0, dtype=torch.long)
        blocks = blocks[blocks < cache.shape[0]]
        key = cache.untyped_storage().data_ptr() + cache.storage_offset()
        if key in done and args[done[key]].shape == cache.shape:
            # Same tensor as an earlier cache arg: one compact tensor, union of blocks.
            first = done[key]
            blocks = torch.unique(torch.cat([kept[first], blocks]))
            kept[first] = blocks
            kept[spec.name] = blocks
        else:
            done[key] = spec.name
            kept[spec.name] = blocks
    # Build the tensors and remap after the unions are final.
    built: dict[str, torch.Tensor] = {}
    for spec in lay.caches:
        cache = args[spec.name]
        blocks = kept[spec.name]
        key = cache.untyped_storage().data_ptr() + cache.storage_offset()
        first = done[key]
        if first not in built:
            built[first] = cache.index_select(0, blocks).contiguous()
        out[spec.name] = built[first]
        bs = _block_size(spec, args)
        inv = torch.full((cache.shape[0] + 1,), -1, dtype=torch.long)
        inv[blocks] = torch.arange(blocks.numel())
        for s in spec.slots:
            v = args[s].long()
            blk = v if spec.by_block else v.div(bs, rounding_mode="floor")
            ok = (v >= 0) & (blk < cache.shape[0])
            nb = inv[blk.clamp(0, cache.shape[0])]
            ok &= nb >= 0
            new = nb if spec.by_block else nb * bs + v.remainder(bs)
            out[s] = torch.where(ok, new, torch.full_like(new, -1)).to(args[s].dtype)
    return out, kept


def cut_cache_outputs(
    op: str, outputs: dict[str, Any], kept: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The same blocks of the caches the op wrote (full or compact outputs)."""
    res = dict(outputs)
    for spec in LAYOUT[op].caches:
        if spec.writer and spec.name in outputs:
            res[spec.name] = outputs[spec.name].index_select(0, kept[spec.name]).contiguous()
    return res


def keep_rows(
    op: str, args: dict[str, Any], outputs: dict[str, Any], rows: torch.Tensor
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keep token ``rows`` of a call whose caches are already restricted.

    Writers: cache entries written by dropped rows are reset to their bytes
    before the call, so the kept rows' call reproduces the outputs exactly.
    """
    lay = LAYOUT[op]
    args = dict(args)
    outputs = dict(outputs)
    num = None
    for n, d in lay.rows_in.items():
        if isinstance(args.get(n), torch.Tensor):
            num = args[n].shape[d]
            break
    assert num is not None, op
    dropped = torch.tensor(sorted(set(range(num)) - set(rows.tolist())), dtype=torch.long)
    # Writers first (needs the dropped rows' slots before slicing them away).
    for spec in lay.caches:
        if not spec.writer or spec.name not in outputs or dropped.numel() == 0:
            continue
        bs = _block_size(spec, args)
        before, after = args[spec.name], outputs[spec.name].clone()
        slots = args[spec.slots[0]].index_select(0, dropped).reshape(-1).long()
        for s in slots[slots >= 0].tolist():
            blk, t = divmod(s, bs)
            if blk >= after.shape[0]:
                continue
            if spec.fmt == "state":
                after[blk, t] = before[blk, t]
            else:
                for a, b in _entry_ranges(str(spec.fmt), bs, t):
                    after[blk, a:b] = before[blk, a:b]
        outputs[spec.name] = after
    shared = [n for n in lay.rows_in if isinstance(args.get(n), torch.Tensor)]
    groups: list[list[str]] = []
    for n in shared:
        for g in groups:
            a, b = args[g[0]], args[n]
            if (
                _same_storage(a, b)
                and a.dim() == b.dim() == 2
                and a.stride(0) == b.stride(0)
                and lay.rows_in[n] == lay.rows_in[g[0]] == 0
            ):
                g.append(n)
                break
        else:
            groups.append([n])
    for g in groups:
        if len(g) > 1:
            _take_rows_views(args, g, rows)
        else:
            args[g[0]] = _take_rows(args[g[0]], lay.rows_in[g[0]], rows)
    for n, d in lay.rows_out.items():
        if isinstance(outputs.get(n), torch.Tensor):
            outputs[n] = _take_rows(outputs[n], d, rows)
    return args, outputs


def compact_storages(d: dict[str, Any]) -> dict[str, Any]:
    """Copies of tensors that view a larger storage (``torch.save`` writes whole
    storages), except tensors sharing one storage (kept as views of one buffer)."""
    owners: dict[int, int] = {}
    for v in d.values():
        if isinstance(v, torch.Tensor):
            k = v.untyped_storage().data_ptr()
            owners[k] = owners.get(k, 0) + 1
    res = {}
    for k, v in d.items():
        if (
            isinstance(v, torch.Tensor)
            and owners[v.untyped_storage().data_ptr()] == 1
            and v.untyped_storage().nbytes() > v.numel() * v.element_size()
        ):
            v = v.clone(memory_format=torch.contiguous_format)
        res[k] = v
    return res


def rope_rows(op: str, args: dict[str, Any]) -> torch.Tensor:
    """Rows of the cos/sin table(s) the op reads: the positions of its rows; for the
    compressors the first position of each compressed group, ``p // r * r``
    (found by replaying with NaN in every other row)."""
    pos = args["positions"].long().reshape(-1)
    if op.startswith("compress_norm_rope_store"):
        ratio = int(args["compress_ratio"])
        pos = pos.div(ratio, rounding_mode="floor") * ratio
    return torch.unique(pos[(pos >= 0)])


def as_rows_ref(table: torch.Tensor, rows: torch.Tensor) -> dict[str, Any]:
    """A ``{"__rows__": ...}`` reference (see golden_io): only ``rows`` stored."""
    return {
        "__rows__": {
            "rows": rows.clone(),
            "values": table[rows].clone(),
            "shape": list(table.shape),
        }
    }


def default_rows(positions: list[int] | None, num: int) -> list[int]:
    """Rows kept from a prefill call: per request (a new request starts where the
    position does not grow by one) the first and the last row, and the rows at
    positions 3, 127, 128, 511, 2047, 2048, 2175 (the compression and window
    boundaries of the tiny model). Without positions: first, middle, last."""
    if positions is None:
        return sorted({0, num // 2, num - 1})
    keep = set()
    start = 0
    for i in range(1, num + 1):
        if i == num or positions[i] != positions[i - 1] + 1:
            keep.update({start, i - 1})
            start = i
    keep.update(i for i, p in enumerate(positions) if p in (3, 127, 128, 511, 2047, 2048, 2175))
    return sorted(keep)
