# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lock-time bounds of the workspace (CPU, no vLLM).

* A lease larger than the reservation (more tokens than
  ``max_num_batched_tokens``, a micro-batch id not below ``num_ubatches``) is a
  ``WorkspaceCapacityError`` naming the family, the layer, the token count, the
  micro-batch, the bytes needed and the bytes reserved, for every family,
  policy and indexer dtype; it allocates nothing, builds no view and holds no
  slot afterwards (vllm#41700's "workspace is locked" assert said none of that).
* The reservation is the worst case a lease can ask: every view of a lease of
  ``max_num_batched_tokens`` tokens lies inside its own slot.
* ``reserve(budget_bytes=...)`` refuses ``private`` beyond the budget, naming
  the policy, the bytes per layer and in total, the budget and the
  alternatives, before allocating anything; ``reserve_budget_bytes`` derives the
  budget from the device.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Iterator

import pytest
import torch

from tests.support.families import FAMILIES, small_workspace_config
from vllm_dsv4_backend import eager
from vllm_dsv4_backend.layer.plan import (
    DSV4_FLASH_HF_CONFIG,
    build_workspace_config,
    dims_from_hf_config,
)
from vllm_dsv4_backend.testing.schedule import WIDE_PLAN
from vllm_dsv4_backend.workspace import (
    WorkspaceBudgetError,
    WorkspaceCapacityError,
    WorkspaceConfig,
    WorkspaceManager,
    count_allocations,
    plan_layout,
    private_fit_tokens,
    reserve_budget_bytes,
    workspace_bytes,
)

MNBT = 24
# SWA, C4, C128, C4, and an MTP-style drafter layer (compress_ratio 1: q only).
RATIOS = (0, 4, 128, 4, 1)
LAYER_OF = {"q": "layers.0", "indexer_q": "layers.1", "topk": "layers.1",
            "compressor": "layers.2"}

# The q family's three shapes: the padded q only, q + attention output, and
# the output only (how both vLLM layers build it). Every other family of
# every layer kind (C4's compressor scratch included), every view: an
# explicit lease plan (``WIDE_PLAN`` with the q views swapped).
Q_LAYOUTS: list[tuple[str, ...]] = [("q",), ("q", "out"), ("out",)]


def plan(q: tuple[str, ...] = ("q",)) -> dict[str, dict[str, tuple[str, ...]]]:
    return {kind: {**fams, "q": q} for kind, fams in WIDE_PLAN.items()}


def config(
    dtype: str = "fp8", ubatches: int = 1, tokens: int = MNBT, q: tuple[str, ...] = ("q",)
) -> WorkspaceConfig:
    return small_workspace_config(heads=4, head_dim=64, index_head_dim=64, index_topk=16,
                                  tokens=tokens, indexer=dtype, plan=plan(q),
                                  num_ubatches=ubatches, ratios=RATIOS)


def manager(
    policy: str, dtype: str = "fp8", ubatches: int = 1, q: tuple[str, ...] = ("q",)
) -> WorkspaceManager:
    mgr = WorkspaceManager(config(dtype, ubatches, q=q), policy=policy, debug=False)
    mgr.reserve()
    return mgr


def cases() -> Iterator[tuple[str, str, tuple[str, ...]]]:
    for dtype in ("fp8", "mxfp4"):
        for fam in FAMILIES:
            for q in (Q_LAYOUTS if fam == "q" else Q_LAYOUTS[:1]):
                yield dtype, fam, q


CASES = list(cases())
IDS = [f"{d}-{f}-" + "+".join(q) for d, f, q in CASES]


def _needed(cfg: WorkspaceConfig, family: str, tokens: int) -> int:
    return sum(s.nbytes(tokens) for s in cfg.family_buffers(family))


@pytest.mark.parametrize("policy", ["shared", "private", "off"])
@pytest.mark.parametrize(("dtype", "family", "q"), CASES, ids=IDS)
def test_more_tokens_than_reserved_is_refused_with_bytes(policy, dtype, family, q):
    mgr = manager(policy, dtype, q=q)
    cfg = mgr.config
    assert cfg.family_names == FAMILIES
    assert [s.name for s in cfg.family_buffers("q")] == list(q)
    layer = LAYER_OF[family]
    storage = None if mgr.storage is None else (mgr.storage.data_ptr(), mgr.storage.numel())
    mgr.lease(layer, family, MNBT).release()  # the bound itself is served
    for tokens in (MNBT + 1, 2 * MNBT, 10 * MNBT):
        with count_allocations() as counter, pytest.raises(WorkspaceCapacityError) as ei:
            mgr.lease(layer, family, tokens)
        msg = str(ei.value)
        assert isinstance(ei.value, ValueError)
        for part in (repr(family), repr(layer), "ubatch 0", repr(policy),
                     f"requested {tokens} tokens = {_needed(cfg, family, tokens)} bytes",
                     f"reserved {MNBT} tokens = {_needed(cfg, family, MNBT)} bytes",
                     "--max-num-batched-tokens"):
            assert part in msg, (part, msg)
        if policy != "off":
            assert f"a {cfg.slot_bytes(family)}-byte slot" in msg, msg
        else:
            assert "VLLM_DSV4_WORKSPACE=off" not in msg, msg  # off would not help
        # Never a silent allocation, never a view past the reservation.
        assert counter.count == 0
        cur = None if mgr.storage is None else (mgr.storage.data_ptr(), mgr.storage.numel())
        assert cur == storage
        if policy != "off":
            slot = mgr._lookup[(layer, family, 0)]
            assert tokens not in slot.views and slot.holder is None
    # The refused leases held nothing.
    mgr.lease(layer, family, MNBT).release()
    assert mgr.stats()["leased_bytes_now"] == 0


@pytest.mark.parametrize("policy", ["shared", "private", "off"])
@pytest.mark.parametrize("ubatches", [1, 2])
@pytest.mark.parametrize(("dtype", "family", "q"), CASES, ids=IDS)
def test_more_micro_batches_than_reserved_is_refused_with_bytes(
    policy, ubatches, dtype, family, q
):
    mgr = manager(policy, dtype, ubatches, q=q)
    cfg = mgr.config
    layer = LAYER_OF[family]
    per_ubatch = 0 if policy == "off" else cfg.slot_bytes(family) * (
        1 if policy == "shared" else sum(family in cfg.layer_families(r) for r in RATIOS))
    for u in range(ubatches):
        mgr.lease(layer, family, MNBT, ubatch=u).release()
    for u in (ubatches, ubatches + 3):
        with count_allocations() as counter, pytest.raises(WorkspaceCapacityError) as ei:
            mgr.lease(layer, family, 5, ubatch=u)
        msg = str(ei.value)
        assert isinstance(ei.value, ValueError)
        for part in (repr(family), repr(layer), f"ubatch {u}", repr(policy),
                     f"requested 5 tokens = {_needed(cfg, family, 5)} bytes for micro-batch {u}",
                     "reserved 0 bytes", f"micro-batches [0, {ubatches})",
                     f"{per_ubatch} bytes of {family!r} each", "num_ubatches"):
            assert part in msg, (part, msg)
        assert counter.count == 0
    # Not a capacity problem: a bad id is a plain ValueError naming the range.
    for bad in (-1, 1.0, None):
        with pytest.raises(ValueError, match=r"ubatch: expected an int in \[0, ") as ei:
            mgr.lease(layer, family, 1, ubatch=bad)
        assert not isinstance(ei.value, WorkspaceCapacityError)


@pytest.mark.parametrize("family", FAMILIES)
def test_step_over_the_bound_holds_nothing(family):
    """Through eager.Region (how both layers lease): the refused family is not held
    and the step's slot is free for the next step."""
    mgr = manager("shared", "mxfp4", q=("q", "out"))
    layer = LAYER_OF[family]
    with pytest.raises(WorkspaceCapacityError, match=repr(family)), \
            eager.Region(mgr, layer, MNBT + 1) as region:
        region.lease(family)
    assert region.held() == ()
    with pytest.raises(WorkspaceCapacityError, match="ubatch 1"), \
            eager.Region(mgr, layer, MNBT, ubatch=1) as region:
        region.lease(family)
    assert region.held() == ()
    with eager.Region(mgr, layer, MNBT) as region:
        region.lease(family)
    assert mgr.stats()["leased_bytes_now"] == 0


@pytest.mark.parametrize("policy", ["shared", "private"])
@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_reservation_covers_the_worst_case_lease(policy, dtype):
    """Every view of a max_num_batched_tokens lease of every layer, family and
    micro-batch lies inside its own slot, and slots do not overlap."""
    mgr = manager(policy, dtype, ubatches=2, q=("q", "out"))
    base = mgr.storage.data_ptr()
    end = base + mgr.storage.numel()
    for (layer, family, u), slot in mgr._lookup.items():
        lo, hi = base + slot.offset, base + slot.offset + slot.nbytes
        assert hi <= end
        with mgr.lease(layer, family, MNBT, ubatch=u) as lease:
            for name, v in lease.views.items():
                assert v.shape[0] == MNBT, name
                a = v.data_ptr()
                assert lo <= a and a + v.numel() * v.element_size() <= hi, (layer, family, name)
    spans = sorted((s.offset, s.offset + s.nbytes) for s in mgr._slots)
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))


