# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A happens-before race detector for :mod:`simcuda`'s trace: PyTorch's CUDA
Sanitizer core (``torch.cuda._sanitizer.EventHandler``: per-stream vector
clocks advanced by event records and waits; each access checked against the
last write and the reads since) fed with CPU tensors.

CSAN proper (``TORCH_CUDA_SANITIZER=1``) keys accesses by ``data_ptr()`` and
learns allocations from the CUDA caching allocator's trace. Here:

* an access is a byte range of a storage, cut into cells: 256 bytes (the
  workspace's view alignment) inside a registered region (the workspace
  storage), else at most 16 cells per storage; two accesses conflict when
  they share a cell, so two leases that overlap by one view are caught;
* read and write sets come from the op's schema (``ArgumentHandler``:
  ``Tensor(a!)`` arguments and non-view results are writes);
* every non-view result is a fresh allocation (the allocator never hands a
  block to another stream while its last user may still run), so its cells
  start a new history, as ``_handle_memory_allocation`` does on a GPU; and
  every tensor a launch touched is kept alive until the next device-wide
  synchronisation, so the CPU allocator cannot give its address to a tensor
  the detector never saw allocated.

Each unordered conflicting pair is reported once per (buffer, op pair,
stream pair) with both ops and both streams; the buffer is named by the
region's namer (the workspace family, slot and micro-batch).

``torch.cuda._sanitizer`` is private API: tested with torch 2.13
(``TESTED_TORCH``); ``tests/cuda/test_graph_harness.py`` checks that a known
race is reported and a known-good order is not, so a torch upgrade that
changes it turns red.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.cuda import _sanitizer as csan
from torch.utils import _pytree as pytree

TESTED_TORCH = ("2.13",)
NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
WORKSPACE_CELL = 256
MAX_CELLS = 16


class _Args(csan.ArgumentHandler):
    """CSAN's schema walk for CPU tensors, expanded into cells."""

    def __init__(self, cells: Callable[[torch.Tensor], list[int]], is_factory: bool) -> None:
        super().__init__()
        self._cells = cells
        self._factory = is_factory
        self.fresh: set[int] = set()

    def _handle_argument(self, value: Any, is_write: bool, metadata_only: bool,
                         name: str | None = None, is_output: bool = False) -> None:
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            return
        cells = self._cells(value)
        for c in cells:
            if is_write:
                self.dataptrs_written.add(c)
            elif not metadata_only:
                self.dataptrs_read.add(c)
            self.tensor_aliases.setdefault(c, [])
            if name is not None:
                self.tensor_aliases[c].append(name)
            if is_output:
                self.outputs.add(c)
        if is_output and (self._factory or not metadata_only):
            self.fresh.update(cells)


class _NoStacks:
    """Stands for the ``traceback`` module inside ``torch.cuda._sanitizer``: CSAN
    extracts the whole Python stack at every launch and allocation (half the
    harness's time); the report here names buffers, ops and streams instead."""

    class StackSummary(list):  # noqa: N801 - the name CSAN calls
        @staticmethod
        def extract(frames: Any, lookup_lines: bool = True) -> list:
            return _NoStacks.StackSummary()

    @staticmethod
    def walk_stack(frame: Any) -> None:
        return None


