# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Live counters of a served workspace (torch only, no vLLM).

A serving worker has no bracket around a step of the model, so the layer
core marks one *model step* per forward of the model's first registered layer for
micro-batch 0 (``WorkspaceManager.model_step``). Between two marks the
manager's running totals (leases, allocations it made for leased families,
fence waits, fallbacks: buffers a layer let its own code allocate where it
could not lease, counted by ``WorkspaceManager.count_fallback``) grow by
one model step's worth; :class:`LiveCounters` keeps the totals since the
first mark and the largest step, and formats the one-line summary the worker
logs every ``VLLM_DSV4_WORKSPACE_LOG_EVERY`` model steps and at shutdown.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

MIB = 1 << 20


class Counter(NamedTuple):
    """One live counter: ``name`` keys the manager's running totals and
    :meth:`LiveCounters.snapshot` (``<name>_total``, ...); ``series`` and
    ``doc`` name its ``/metrics`` counter (``vllm_dsv4_workspace_<series>_total``)
    and ``words`` its part of the summary line."""

    name: str
    series: str
    doc: str
    words: str


# The totals a model step is measured in. A new counter is one entry here and
# its count in the manager (``WorkspaceManager._totals``); the snapshot, the
# summary line and the /metrics series follow from this table.
LIVE_COUNTERS: tuple[Counter, ...] = (
    Counter("leases", "leases", "Workspace leases taken by the attention layers", "leases"),
    Counter("allocations", "leased_family_allocations",
            "Tensors allocated for leased buffer families (0 unless policy off)",
            "allocations in leased families"),
    Counter("fence_waits", "fence_waits", "Cross-stream fence waits before a lease",
            "fence waits"),
    Counter("fallbacks", "fallbacks",
            "Buffers a layer allocated itself where the workspace could not serve",
            "fallbacks to the layer's own allocation"),
)
COUNTERS: tuple[str, ...] = tuple(c.name for c in LIVE_COUNTERS)


class LiveCounters:
    """Model steps and the counters' totals and per-step maxima since the first."""

    __slots__ = ("_base", "_mark", "max_per_step", "steps")

    def __init__(self) -> None:
        self.steps = 0
        self._base: dict[str, int] | None = None
        self._mark: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.max_per_step: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def tick(self, totals: Mapping[str, int]) -> int:
        """A model step begins; ``totals`` are the manager's running totals,
        by counter name (:data:`COUNTERS`). Returns the number of model steps
        begun so far."""
        now = {name: totals[name] for name in COUNTERS}
        if self._base is None:
            self._base = now
        else:
            for name in COUNTERS:
                self.max_per_step[name] = max(self.max_per_step[name],
                                              now[name] - self._mark[name])
        self._mark = now
        self.steps += 1
        return self.steps

    def snapshot(self, totals: Mapping[str, int]) -> dict[str, Any]:
        """``steps`` and, per counter, ``<name>_total`` (since the first model
        step, the step in progress included), ``<name>_per_step`` (mean) and
        ``<name>_max_per_step`` (over finished steps)."""
        base = self._base if self._base is not None else totals
        out: dict[str, Any] = {"steps": self.steps}
        for name in COUNTERS:
            total = totals[name] - base[name]
            out[f"{name}_total"] = total
            out[f"{name}_per_step"] = total / self.steps if self.steps else 0.0
            out[f"{name}_max_per_step"] = self.max_per_step[name]
        return out


# The counters the summary line words in its own order (stable wording); any
# other counter follows them, at the end of the line.
_WORDED = ("leases", "allocations", "fence_waits", "fallbacks")


def format_summary(label: str, live: dict[str, Any], *, policy: str, reserved_bytes: int,
                   peak_leased_bytes: int) -> str:
    """The one-line summary (stable wording: tests and operators grep it)."""
    return (
        f"vllm_dsv4_backend workspace live ({label}): {live['steps']} model steps, "
        f"leases {live['leases_per_step']:.1f}/step ({live['leases_total']} total, "
        f"max {live['leases_max_per_step']}), "
        f"allocations in leased families {live['allocations_per_step']:.1f}/step "
        f"({live['allocations_total']} total), "
        f"fence waits {live['fence_waits_per_step']:.1f}/step "
        f"({live['fence_waits_total']} total), "
        f"reserved {reserved_bytes / MIB:.1f} MiB, peak leased {peak_leased_bytes / MIB:.1f} MiB, "
        f"policy {policy}, fallbacks to the layer's own allocation "
        f"{live['fallbacks_per_step']:.1f}/step ({live['fallbacks_total']} total)"
    ) + "".join(
        f", {c.words} {live[f'{c.name}_per_step']:.1f}/step ({live[f'{c.name}_total']} total)"
        for c in LIVE_COUNTERS if c.name not in _WORDED
    )
