# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""PyTorch's CUDA caching allocator and CUDA-graph private pools, modelled
for :mod:`simcuda` (whose tensors are CPU tensors).

What the model keeps of PyTorch's semantics (``c10/cuda/CUDACachingAllocator``):

* a block belongs to the stream it was allocated on; when its last tensor
  dies it is free **at once** for that stream (stream order makes that safe
  for work on the same stream, and only for it);
* ``Tensor.record_stream(s)`` marks the block as used on ``s``: at free
  time an event is recorded on each such stream, and the block goes back
  to its pool only when every one has completed (``process_events``);
* reuse is aggressive: the most recently freed block of the stream that
  is large enough (sizes rounded to 512 B);
* graph private pools: an allocation while the stream captures comes from
  that capture's pool (``torch.cuda.graph(pool=...)``; captures sharing a
  handle share a pool, as vLLM shares one), its blocks are only ever reused
  by captures into the same pool, and a block freed during a capture with
  uses recorded on other streams waits for the capture to end; eager work
  between replays allocates outside every graph pool.

A block is freed when nothing but the allocator holds its storage (its
use count; checked when the tensor the allocator returned dies, and again
at each allocation while a view or a detached alias still holds it): queued
launches hold :class:`Ref` recipes (block, offset, shape, strides), never
tensors, so, as on a GPU, a pending kernel does not keep its inputs
allocated. Blocks are never returned to the CPU allocator, so no address
is ever shared by two blocks: the race detector keeps a reused block's
access history (a reuse that is not ordered after the old users is a race),
and is told only of fresh blocks.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

ROUND = 512


class Block:
    """One allocation: a storage of ``nbytes``, its stream and pool."""

    __slots__ = ("id", "storage", "nbytes", "stream", "pool", "recorded")
    _ids = itertools.count()

    def __init__(self, nbytes: int, stream: Any, pool: Any) -> None:
        self.id = next(self._ids)
        self.storage = torch.UntypedStorage(nbytes)
        self.nbytes = nbytes
        self.stream = stream
        self.pool = pool
        self.recorded: dict[int, Any] = {}  # stream id -> stream (record_stream)


class Ref:
    """A tensor's place in a block, without holding its storage: what a queued
    or captured launch keeps; :meth:`tensor` makes the view when it runs."""

    __slots__ = ("block", "offset", "shape", "stride", "dtype")

    def __init__(self, block: Block, t: torch.Tensor) -> None:
        self.block, self.offset = block, t.storage_offset()
        self.shape, self.stride, self.dtype = tuple(t.shape), t.stride(), t.dtype

    def tensor(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype).set_(self.block.storage, self.offset,
                                                     self.shape, self.stride)


def _on_free(allocator: weakref.ref[CachingAllocator], block: Block) -> None:
    a = allocator()
    if a is not None:
        a._on_free(block)


def materialize(x: Any) -> Any:
    return x.tensor() if isinstance(x, Ref) else x


def _held(block: Block) -> bool:
    """Something besides the allocator's own reference holds the storage."""
    return torch._C._storage_Use_Count(block.storage._cdata) > 1


