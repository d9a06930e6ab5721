# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Count tensor allocations inside a region of code, on any device (torch only).

``count_allocations()`` installs a ``TorchDispatchMode`` that sees every aten
op issued in the block and counts each tensor an op returns that is *new
memory*: factory ops (``empty``, ``zeros``, ``full``, ``empty_strided``,
``torch.tensor``'s ``lift_fresh``, ...) and out-of-place results (``a + b``,
``clone``, ``_to_copy``, ``mm``). Not counted: views and other results whose
schema says they alias an input (``view``, ``slice``, ``split``,
``detach``), in-place ops (``add_``, ``fill_``) and ``out=`` variants, and
results sharing storage with an input (``_unsafe_view``, whose schema does
not say so). Scalars (``.item()``) are not tensors.

What it cannot see: memory a kernel allocates internally without going
through the dispatcher above the mode (e.g. a C++ op's scratch). On CUDA,
``AllocationCounter.allocator_count`` adds the caching allocator's own count
of allocation requests for the region (``torch.cuda.memory_stats``), which
does see those.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Returned as an alias of the input in the schema, but torch.tensor(data) built
# that input outside the dispatcher just before: a fresh tensor.
_FRESH_ALIAS_OPS = frozenset({"aten::lift_fresh"})


def _storage_ptrs(args: Any, kwargs: Any) -> set[int]:
    ptrs: set[int] = set()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            ptrs.add(x.untyped_storage().data_ptr())
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)

    visit(args)
    if kwargs:
        visit(list(kwargs.values()))
    return ptrs


class _CountMode(TorchDispatchMode):
    def __init__(self, counter: AllocationCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
        fresh_alias = func._schema.name in _FRESH_ALIAS_OPS
        in_ptrs: set[int] | None = None
        for ret, val in zip(returns, outs):
            if ret.alias_info is not None and not fresh_alias:
                continue
            tensors = [val] if isinstance(val, torch.Tensor) else (
                [v for v in val if isinstance(v, torch.Tensor)]
                if isinstance(val, (list, tuple)) else []
            )
            for t in tensors:
                if not fresh_alias:
                    if in_ptrs is None:
                        in_ptrs = _storage_ptrs(args, kwargs)
                    p = t.untyped_storage().data_ptr()
                    if p != 0 and p in in_ptrs:
                        continue
                self.counter._add(str(func.overloadpacket.__name__), t)
        return out


class AllocationCounter:
    """Context manager counting tensor allocations (see module docstring).

    Attributes (valid during and after the block):
        count: tensors allocated.
        nbytes: their total bytes (``untyped_storage().nbytes()``).
        by_op: ``Counter`` of allocations per aten op name (``"add"``,
            ``"empty"``, ...).
        allocator_count: CUDA caching-allocator allocation requests in the
            block on ``cuda_device`` (``None`` unless one was given).
    """

    def __init__(self, cuda_device: torch.device | str | int | None = None) -> None:
        self.count = 0
        self.nbytes = 0
        self.by_op: Counter[str] = Counter()
        self.allocator_count: int | None = None
        self._cuda_device = cuda_device
        self._alloc0 = 0
        self._mode: _CountMode | None = None

    def _add(self, op: str, t: torch.Tensor) -> None:
        self.count += 1
        self.nbytes += t.untyped_storage().nbytes()
        self.by_op[op] += 1

    def _allocator_requests(self) -> int:
        stats = torch.cuda.memory_stats(self._cuda_device)
        return int(stats.get("allocation.all.allocated", 0))

    def __enter__(self) -> AllocationCounter:
        if self._mode is not None:
            raise RuntimeError("AllocationCounter is already active")
        if self._cuda_device is not None:
            self._alloc0 = self._allocator_requests()
        self._mode = _CountMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        assert mode is not None
        mode.__exit__(*exc)
        if self._cuda_device is not None:
            self.allocator_count = self._allocator_requests() - self._alloc0

    def __repr__(self) -> str:
        return f"AllocationCounter(count={self.count}, by_op={dict(self.by_op)})"


def count_allocations(cuda_device: torch.device | str | int | None = None) -> AllocationCounter:
    """``with count_allocations() as c: ...; c.count`` (see ``AllocationCounter``)."""
    return AllocationCounter(cuda_device)