# --- the private policy's budget ---------------------------------------------------------


def flash_private(tokens: int = 8192, ubatches: int = 1) -> WorkspaceManager:
    dims, ratios = dims_from_hf_config(DSV4_FLASH_HF_CONFIG, tp_size=1)
    cfg = build_workspace_config(dims, max_num_batched_tokens=tokens, indexer_kv_dtype="fp8",
                                 plan=plan(("out",)), num_ubatches=ubatches,
                                 compress_ratios=ratios)
    return WorkspaceManager(cfg, policy="private", debug=False)


def test_private_over_budget_is_refused_at_reserve_with_the_alternatives():
    mgr = flash_private()
    total = workspace_bytes(mgr.config, "private").total
    assert total > 20 << 30  # ~24 GiB at 8192 tokens on Flash
    budget = 16 << 30
    with count_allocations() as counter, pytest.raises(WorkspaceBudgetError) as ei:
        mgr.reserve(budget_bytes=budget)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    cfg = mgr.config
    c4 = sum(cfg.slot_bytes(f) for f in cfg.layer_families(4))
    c128 = sum(cfg.slot_bytes(f) for f in cfg.layer_families(128))
    swa = cfg.slot_bytes("q")
    fit = private_fit_tokens(cfg, None, budget)
    shared = workspace_bytes(cfg, "shared").total
    for part in ("VLLM_DSV4_WORKSPACE=private", f"needs {total} bytes", "for 43 layers",
                 f"C4 {c4} bytes", "x 21", f"C128 {c128} bytes", "x 20", f"SWA {swa} bytes",
                 "x 2", f"the budget is {budget} bytes", "VLLM_DSV4_WORKSPACE=shared",
                 f"the default: {shared} bytes", "--max-num-batched-tokens",
                 f"private fits at <= {fit} tokens", "max_num_batched_tokens=8192"):
        assert part in msg, (part, msg)
    # Refused before anything was allocated; a later reserve within budget works.
    assert counter.count == 0 and not mgr.reserved and mgr.storage is None
    small = flash_private(tokens=fit)
    small.reserve(budget_bytes=budget)
    assert small.storage.numel() <= budget


