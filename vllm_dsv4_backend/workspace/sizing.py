# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Workspace sizing: families of token-major views, slots, layouts (torch only).

The workspace knows no model. A caller declares its buffer *families* (each a
tuple of token-major :class:`BufferSpec` views) and its layer *kinds* (which
families a layer of that kind leases) in a :class:`WorkspaceConfig`; this
module lays the slots out and counts their bytes. DeepSeek-V4's families,
its lease plan and its sizing report live on the layer floor
(:mod:`vllm_dsv4_backend.layer.plan`, :mod:`vllm_dsv4_backend.layer.sizing`).

Every view is token-major: row ``t`` belongs to token ``t`` and a lease for
``T`` tokens is the prefix ``[:T]`` of a view reserved for
``max_num_batched_tokens`` rows, so its address never moves. Within a
family's slot each view starts at a 256-byte aligned offset (the alignment
vLLM #49236 used), so any view can be reinterpreted as uint8/int32.

Policies (see ``manager.py``): ``shared`` reserves ``shared_slots`` slots per
family and micro-batch, used by every layer in turn behind stream fences;
``private`` reserves one slot per layer, family and micro-batch; ``off``
reserves nothing (plain allocator).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

ALIGNMENT = 256
"""Byte alignment of every view and slot (same as vLLM #49236's pool)."""

POLICIES: tuple[str, ...] = ("shared", "private", "off")

