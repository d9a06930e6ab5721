# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Safety item 5: what the synchronisation costs against the allocations it saves
(a printed figure, not a timed assertion).

Measured on CPU inside real engine steps of the tiny model (4 attention layers, the
item 1 prompts, one request at a time; ``engine_worker.WorkspaceTimer``): the worker
wraps ``WorkspaceManager.lease`` / ``_release`` / ``_fence`` and the model runner's
``execute_model`` with ``perf_counter`` and sums, per step:

* ``shared``: the time in lease + release, which is all the workspace's bookkeeping
  (slot lookup, view cache, fence: ``_fence`` runs inside them), and the fence waits;
* ``off`` (the baseline, same prompts): the time in the same calls, which there are
  ``torch.empty`` per view (the allocations ``shared`` avoids) plus the same lookups,
  and the number of those allocations per step.

What this does **not** measure: on CPU a stream is a no-op (no events are recorded,
``_fence`` returns at once), so this is the bookkeeping's Python cost, not a GPU
event wait; and the CPU allocator is not the CUDA caching allocator (no
``record_stream``, no cross-stream block reuse). The CUDA figure belongs to the
GPU checks (tests/gpu, tools/cuda_graph). The step time is the whole
``execute_model`` on a shared 2-core host, so only the medians mean much.
"""

from __future__ import annotations

import statistics
from typing import Any


def per_step(steps: list[dict[str, Any]]) -> dict[str, float]:
    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    return {
        "steps": len(steps),
        "step_ms": med([s["step_s"] * 1e3 for s in steps]),
        "ws_us": med([(s["lease_s"] + s["release_s"]) * 1e6 for s in steps]),
        "fence_us": med([s["fence_s"] * 1e6 for s in steps]),
        "leases": med([s["lease_calls"] for s in steps]),
        "views": med([s["views"] for s in steps]),
        "ws_total_ms": sum((s["lease_s"] + s["release_s"]) * 1e3 for s in steps),
        "step_total_ms": sum(s["step_s"] * 1e3 for s in steps),
    }


def test_sync_cost_against_allocations_saved(engine_runs, figures):
    run = "parity@1"
    shared = per_step(engine_runs["shared"]["timing"][run])
    off = per_step(engine_runs["off"]["timing"][run])
    (st_shared,) = engine_runs["shared"]["stats"]
    (st_off,) = engine_runs["off"]["stats"]
    assert shared["steps"] > 0 and off["steps"] == shared["steps"]
    # The baseline allocates one tensor per leased view; shared allocates none.
    assert st_shared["allocations_total"] == 0
    assert st_off["allocations_total"] > 0
    allocs = off["views"]
    share = shared["ws_total_ms"] / shared["step_total_ms"]
    figure = (f"median per step ({shared['steps']} steps, {shared['leases']:.0f} leases): "
              f"shared lease+release {shared['ws_us']:.0f} us (fences {shared['fence_us']:.0f}"
              f" us, {share:.2%} of step time) vs off {off['ws_us']:.0f} us incl. "
              f"{allocs:.0f} allocations avoided; step {shared['step_ms']:.1f} ms "
              f"(CPU: no real stream events)")
    figures.record(5, figure, {"run": run, "shared": shared, "off": off,
                               "fence_waits_shared": st_shared["fence_waits_total"]})