class CachingAllocator:
    """The model (see the module docstring). ``rt`` is the :class:`SimCuda`
    runtime: its streams, capture state, records and observer."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.free: dict[tuple[Any, int], list[Block]] = {}
        self.pending: list[tuple[Block, list[Any]]] = []  # freed, recorded events pending
        self.at_capture_end: list[Block] = []
        self._freed: list[Block] = []  # finalised, not yet processed (no stream work in GC)
        self._suspects: dict[int, Block] = {}  # tensor gone, storage maybe still held
        self.by_ptr: dict[int, Block] = {}
        self.last_fresh: int | None = None  # the storage of the last block, if fresh
        self.closed = False
        self.counts = {"fresh": 0, "reused": 0, "reused_after_recorded_streams": 0,
                       "record_stream": 0, "graph_pool_allocations": 0}

    # --- allocation ------------------------------------------------------------------

    def empty(self, meta: torch.Tensor, stream: Any) -> torch.Tensor:
        """A tensor shaped like ``meta`` (a meta tensor) on ``stream``."""
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(meta.shape, meta.stride()))
        nbytes = span * meta.element_size() if meta.numel() else 0
        if nbytes == 0:
            return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)
        block = self._alloc(-(-nbytes // ROUND) * ROUND, stream)
        t = torch.empty(0, dtype=meta.dtype).set_(block.storage, 0, meta.shape, meta.stride())
        # The callback holds the allocator weakly: a tensor that outlives the
        # emulated run must not keep every block the run ever made.
        weakref.finalize(t, _on_free, weakref.ref(self), block)
        return t

    def close(self) -> None:
        """Forget every block (the emulated runtime is uninstalled); tensors that
        die later free nothing."""
        self.closed = True
        self.free.clear()
        self.pending.clear()
        self.at_capture_end.clear()
        self._freed.clear()
        self._suspects.clear()
        self.by_ptr.clear()

    def _on_free(self, block: Block) -> None:
        if not self.closed:
            self._suspects[block.id] = block

    def ref(self, t: Any) -> Any:
        """What a queued launch holds for ``t``: a :class:`Ref` into its block, or
        ``t`` itself when the allocator did not make it."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        block = self.by_ptr.get(t.untyped_storage().data_ptr())
        return Ref(block, t) if block is not None else t

    def _alloc(self, size: int, stream: Any) -> Block:
        self.process()
        pool = self.rt.capture_pool(stream)  # None outside a capture
        if pool is not None:
            self.counts["graph_pool_allocations"] += 1
        free = self.free.get((pool, stream.cuda_stream), [])
        for i in range(len(free) - 1, -1, -1):  # most recently freed first
            if free[i].nbytes >= size:
                block = free.pop(i)
                block.recorded = {}
                self.counts["reused"] += 1
                self.last_fresh = None
                return block
        block = Block(size, stream, pool)
        self.by_ptr[block.storage.data_ptr()] = block
        self.counts["fresh"] += 1
        self.last_fresh = block.storage.data_ptr()
        self.rt._observe("alloc", block.storage)
        return block

    # --- record_stream and frees -----------------------------------------------------

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        block = self.by_ptr.get(t.untyped_storage().data_ptr())
        if block is None or stream.cuda_stream == block.stream.cuda_stream:
            return  # not a block of this allocator (made before it), or its own stream
        self.counts["record_stream"] += 1
        block.recorded[stream.cuda_stream] = stream

    def process(self) -> None:
        """Finalised blocks to their pools (or to wait on their recorded streams),
        then pending blocks whose recorded streams have passed the free."""
        rt = self.rt
        for k, block in list(self._suspects.items()):
            if not _held(block):
                del self._suspects[k]
                self._freed.append(block)
        freed, self._freed = self._freed, []
        for block in freed:
            if not block.recorded:
                self.free.setdefault((block.pool, block.stream.cuda_stream), []).append(block)
            elif rt._capture:
                self.at_capture_end.append(block)  # PyTorch defers these to the capture's end
            else:
                self.pending.append((block, [rt.enqueue_record(s)
                                             for s in block.recorded.values()]))
        still = []
        for block, tokens in self.pending:
            if all(t.done for t in tokens):
                # The host saw the events complete before reusing the block: the
                # block's next user is ordered after them (what the detector sees).
                for t in tokens:
                    rt._observe("wait", t.id, block.stream)
                self.counts["reused_after_recorded_streams"] += 1
                self.free.setdefault((block.pool, block.stream.cuda_stream), []).append(block)
            else:
                still.append((block, tokens))
        self.pending = still

    def capture_ended(self) -> None:
        blocks, self.at_capture_end = self.at_capture_end, []
        self._freed.extend(blocks)


def patched_record_stream(alloc: Callable[[], CachingAllocator | None],
                          original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.record_stream`` for emulated streams (a ``SimStream`` is not a
    ``torch.Stream``, so the binding would refuse it)."""

    def record_stream(t: torch.Tensor, stream: Any) -> None:
        a = alloc()
        if a is None or not hasattr(stream, "cuda_stream"):
            return original(t, stream)
        a.record_stream(t, stream)

    return record_stream
