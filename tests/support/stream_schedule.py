# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The simulated-stream workspace program (torch only): a DeepSeek-V4-Flash-shaped step
through the real ``WorkspaceManager`` on ``SimStreamBackend`` streams, run in random
orders; and #49236's layout as a negative control.

Shared by tests/core/test_stream_schedule.py (the test's docstring says what is checked)
and tests/safety/test_3_events.py (the safety case's item 3 figure).
"""

from __future__ import annotations

import random

from tests.support.families import AUX_FAMILIES, small_workspace_config
from vllm_dsv4_backend.testing.schedule import (
    STREAM_ROLES,
    WIDE_PLAN,
    StampKernels,
    enqueue_dsv4_step,
    make_stamp_source,
)
from vllm_dsv4_backend.workspace import (
    SimStreamBackend,
    WorkspaceConfig,
    WorkspaceManager,
)
from vllm_dsv4_backend.workspace.sizing import Layout, Slot

FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)
T_MAX = 16
# (tokens of ubatch 0, tokens of ubatch 1) per step: decode, mixed, full.
STEP_TOKENS = ((3, 1), (T_MAX, 7))


def small_config(
    indexer: str = "mxfp4", num_ubatches: int = 2, ratios: tuple[int, ...] = FLASH_RATIOS
) -> WorkspaceConfig:
    # Flash's layer types and family structure with small dims, so hundreds
    # of schedules run in seconds; every family of vLLM's wide eager region
    # (WIDE_PLAN: C4's compressor scratch too, the q family as the output).
    return small_workspace_config(heads=2, head_dim=16, index_topk=8, tokens=T_MAX,
                                  indexer=indexer, plan=WIDE_PLAN, num_ubatches=num_ubatches,
                                  ratios=ratios)


def sim_streams(num_ubatches: int = 2) -> tuple[SimStreamBackend, list[dict[str, object]]]:
    names = [f"{r}.u{u}" for u in range(num_ubatches) for r in STREAM_ROLES]
    be = SimStreamBackend(names)
    per_ub = [{r: be.stream(f"{r}.u{u}") for r in STREAM_ROLES} for u in range(num_ubatches)]
    return be, per_ub


def build_program(
    *,
    policy: str = "shared",
    variant: str = "wide",
    fences: bool = True,
    debug: bool = False,
    indexer: str = "mxfp4",
    seed: int = 0,
    manager_cls: type[WorkspaceManager] = WorkspaceManager,
    ratios: tuple[int, ...] = FLASH_RATIOS,
    step_tokens: tuple[tuple[int, int], ...] = STEP_TOKENS,
    shared_slots: int = 1,
) -> tuple[WorkspaceManager, SimStreamBackend, StampKernels]:
    be, per_ub = sim_streams()
    mgr = manager_cls(
        small_config(indexer, ratios=ratios),
        policy=policy,
        streams=be,
        debug=debug,
        shared_slots=shared_slots,
        _unsafe_disable_fences_for_tests=not fences,
    )
    mgr.reserve()
    k = StampKernels(be)
    rng = random.Random(seed)
    stamps = make_stamp_source()
    for step, toks in enumerate(step_tokens):
        enqueue_dsv4_step(mgr, k, per_ub, toks, variant=variant, rng=rng, stamps=stamps,
                          step=step)
    return mgr, be, k


def run_schedules(
    mgr: WorkspaceManager, be: SimStreamBackend, k: StampKernels, n: int, seed: int
) -> tuple[int, list[tuple[str, int]]]:
    """Execute the program under ``n`` random orders; returns (#corrupt, first errors)."""
    rng = random.Random(seed)
    corrupt = 0
    first: list[tuple[str, int]] = []
    for _ in range(n):
        if mgr.storage is not None:
            mgr.storage.fill_(0)  # stale stamps of the last run must not help
        k.reset()
        be.execute(rng)
        bad = k.mismatches()
        if bad:
            corrupt += 1
            first = first or bad
    return corrupt, first


class Pool49236Layout(WorkspaceManager):
    """The reverted pool's layout (vLLM #49236's ``DeepseekV4EagerScratchPool`` on the
    manager): one buffer of padded q + max(aux families); q apart, every aux family at one
    offset; every layer and both micro-batches on the same bytes (one storage for all
    micro-batches: DBO was simply disabled)."""

    def _plan_layout(self) -> Layout:
        base = super()._plan_layout()
        q = self.config.slot_bytes("q")
        aux = max(self.config.slot_bytes(f) for f in AUX_FAMILIES)
        slots = tuple(
            Slot(s.ubatch, s.family, s.index, 0 if s.family == "q" else q,
                 q if s.family == "q" else aux)
            for s in base.slots
        )
        return Layout(base.policy, slots, base.slot_of, q + aux)


