# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Adversarial stream test on CPU: the #52836 race, reproduced and fenced off.

Each CUDA stream is a queue of operations, each event a dependency
(``SimStreamBackend``). A 43-layer DeepSeek-V4-Flash-shaped program (layer
types ``[0,0] + [4,128]*20 + [4]``, two micro-batches with their own
default/aux0/aux1 streams) goes through the *real* ``WorkspaceManager``:
producers write unique stamps into the leased views, consumers check them at
their start and end. The queued operations then run in many random orders
that respect only FIFO order per stream and the recorded event waits.

* fences on: no consumer ever sees a wrong stamp (shared, private, off; debug
  poisoning on and off; three stream-role variants);
* fences off (test-only switch): corruption is detected;
* #49236's layout (all aux families at one offset, one storage for both
  micro-batches) corrupts even with fences, and debug mode refuses it.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.families import FAMILIES
from tests.support.stream_schedule import (
    T_MAX,
    Pool49236Layout,
    build_program,
    run_schedules,
    sim_streams,
    small_config,
)
from vllm_dsv4_backend.testing.schedule import (
    STREAM_ROLES,
    StampKernels,
    enqueue_dsv4_step,
)
from vllm_dsv4_backend.workspace import (
    NullStreamBackend,
    SimStreamBackend,
    WorkspaceLeaseError,
    WorkspaceManager,
)

# --- the simulator itself --------------------------------------------------------------


def test_sim_respects_fifo_and_events_only():
    be = SimStreamBackend(["a", "b"])
    a, b = be.stream("a"), be.stream("b")
    log: list[str] = []
    ev = be.new_event()
    be.launch(a, lambda: log.append("a1"))
    be.record(ev, a)
    be.launch(a, lambda: log.append("a2"))
    be.wait(b, ev)
    be.launch(b, lambda: log.append("b1"))
    orders = set()
    rng = random.Random(0)
    for _ in range(200):
        log.clear()
        assert be.execute(rng) == 5
        orders.add(tuple(log))
        assert log.index("a1") < log.index("b1")  # the event
        assert log.index("a1") < log.index("a2")  # FIFO
    # b1 may run before or after a2: nothing orders them.
    assert orders == {("a1", "a2", "b1"), ("a1", "b1", "a2")}


def test_sim_event_rerecord_and_unrecorded_wait_follow_cuda():
    be = SimStreamBackend(["a", "b"])
    a, b = be.stream("a"), be.stream("b")
    log: list[str] = []
    ev = be.new_event()
    be.wait(b, ev)  # never recorded: no-op, like cudaStreamWaitEvent
    be.launch(b, lambda: log.append("b0"))
    be.record(ev, a)
    be.launch(a, lambda: log.append("a1"))
    be.wait(b, ev)  # binds to the first record (before a1)
    be.record(ev, a)  # re-record after a1: does not affect the wait above
    be.launch(b, lambda: log.append("b1"))
    seen_b1_before_a1 = False
    rng = random.Random(1)
    for _ in range(300):
        log.clear()
        be.execute(rng)
        seen_b1_before_a1 |= log.index("b1") < log.index("a1")
    assert seen_b1_before_a1


# --- fenced: never corrupt -------------------------------------------------------------


@pytest.mark.parametrize(
    "variant,policy,debug,indexer,n",
    [
        ("wide", "shared", False, "mxfp4", 100),
        ("narrow", "shared", False, "fp8", 60),
        ("random", "shared", False, "mxfp4", 60),
        ("wide", "shared", True, "mxfp4", 30),
        ("random", "private", False, "fp8", 20),
        ("random", "off", False, "mxfp4", 15),
    ],
)
def test_fenced_schedules_never_corrupt(variant, policy, debug, indexer, n):
    mgr, be, k = build_program(policy=policy, variant=variant, debug=debug, indexer=indexer)
    stats = mgr.stats()
    if policy == "shared":
        # One slot per family and micro-batch: the 43 layers really share it.
        assert stats["num_slots"] == 2 * 4
        assert stats["fence_waits_total"] > 0
    corrupt, first = run_schedules(mgr, be, k, n, seed=len(variant) * 31 + n)
    assert corrupt == 0, f"{corrupt}/{n} schedules corrupt, e.g. {first[:3]}"
    assert stats["leased_bytes_now"] == 0


@pytest.mark.parametrize("fences", [True, False])
def test_ping_pong_slots(fences):
    # Two slots per family: layer n+1 gets the other slot, but layer n+2 reuses
    # layer n's, so fences are still what keeps it safe.
    mgr, be, k = build_program(variant="random", shared_slots=2, fences=fences, seed=2)
    assert mgr.stats()["num_slots"] == 2 * 4 * 2
    corrupt, first = run_schedules(mgr, be, k, 30, seed=4)
    assert (corrupt == 0) if fences else (corrupt > 0), first[:3]


