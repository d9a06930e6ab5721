# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The buffer families the tests walk, derived from the one lease plan
(``vllm_dsv4_backend.layer.plan.LEASE_PLAN``) instead of restated, and the small
workspace configs the tests build from it (torch only)."""

from __future__ import annotations

from vllm_dsv4_backend.formats.constants import LAYER_KINDS
from vllm_dsv4_backend.layer.plan import (
    LEASE_PLAN,
    Dims,
    Plan,
    build_workspace_config,
    family_views,
)
from vllm_dsv4_backend.testing.schedule import WIDE_PLAN
from vllm_dsv4_backend.workspace import WorkspaceConfig


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


def _every_family_plan() -> Plan:
    every = family_views(Dims(1, 1), "mxfp4")
    plans = [p for by_dtype in LEASE_PLAN.values() for p in by_dtype.values()] + [WIDE_PLAN]
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for kind in dict.fromkeys(LAYER_KINDS.values()):
        used = {fam for p in plans for fam in p.get(kind, {})}
        out[kind] = {fam: ("q",) if fam == "q" else tuple(v.name for v in specs)
                     for fam, specs in every.items() if fam in used}
    return out


# Every family a layer kind uses in any plan (each platform's LEASE_PLAN and vLLM's wide
# eager region, WIDE_PLAN) with every view, the padded q as the q family: the workspace
# mechanism's bounds and view tests lease all of it. Derived, so a family added to
# family_views and a lease plan is in it too.
EVERY_FAMILY_PLAN: Plan = _every_family_plan()


def small_workspace_config(
    *,
    heads: int,
    head_dim: int,
    index_head_dim: int = 128,
    index_topk: int,
    tokens: int,
    indexer: str,
    plan: Plan | None = None,
    num_ubatches: int = 1,
    ratios: tuple[int, ...],
) -> WorkspaceConfig:
    """A workspace config with DeepSeek-V4's structure and small dims, so that a test
    builds and leases it in milliseconds: ``heads`` local q heads padded to twice as
    many and as many indexer heads; ``plan`` None is the CUDA lease plan."""
    dims = Dims(num_local_heads=heads, padded_q_heads=2 * heads, head_dim=head_dim,
                index_n_heads=heads, index_head_dim=index_head_dim, index_topk=index_topk)
    return build_workspace_config(dims, max_num_batched_tokens=tokens, indexer_kv_dtype=indexer,
                                  plan=plan, num_ubatches=num_ubatches, compress_ratios=ratios)
