# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a lease hands out and the errors the workspace raises (torch only).

:class:`Lease` is the views of one family for one layer and micro-batch,
valid until ``release()``; ``_Slot`` is one reserved region the manager
(:mod:`.manager`) leases out. Split from the manager, which re-exports every
name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .sizing import BufferSpec


class _Owner(Protocol):
    """What a lease needs of its manager (:class:`.manager.WorkspaceManager`;
    a protocol, so this module does not import the manager that imports it)."""

    _backend: Any

    def _release(self, lease: Lease) -> None: ...

__all__ = [
    "Lease",
    "WorkspaceBudgetError",
    "WorkspaceCapacityError",
    "WorkspaceLeaseError",
]


class WorkspaceCapacityError(ValueError):
    """A lease asked for more than was reserved at load: more tokens than
    ``WorkspaceConfig.max_num_batched_tokens`` or a micro-batch id not below
    ``WorkspaceConfig.num_ubatches``. The message names the family, the layer,
    the token count, the micro-batch, the bytes needed and the bytes reserved."""


class WorkspaceBudgetError(ValueError):
    """``reserve(budget_bytes=...)``: the ``private`` policy needs more memory
    than the budget. The message names the policy, the bytes per layer and in
    total, the budget and the alternatives."""


class WorkspaceLeaseError(RuntimeError):
    """A lease protocol violation (busy slot, overlap, double release...)."""


def _poison(views: Mapping[str, torch.Tensor]) -> None:
    for v in views.values():
        if v.dtype.is_floating_point:
            # All-ones bytes are NaN in bf16, fp32 and float8_e4m3fn alike.
            v.view(torch.uint8).fill_(0xFF)
        elif v.dtype == torch.uint8:
            v.fill_(0xFF)
        else:
            # Not -1: that is the valid "no index" pad of the top-k buffers.
            v.fill_(torch.iinfo(v.dtype).min)


@dataclass(eq=False, repr=False, slots=True)
class _Slot:
    """One reserved region: ``nbytes`` at ``offset`` of micro-batch ``ubatch``'s
    storage, the ``index``-th of ``family``, held by one lease at a time."""

    ubatch: int
    family: str
    index: int
    offset: int
    nbytes: int
    buffers: tuple[tuple[BufferSpec, int], ...]  # (spec, absolute byte offset in the storage)
    # T -> (views of the first T rows, their bytes); built once per T.
    views: dict[int, tuple[Mapping[str, torch.Tensor], int]] = field(default_factory=dict)
    holder: Lease | None = None
    last_streams: tuple[Any, ...] = ()
    events: dict[Any, Any] = field(default_factory=dict)


class Lease:
    """Views of one family for one layer, valid until ``release()``.

    ``lease[name]`` / ``lease.views[name]`` is a ``[num_tokens, ...]`` tensor
    (layouts in ``sizing``). Use as a context manager or call ``release()``
    once the last consumer kernel is enqueued; declare every stream other
    than the producer's that touches the views with ``used_on`` first.
    """

    __slots__ = (
        "_manager",
        "_slot",
        "layer_name",
        "family",
        "num_tokens",
        "ubatch",
        "stream",
        "views",
        "nbytes",
        "_streams",
        "_keys",
        "active",
    )

    def __init__(
        self,
        manager: _Owner,
        slot: _Slot | None,
        layer_name: str,
        family: str,
        num_tokens: int,
        ubatch: int,
        stream: Any,
        stream_key: Any,
        views: Mapping[str, torch.Tensor],
        nbytes: int,
    ) -> None:
        self._manager = manager
        self._slot = slot
        self.layer_name = layer_name
        self.family = family
        self.num_tokens = num_tokens
        self.ubatch = ubatch
        self.stream = stream
        self.views = views
        self.nbytes = nbytes
        self._streams: list[Any] = [stream]
        self._keys: list[Any] = [stream_key]
        self.active = True

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    def used_on(self, *streams: Any) -> Lease:
        """Declare streams (besides the producer's) that read or write the views."""
        if not self.active:
            raise WorkspaceLeaseError(
                f"lease of {self.family!r} for layer {self.layer_name!r} was released; "
                "declare consumer streams before release()"
            )
        key_of = self._manager._backend.stream_key
        for s in streams:
            k = key_of(s)
            if k not in self._keys:
                self._keys.append(k)
                self._streams.append(s)
        return self

    @property
    def streams(self) -> tuple[Any, ...]:
        """Producer stream first, then the declared consumer streams."""
        return tuple(self._streams)

    def release(self) -> None:
        """End the lease (after the last consumer is enqueued on its stream)."""
        self._manager._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            self.release()

    def __repr__(self) -> str:
        state = "active" if self.active else "released"
        return (
            f"Lease({self.layer_name!r}, {self.family!r}, T={self.num_tokens}, "
            f"ubatch={self.ubatch}, {state})"
        )