# --- fences off: the test must catch the #52836 corruption ------------------------------


@pytest.mark.parametrize("variant", ["wide", "narrow", "random"])
def test_fences_off_is_detected(variant):
    mgr, be, k = build_program(variant=variant, fences=False)
    assert mgr.stats()["fences_enabled"] is False
    assert mgr.stats()["fence_waits_total"] == 0
    n = 30
    corrupt, first = run_schedules(mgr, be, k, n, seed=7)
    # A producer on one stream overwrote what a consumer on another still read.
    assert corrupt > n // 4, f"only {corrupt}/{n} schedules showed corruption"
    assert first


def test_fences_off_with_debug_poison_is_detected():
    mgr, be, k = build_program(variant="wide", fences=False, debug=True)
    corrupt, _ = run_schedules(mgr, be, k, 20, seed=3)
    assert corrupt > 0


def test_fences_off_private_detects_step_to_step_reuse():
    # private storage is reused by the same layer next step: that needs fences
    # too. Two layers and six steps put the reuses close together in time.
    mgr, be, k = build_program(policy="private", variant="random", fences=False, seed=5,
                               ratios=(4, 128), step_tokens=((3, 1), (2, 5)) * 3)
    corrupt, _ = run_schedules(mgr, be, k, 40, seed=11)
    assert corrupt > 0


# --- #49236's layout: aliasing families and micro-batches -------------------------------


def test_pool49236_layout_corrupts_even_with_fences():
    mgr, be, k = build_program(variant="wide", manager_cls=Pool49236Layout)
    corrupt, first = run_schedules(mgr, be, k, 30, seed=5)
    assert corrupt > 0
    families = {tag.split()[-2] for tag, _ in first}
    assert families & {"indexer_q", "topk", "compressor", "q"}


def test_pool49236_layout_is_refused_in_debug_mode():
    with pytest.raises(WorkspaceLeaseError, match="overlapping leases"):
        build_program(variant="wide", debug=True, manager_cls=Pool49236Layout)


def test_families_and_ubatches_never_share_bytes():
    mgr, _, _ = build_program(variant="wide")
    ranges = sorted((s.offset, s.offset + s.nbytes, s.family, s.ubatch) for s in mgr._slots)
    for (a0, a1, *_), (b0, b1, *_) in zip(ranges, ranges[1:]):
        assert a1 <= b0
    assert ranges[-1][1] <= mgr.storage.numel()
    assert {(f, u) for *_, f, u in ranges} == {
        (f, u) for f in FAMILIES for u in (0, 1)
    }


def test_stamps_cover_every_view_byte():
    # A consumer checks every word of every view; a partial overwrite is caught.
    be, per_ub = sim_streams(1)
    mgr = WorkspaceManager(small_config(num_ubatches=1), policy="shared", streams=be)
    mgr.reserve()
    k = StampKernels(be)
    d = per_ub[0]["default"]
    ls = mgr.lease("layers.2", "topk", 5, stream=d)
    k.produce(d, ls, 42)
    be.launch(d, lambda: ls["lens"][4].fill_(0))
    k.consume(d, ls, 42, "partial")
    ls.release()
    be.execute(None)
    assert k.mismatches() == [("partial (start)", 1), ("partial (end)", 1)]
    assert torch.all(ls["local"] == 42)


@pytest.mark.parametrize("use_numpy", [True, False])
def test_program_on_one_inline_stream_is_clean(use_numpy):
    # Sanity of the program and of both stamp-kernel flavours (the torch one is
    # what the CUDA test runs): with every role on one in-order stream there is
    # nothing to race, so every check must pass, and a tampered byte must not.
    be = NullStreamBackend()
    mgr = WorkspaceManager(small_config(ratios=(0, 4, 128, 4)), policy="shared", streams=be)
    mgr.reserve()
    k = StampKernels(be, use_numpy=use_numpy)
    one = {r: be.current_stream() for r in STREAM_ROLES}
    for variant in ("wide", "narrow"):
        enqueue_dsv4_step(mgr, k, [one, one], (5, T_MAX), variant=variant)
    enqueue_dsv4_step(mgr, k, [one, one], (2, 3), variant="random", rng=random.Random(0))
    assert k.mismatches() == []
    assert k.num_produced > 0 and len(k._counts) > 0
    ls = mgr.lease("layers.1", "compressor", 4)
    k.produce(be.current_stream(), ls, 7)
    ls["scratch"][3, 5] = 1.0
    k.consume(be.current_stream(), ls, 7, "tampered")
    ls.release()
    assert k.mismatches() == [("tampered (start)", 1), ("tampered (end)", 1)]
