# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Safety item 3: event evidence that a slot is not overwritten before its previous
consumers finish.

The evidence runs on simulated streams (``SimStreamBackend``: every CUDA stream a FIFO
queue, every event a dependency; the queued work then runs in many random orders that
respect only per-stream order and the recorded event waits, i.e. every interleaving a
GPU may pick). A 43-layer DeepSeek-V4-Flash-shaped program
(``testing.schedule.enqueue_dsv4_step``: two micro-batches, default/aux0/aux1 streams per
micro-batch, the ``wide``/``narrow``/``random`` stream roles) goes through the real
``WorkspaceManager``: producers stamp every leased byte, consumers check the stamps at
their start and end. The program, the schedule runner and #49236's layout are
tests.support.stream_schedule's (``build_program``, ``run_schedules``,
``Pool49236Layout``), which tests/core/test_stream_schedule.py runs too.

For each stream-role variant, under the same schedules (same seeds):

* the plugin's layout, fences on: no corrupt schedule;
* the plugin's layout, fences off (test-only switch): corrupt (the check can see #52836);
* vLLM #49236's layout, fences on: corrupt. Its layout, reproduced as the negative
  control: ONE buffer; the FP4-indexer, top-k and compressor families carved at the
  same offset (offset 0 of the aux region, after padded q); ONE template for every
  layer keyed only by the token count (every layer leases the same bytes, and the two
  micro-batches too).

On CUDA the same program runs on real streams in tests/gpu/test_workspace_cuda.py.
"""

from __future__ import annotations

import pytest

from tests.support import stream_schedule as S
from tests.support.stream_schedule import AUX_FAMILIES, Pool49236Layout
from vllm_dsv4_backend.workspace import WorkspaceLeaseError, WorkspaceManager

VARIANTS = ("wide", "narrow", "random")


def _check_pool_is_49236(mgr: WorkspaceManager) -> None:
    """The negative control really has #49236's three properties."""
    slots = mgr._slots
    aux_offsets = {s.offset for s in slots if s.family in AUX_FAMILIES}
    assert len(aux_offsets) == 1  # the aux families at one offset
    assert {s.offset for s in slots if s.family == "q"} == {0}  # both micro-batches too
    assert mgr.storage is not None and mgr.storage.numel() == (
        mgr.config.slot_bytes("q") + max(mgr.config.slot_bytes(f) for f in AUX_FAMILIES))
    # one template: every layer's lease of a family at T tokens is the same tensor
    names = [n for n, r in mgr.layers.items() if r == 4]
    views = set()
    for n in names:
        with mgr.lease(n, "topk", 5) as ls:
            views.add(ls["local"].data_ptr())
    assert len(views) == 1


def _counts(n: int, seeds: int) -> dict[str, dict[str, list[int]]]:
    """{variant: {"plugin_fenced" | "plugin_unfenced" | "pool49236": [corrupt, run]}}."""
    out: dict[str, dict[str, list[int]]] = {}
    for v in VARIANTS:
        row = {"plugin_fenced": [0, 0], "plugin_unfenced": [0, 0], "pool49236": [0, 0]}
        for seed in range(seeds):
            for key, kw in (("plugin_fenced", {}), ("plugin_unfenced", {"fences": False}),
                            ("pool49236", {"manager_cls": Pool49236Layout})):
                mgr, be, k = S.build_program(variant=v, seed=seed, **kw)
                if key == "pool49236":
                    _check_pool_is_49236(mgr)
                # The same schedules (orders) for the three layouts.
                corrupt, _ = S.run_schedules(mgr, be, k, n, seed=1000 * seed + len(v))
                row[key][0] += corrupt
                row[key][1] += n
        out[v] = row
    return out


def test_fenced_clean_unfenced_and_49236_corrupt(safety_full, figures):
    n, seeds = (60, 3) if safety_full else (20, 1)
    counts = _counts(n, seeds)
    for v, row in counts.items():
        assert row["plugin_fenced"][0] == 0, (v, row)
        assert row["plugin_unfenced"][0] > 0, (v, row)
        assert row["pool49236"][0] > 0, (v, row)
    total = sum(r["plugin_fenced"][1] for r in counts.values())

    def col(key: str) -> str:
        return "+".join(str(counts[v][key][0]) for v in VARIANTS)

    figure = (f"{total} schedules per layout ({'/'.join(VARIANTS)} stream roles, 43 layers, "
              f"2 micro-batches); corrupt: plugin fenced {col('plugin_fenced')}, "
              f"plugin unfenced {col('plugin_unfenced')}, #49236 layout fenced "
              f"{col('pool49236')}")
    figures.record(3, figure, {"schedules_per_layout": total, "counts": counts})


def test_49236_layout_is_refused_by_debug_mode():
    # VLLM_DSV4_WORKSPACE_DEBUG's overlap check names the aliasing at the first lease.
    with pytest.raises(WorkspaceLeaseError, match="overlapping leases"):
        S.build_program(variant="wide", debug=True, manager_cls=Pool49236Layout)
