# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The buffer families the tests walk, derived from the one lease plan
(``vllm_dsv4_backend.layer.plan.LEASE_PLAN``) instead of restated (torch only)."""

from __future__ import annotations

from vllm_dsv4_backend.layer.plan import LEASE_PLAN


def families(platform: str | None = None) -> tuple[str, ...]:
    """Every family ``platform``'s plan leases (``None``: any platform's), in the
    plan's order (first seen)."""
    plans = LEASE_PLAN.values() if platform is None else (LEASE_PLAN[platform],)
    return tuple(dict.fromkeys(
        fam for by_dtype in plans for plan in by_dtype.values() for kind in plan.values()
        for fam in kind))


# Every family: ``("q", "indexer_q", "topk", "compressor")``.
FAMILIES: tuple[str, ...] = families()
# The families #49236 put at one offset (every family but the attention output ``q``).
AUX_FAMILIES: tuple[str, ...] = tuple(f for f in FAMILIES if f != "q")