MIB = 1 << 20


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGNMENT`."""
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """One token-major view of a family: ``[T, *per_token_shape]`` of ``dtype``."""

    name: str
    per_token_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        n = self.dtype.itemsize
        for d in self.per_token_shape:
            n *= d
        return n

    def nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """A family: views that are leased, fenced and released together."""

    name: str
    views: tuple[BufferSpec, ...]


def _positive_int(name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")


@dataclasses.dataclass(frozen=True)
class WorkspaceConfig:
    """Sizing inputs of a workspace.

    Attributes:
        max_num_batched_tokens: ``T``, the most tokens one step (one
            micro-batch) can carry; every view has ``T`` rows. A lease of more
            tokens raises ``WorkspaceCapacityError``.
        families: the families, in storage order (unique names, each with at
            least one view).
        kinds: layer kind -> the families a layer of that kind leases (any
            hashable key; ``WorkspaceManager.add_layer`` takes it).
        num_ubatches: micro-batches; each gets its own storage. A lease for a
            micro-batch id ``>= num_ubatches`` raises ``WorkspaceCapacityError``.
        layer_kinds: one kind per layer: the manager's default layers
            (``layers.{i}``) and the layers ``plan_layout`` sizes by default.
        kind_labels: kind -> a name for messages (default ``str(kind)``).
        params: what the caller built the families from (model dimensions,
            dtypes); the workspace never reads it, the layers may.
    """

    max_num_batched_tokens: int
    families: tuple[FamilySpec, ...]
    kinds: Mapping[Hashable, tuple[str, ...]]
    num_ubatches: int = 1
    layer_kinds: tuple[Hashable, ...] = ()
    kind_labels: Mapping[Hashable, str] = dataclasses.field(default_factory=dict)
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("num_ubatches", self.num_ubatches)
        families = tuple(self.families)
        names = [f.name for f in families]
        if len(set(names)) != len(names):
            raise ValueError(f"families: names must be unique, got {names}")
        for f in families:
            if not isinstance(f, FamilySpec) or not f.views:
                raise ValueError(f"families: expected FamilySpecs with views, got {f!r}")
        kinds = {k: tuple(v) for k, v in self.kinds.items()}
        for k, fams in kinds.items():
            bad = [f for f in fams if f not in names]
            if bad:
                raise ValueError(f"kinds[{k!r}]: unknown families {bad}; expected some of "
                                 f"{tuple(names)}")
            # Storage order, whatever order the caller listed them in.
            kinds[k] = tuple(n for n in names if n in fams)
        object.__setattr__(self, "families", families)
        object.__setattr__(self, "kinds", types.MappingProxyType(kinds))
        object.__setattr__(self, "kind_labels", types.MappingProxyType(dict(self.kind_labels)))
        object.__setattr__(self, "params", types.MappingProxyType(dict(self.params)))
        layer_kinds = tuple(self.layer_kinds)
        for k in layer_kinds:
            self.check_kind(k)
        object.__setattr__(self, "layer_kinds", layer_kinds)

    @property
    def family_names(self) -> tuple[str, ...]:
        """Family names, in storage order."""
        return tuple(f.name for f in self.families)

    def check_kind(self, kind: Any) -> None:
        """Raise ``ValueError`` unless ``kind`` is one of :attr:`kinds`."""
        try:
            known = kind in self.kinds and not isinstance(kind, bool)
        except TypeError:  # unhashable
            known = False
        if not known:
            known = sorted(self.kinds, key=lambda k: (type(k).__name__, k))
            raise ValueError(f"layer kind: expected one of {known}, got {kind!r}")

    def kind_label(self, kind: Hashable) -> str:
        return self.kind_labels.get(kind, str(kind))

    def layer_families(self, kind: Hashable) -> tuple[str, ...]:
        """Families a layer of ``kind`` leases, in storage order."""
        self.check_kind(kind)
        return self.kinds[kind]

    def family_buffers(self, family: str) -> tuple[BufferSpec, ...]:
        """The views of ``family``."""
        for f in self.families:
            if f.name == family:
                return f.views
        raise ValueError(f"family: expected one of {self.family_names}, got {family!r}")

    def view_offsets(self, family: str) -> tuple[tuple[BufferSpec, int], ...]:
        """Each view of ``family`` with its byte offset in the slot: the sizing
        rule (``T`` rows per view, each view :data:`ALIGNMENT`-aligned), once."""
        t, off, out = self.max_num_batched_tokens, 0, []
        for spec in self.family_buffers(family):
            out.append((spec, off))
            off += align(spec.nbytes(t))
        return tuple(out)

    def slot_bytes(self, family: str) -> int:
        """Bytes of one slot of ``family`` (all views, ``T`` rows, aligned)."""
        spec, off = self.view_offsets(family)[-1]
        return off + align(spec.nbytes(self.max_num_batched_tokens))


@dataclasses.dataclass(frozen=True)
class Slot:
    """One reserved region: ``ubatch``, ``family``, ``index`` at ``offset``."""

    ubatch: int
    family: str
    index: int
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every slot lives in the single uint8 storage, and who uses it.

    ``slot_of[(layer_idx, family)]`` is the slot index the layer leases (the
    same index in every micro-batch); ``slots`` lists every slot with its byte
    range; ``total_bytes`` is the storage size.
    """

    policy: str
    slots: tuple[Slot, ...]
    slot_of: Mapping[tuple[int, str], int]
    total_bytes: int


def plan_layout(
    config: WorkspaceConfig,
    layer_kinds: Sequence[Hashable] | None = None,
    policy: str = "shared",
    shared_slots: int = 1,
) -> Layout:
    """Lay out every slot; the manager and ``workspace_bytes`` both use this.

    ``layer_kinds``: one kind per layer (default ``config.layer_kinds``).
    ``shared``: family ``f`` gets ``shared_slots`` slots per micro-batch; the
    ``n``-th layer using ``f`` takes slot ``n % shared_slots``. Families never
    share bytes (they can be live at once on different streams) and neither do
    micro-batches. ``private``: one slot per layer and family. ``off``: none.
    """
    kinds = tuple(config.layer_kinds if layer_kinds is None else layer_kinds)
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if not isinstance(shared_slots, int) or shared_slots < 1:
        raise ValueError(f"shared_slots: expected a positive int, got {shared_slots!r}")
    slot_of: dict[tuple[int, str], int] = {}
    count: dict[str, int] = dict.fromkeys(config.family_names, 0)
    for i, k in enumerate(kinds):
        for f in config.layer_families(k):
            slot_of[(i, f)] = count[f] if policy == "private" else count[f] % shared_slots
            count[f] += 1
    if policy == "off":
        return Layout(policy, (), slot_of, 0)
    slots: list[Slot] = []
    off = 0
    for u in range(config.num_ubatches):
        for f in config.family_names:
            n = count[f] if policy == "private" else min(count[f], shared_slots)
            size = config.slot_bytes(f)
            for k in range(n):
                slots.append(Slot(u, f, k, off, size))
                off += size
    return Layout(policy, tuple(slots), slot_of, off)


def private_fit_tokens(
    config: WorkspaceConfig, layer_kinds: Sequence[Hashable] | None, budget_bytes: int
) -> int:
    """The largest ``max_num_batched_tokens`` (at most ``config``'s) at which
    the ``private`` policy reserves at most ``budget_bytes``; 0 if none does.
    (Bytes grow with the token count, so a bisection finds it.)"""

    def total(t: int) -> int:
        cfg = dataclasses.replace(config, max_num_batched_tokens=t)
        return plan_layout(cfg, layer_kinds, "private").total_bytes

    lo, hi = 0, config.max_num_batched_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclasses.dataclass(frozen=True)
class WorkspaceBytes:
    """Reserved bytes of one policy: ``per_family`` (all slots, all micro-
    batches) and ``total``."""

    policy: str
    per_family: dict[str, int]
    total: int


def workspace_bytes(
    config: WorkspaceConfig,
    policy: str = "shared",
    *,
    layer_kinds: Sequence[Hashable] | None = None,
    shared_slots: int = 1,
) -> WorkspaceBytes:
    """Bytes the manager reserves at load for ``config`` under ``policy``."""
    layout = plan_layout(config, layer_kinds, policy, shared_slots)
    per = dict.fromkeys(config.family_names, 0)
    for s in layout.slots:
        per[s.family] += s.nbytes
    return WorkspaceBytes(policy, per, layout.total_bytes)