class RaceDetector:
    """The observer :class:`simcuda.SimCuda` reports to."""

    def __init__(self, max_reports: int = 50, saturate_at: int = 2000) -> None:
        csan.traceback = _NoStacks  # type: ignore[assignment]  # this process only
        self.handler = csan.EventHandler()
        self.regions: list[tuple[int, int, Callable[[int], str]]] = []
        self.stream_names: dict[int, str] = {}
        self.races: list[dict[str, Any]] = []
        self._seen: set[tuple[str, ...]] = set()
        self.max_reports = max_reports
        self.launches = 0
        self.total = 0
        # Past this many races the verdict is in: stop checking (CSAN's cost grows
        # with every unordered pair), and say so.
        self.saturate_at = saturate_at
        # "capture": eager code while a graph is being captured (vLLM's eager
        # break runs once at capture, for real, on buffers whose captured
        # producers have not run). Its values are never used, but its accesses
        # are real device work: a race there is a race, counted with the others
        # and also apart (``races_in_capture``).
        self.phase = "run"
        self.at_capture = 0
        self._alive: list[Any] = []
        # With simcuda's caching-allocator model (allocator.py) allocations are its
        # events: a fresh block starts a new history, a reused block keeps its
        # own, and only tensors made outside the model are kept alive.
        self.allocator: Any = None
        self._workspaces: list[tuple[Any, Callable[[int], str]]] = []
        self.undeclared = 0  # workspace accesses on a stream the holding lease never declared
        self.undeclared_first: list[dict[str, Any]] = []

    def watch_leases(self, workspace: Any, namer: Callable[[int], str]) -> None:
        """Check every access to ``workspace``'s bytes, at run time and at capture,
        against the live lease that holds them: its stream must be one the lease
        declared (its producer's, or a consumer's from ``used_on``). The fences
        order exactly those streams, so an access on another one is unordered by
        construction (a race waiting for a schedule that shows it)."""
        self._workspaces.append((workspace, namer))

    def _check_leases(self, stream: Any, args: Any, kwargs: Any, outputs: Any) -> None:
        for ws, namer in self._workspaces:
            storage = ws.storage
            if storage is None:
                continue
            ptr = storage.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs, outputs)):
                if not isinstance(t, torch.Tensor) or not t.numel() \
                        or t.untyped_storage().data_ptr() != ptr:
                    continue
                es = t.element_size()
                lo = t.storage_offset() * es
                hi = lo + (1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))) * es
                for slot in ws._slots:
                    lease = slot.holder
                    if lease is None or not (slot.offset < hi and lo < slot.offset + slot.nbytes):
                        continue
                    if any(s is stream or s == stream for s in lease.streams):
                        continue
                    self.undeclared += 1
                    if len(self.undeclared_first) < 8:
                        self.undeclared_first.append({
                            "buffer": namer(slot.offset), "layer": lease.layer_name,
                            "stream": self.stream_names.get(stream.cuda_stream, "?"),
                            "declared": [self.stream_names.get(s.cuda_stream, "?")
                                         for s in lease.streams], "phase": self.phase})

    def add_region(self, base: torch.Tensor, namer: Callable[[int], str]) -> None:
        """Cells of 256 bytes over ``base``'s storage; ``namer(byte_offset)`` names them."""
        st = base.untyped_storage()
        self.regions.append((st.data_ptr(), st.nbytes(), namer))

    # --- cells ----------------------------------------------------------------------

    def _cells(self, t: torch.Tensor) -> list[int]:
        st = t.untyped_storage()
        base, size = st.data_ptr(), st.nbytes()
        es = t.element_size()
        lo = t.storage_offset() * es
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        hi = lo + span * es
        for rbase, rsize, _ in self.regions:
            if base == rbase:
                cell = WORKSPACE_CELL
                break
        else:
            cell = max(4096, -(-size // MAX_CELLS))
        return [base + c * cell for c in range(lo // cell, (hi - 1) // cell + 1)]

    def _name(self, ptr: int) -> str:
        for rbase, rsize, namer in self.regions:
            if rbase <= ptr < rbase + rsize:
                return namer(ptr - rbase)
        return f"tensor@{ptr:#x}"

    # --- trace ----------------------------------------------------------------------

    def __call__(self, event: str, *args: Any) -> None:
        getattr(self, "_on_" + event)(*args)

    def _on_stream_created(self, stream: Any) -> None:
        self.stream_names[stream.cuda_stream] = stream.name
        self.handler._handle_stream_creation(stream.cuda_stream)

    def _on_record(self, token: int, stream: Any) -> None:
        self.handler._handle_event_creation(token)
        self.handler._handle_event_record(token, stream.cuda_stream)

    def _on_wait(self, token: int, stream: Any) -> None:
        self.handler._handle_event_wait(token, stream.cuda_stream)

    def _on_sync_stream(self, stream: Any) -> None:
        self.handler._handle_stream_synchronization(stream.cuda_stream)

    def _on_allocator(self, allocator: Any) -> None:
        self.allocator = allocator

    def _on_alloc(self, storage: Any) -> None:
        base, size = storage.data_ptr(), storage.nbytes()
        cell = max(4096, -(-size // MAX_CELLS))
        for c in range(0, -(-size // cell)):
            self.handler._handle_memory_allocation(base + c * cell)

    def _keep(self, *tensors: Any) -> None:
        if self.allocator is None:
            self._alive.append(tensors)
            return
        pooled = self.allocator.by_ptr
        self._alive.extend(t for t in pytree.tree_leaves(tensors)
                           if isinstance(t, torch.Tensor)
                           and t.untyped_storage().data_ptr() not in pooled)

    def _on_sync_all(self) -> None:
        self.handler._handle_device_synchronization()
        self._alive.clear()

    def _on_captured_launch(self, stream: Any, func: Any, args: Any, kwargs: Any,
                            outputs: Any) -> None:
        if self._workspaces:
            self._check_leases(stream, args, kwargs, outputs)

    def _on_launch(self, stream: Any, func: Any, args: Any, kwargs: Any, outputs: Any) -> None:
        self.launches += 1
        if self._workspaces:
            self._check_leases(stream, args, kwargs, outputs)
        if self.total >= self.saturate_at:
            return
        schema = func._schema
        if schema.name.split("::")[-1] in NO_KERNEL:
            # An allocation, not a kernel: no stream touches the bytes (CSAN's
            # pattern would call ``empty``'s result a write on the stream).
            if self.allocator is None:
                for t in pytree.tree_leaves(outputs):
                    if isinstance(t, torch.Tensor) and t.numel():
                        for c in self._cells(t):
                            self.handler._handle_memory_allocation(c)
            self._keep(outputs)
            return
        is_factory = bool(csan.FACTORY_FUNCTION_REGEX.match(schema.name.split("::")[-1]))
        h = _Args(self._cells, is_factory)
        # Every tensor a launch touches stays alive until the next device-wide
        # synchronisation: the CPU allocator would hand its address to the next
        # tensor at once (a GPU caching allocator keeps it per stream), and a
        # tensor made outside the dispatcher (a wrapped scalar) is never seen
        # allocated, so it would inherit the old history.
        self._keep(args, kwargs, outputs)
        h.parse_inputs(schema, args, kwargs, is_factory=is_factory)
        inputs = h.dataptrs_read | h.dataptrs_written
        h.parse_outputs(schema, outputs, is_factory=is_factory)
        written = h.dataptrs_written
        if self.allocator is None:
            for c in h.fresh - inputs:
                self.handler._handle_memory_allocation(c)
        for c in h.fresh:
            h.tensor_aliases.setdefault(c, [])
        errors = self.handler._handle_kernel_launch(
            stream.cuda_stream, h.dataptrs_read - written, written, h.outputs, str(schema.name),
            h.tensor_aliases)
        for e in errors:
            self._report(e)

    def _report(self, e: csan.SynchronizationError) -> None:
        assert isinstance(e, csan.UnsynchronizedAccessError)
        if self.phase == "capture":
            self.at_capture += 1
        cur, prev = e.current_access, e.previous_access
        name = self._name(e.data_ptr)
        sn = self.stream_names
        key = (name, str(cur.operator), str(prev.operator), sn.get(cur.stream, "?"),
               sn.get(prev.stream, "?"), self.phase)
        self.total += 1
        if key in self._seen:
            return
        self._seen.add(key)
        if len(self.races) < self.max_reports:
            self.races.append({
                "buffer": name,
                "access": f"{cur.type} after {prev.type}",
                "op": str(cur.operator), "stream": sn.get(cur.stream, str(cur.stream)),
                "previous_op": str(prev.operator),
                "previous_stream": sn.get(prev.stream, str(prev.stream)),
                "phase": self.phase,
            })

    def summary(self) -> dict[str, Any]:
        return {"races": self.total, "saturated": self.total >= self.saturate_at,
                "distinct": len(self._seen), "launches": self.launches,
                "races_in_capture": self.at_capture,
                "undeclared_stream_accesses": self.undeclared,
                "undeclared_first": self.undeclared_first, "first": self.races[:8]}


def torch_version_tested() -> bool:
    return any(torch.__version__.startswith(v) for v in TESTED_TORCH)


def self_check() -> dict[str, Any]:
    """A write on one stream then a read on another: one race; the same pair
    ordered by an event record / wait: none (the contract this module relies on)."""
    from simcuda import SimCuda, SimEvent

    out: dict[str, Any] = {}
    for ordered in (False, True):
        det = RaceDetector()
        rt = SimCuda("program", observer=det)
        with rt.install():
            a = rt.new_stream("a")
            b = rt.new_stream("b")
            x = torch.zeros(64)
            a.wait_stream(rt.default)
            b.wait_stream(rt.default)
            with torch.cuda.stream(a):
                x.add_(1)
                ev = SimEvent()
                ev.record()
            with torch.cuda.stream(b):
                if ordered:
                    ev.wait()
                x.sum()
        out["ordered" if ordered else "unordered"] = det.total
    out["ok"] = out["unordered"] > 0 and out["ordered"] == 0
    return out

