# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The buffer families the tests walk, derived from the one lease plan
(``vllm_dsv4_backend.layer.plan.LEASE_PLAN``) instead of restated, and the small
workspace configs the tests build from it (torch only)."""

from __future__ import annotations

from vllm_dsv4_backend.layer.plan import LEASE_PLAN, Dims, Plan, build_workspace_config
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