def test_private_fit_tokens_is_the_largest_that_fits():
    cfg = config("mxfp4", ubatches=2, tokens=4096, q=("q", "out"))

    def total(t: int) -> int:
        return workspace_bytes(dataclasses.replace(cfg, max_num_batched_tokens=t),
                               "private").total

    for budget in (total(1) - 1, total(1), total(777) + 5, total(4096), total(4096) * 2):
        t = private_fit_tokens(cfg, None, budget)
        assert 0 <= t <= 4096
        if t:
            assert total(t) <= budget
        if t < 4096:
            assert total(t + 1) > budget
    assert private_fit_tokens(cfg, None, total(1) - 1) == 0


def test_private_budget_boundary_and_other_policies():
    cfg = config("fp8", ubatches=2, q=("q", "out"))
    total = plan_layout(cfg, None, "private").total_bytes
    exact = WorkspaceManager(cfg, policy="private", debug=False)
    exact.reserve(budget_bytes=total)  # fits exactly
    assert exact.storage.numel() == total
    with pytest.raises(WorkspaceBudgetError, match=r"needs \d+ bytes .* x 2 micro-batch"):
        WorkspaceManager(cfg, policy="private", debug=False).reserve(budget_bytes=total - 1)
    with pytest.raises(WorkspaceBudgetError, match="does not fit even at 1 token"):
        WorkspaceManager(cfg, policy="private", debug=False).reserve(budget_bytes=0)
    # Only private is checked: shared and off reserve as before.
    for policy in ("shared", "off"):
        mgr = WorkspaceManager(cfg, policy=policy, debug=False)
        mgr.reserve(budget_bytes=0)
        assert mgr.reserved
    # None: no check (the default, unchanged behaviour).
    WorkspaceManager(cfg, policy="private", debug=False).reserve()
    for bad in (-1, 1.5, "1"):
        with pytest.raises(ValueError, match="budget_bytes"):
            WorkspaceManager(cfg, policy="private", debug=False).reserve(budget_bytes=bad)


def test_reserve_budget_bytes_cpu(monkeypatch):
    psutil = pytest.importorskip("psutil")
    got = reserve_budget_bytes("cpu")
    assert isinstance(got, int) and 0 < got <= psutil.virtual_memory().total
    monkeypatch.setitem(sys.modules, "psutil", None)  # "import psutil" fails
    assert reserve_budget_bytes("cpu") is None
    assert reserve_budget_bytes("meta") is None


def test_reserve_budget_bytes_cuda_formula(monkeypatch):
    gib = 1 << 30
    seen = []

    def mem_get_info(device):
        seen.append(device)
        return 30 * gib, 140 * gib  # 110 GiB used (weights, other processes)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    # gpu_memory_utilization 0.9: vLLM may use 126 GiB; 126 - 110 = 16 GiB left.
    assert reserve_budget_bytes("cuda:0", 0.9) == int(30 * gib - 0.1 * 140 * gib)
    assert reserve_budget_bytes(torch.device("cuda", 0)) == 30 * gib
    assert reserve_budget_bytes("cuda:0", 0.5) == 0  # already past its share
    assert seen[0] == torch.device("cuda:0")
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match=r"memory_utilization: expected a float in \(0, 1\]"):
            reserve_budget_bytes("cuda:0", bad)


def test_budget_module_is_torch_only():
    import vllm_dsv4_backend.workspace.budget as budget

    assert not any(isinstance(v, types.ModuleType) and v.__name__.startswith("vllm.")
                   for v in vars(budget).values())
