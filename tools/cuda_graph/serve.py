# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A served process's steps in one model over one workspace: FULL replays,
breakable PIECEWISE replays and eager steps interleaved, micro-batches on
and off, as vLLM's dispatcher picks them.

vLLM captures every graph at start-up (after a warm-up run, largest size
first, all in one graph memory pool) and then chooses per step
(``CudagraphDispatcher`` under ``FULL_AND_PIECEWISE``): a uniform decode
batch within the capture sizes replays its FULL graph, a mixed batch
within them its breakable PIECEWISE graphs (the eager break runs its Python
at replay), and a batch above the largest capture size runs eagerly
(on an H200 with vLLM's defaults: every step over 512 tokens). With DBO a
step runs two micro-batches on vLLM's ``UBatchContext`` threads, else one.
The harness's sizes are scaled down: capture sizes :data:`CAPTURE_SIZES`
tokens per micro-batch, each batch shape exactly one of them (vLLM pads a
batch up to the next size) or above the largest.

Each micro-batch's requests advance only on the steps it runs (a decode
request by one token, the prefill request by its chunk), so positions,
slots and compress boundaries move as in a served sequence; the serial
reference runs the same schedule eagerly on a model without streams or
workspace, micro-batch after micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch
from model import NUM_UBATCHES, Batch, Meter, Model, measuring

CAPTURE_SIZES = (4, 8)  # tokens per micro-batch (vLLM: cudagraph_capture_sizes)
DECODE = Batch(4, 0)  # a uniform decode batch at capture size 4: FULL
MIXED = Batch(4, 4)  # decodes + a prefill chunk at capture size 8: PIECEWISE
LONG = Batch(4, 11)  # above the largest capture size: eager
SERVE_BATCHES = (DECODE, MIXED, LONG)


@dataclasses.dataclass(frozen=True)
class Step:
    batch: Batch
    dbo: bool  # two micro-batches on vLLM's threads, else one

    @property
    def graph(self) -> str:
        return dispatch(self.batch)

    @property
    def ubatches(self) -> tuple[int, ...]:
        return tuple(range(NUM_UBATCHES)) if self.dbo else (0,)


def dispatch(batch: Batch) -> str:
    """vLLM's choice for a batch: ``full``, ``piecewise`` or ``eager``."""
    if batch.tokens > max(CAPTURE_SIZES):
        return "eager"
    if batch.tokens not in CAPTURE_SIZES:
        raise ValueError(f"batch {batch}: the harness sizes batches at a capture size "
                         f"{CAPTURE_SIZES} (vLLM pads up to one)")
    return "full" if batch.prefill == 0 else "piecewise"


# Every transition between the three kinds (F P E F E P F: FP, PE, EF, FE, EP,
# PF), each kind with micro-batches on and off.
SCHEDULE: tuple[Step, ...] = (
    Step(DECODE, False), Step(MIXED, True), Step(LONG, True), Step(DECODE, True),
    Step(LONG, False), Step(MIXED, False), Step(DECODE, False),
)


class Progress:
    """Tokens each request of each micro-batch has been served so far."""

    def __init__(self, max_decodes: int) -> None:
        self.done = [[0] * (max_decodes + 1) for _ in range(NUM_UBATCHES)]

    def of(self, u: int, batch: Batch) -> list[int]:
        return self.done[u][:batch.decodes] + [self.done[u][-1]]

    def advance(self, u: int, batch: Batch) -> None:
        for r in range(batch.decodes):
            self.done[u][r] += 1
        self.done[u][-1] += batch.prefill


def load(model: Model, i: int, step: Step, progress: Progress) -> None:
    model.select(step.batch)
    for u in step.ubatches:
        model.load_ubatch(u, progress.of(u, step.batch), seed=1000 * i + u)


def reference(model: Model, schedule: tuple[Step, ...]) -> list[torch.Tensor]:
    """The schedule run eagerly, micro-batch after micro-batch."""
    from vllm.config import CUDAGraphMode

    progress = Progress(model.max_decodes)
    outs = []
    for i, step in enumerate(schedule):
        load(model, i, step, progress)
        xs = [model.forward_ubatch(u, CUDAGraphMode.NONE) for u in step.ubatches]
        outs.append(torch.stack(xs).cpu())
        for u in step.ubatches:
            progress.advance(u, step.batch)
    return outs


class Server:
    """One model served over ``schedule``: :meth:`capture` at start-up, then
    :meth:`step` per step (the graph vLLM's dispatcher picks).

    ``dbo``: a :class:`modes.DboRunner` over ``model``; ``mrv1``: vLLM 0.33's
    MRV1 captures PIECEWISE with ``attn_metadata=None``; ``det`` / ``phase``:
    the race detector and its phase switch (capture-time accesses are counted
    as races too, and apart); ``leases``: the workspace's lease counter."""

    def __init__(self, model: Model, dbo: Any, mrv1: bool = False, det: Any = None,
                 phase: Callable[[Any, str], Any] | None = None,
                 leases: Callable[[Model], int] | None = None) -> None:
        self.model, self.dbo, self.mrv1, self.det = model, dbo, mrv1, det
        self.phase = phase or (lambda d, n: contextlib.nullcontext())
        self.count = leases or (lambda m: 0)
        self.full: dict[tuple[Batch, bool], tuple[Any, list[torch.Tensor]]] = {}
        self.pieces: dict[tuple[Batch, int], tuple[Any, torch.Tensor]] = {}
        self.progress = Progress(model.max_decodes)
        self.meter = Meter(model.device)

    def capture(self, schedule: tuple[Step, ...]) -> None:
        """Every graph ``schedule`` needs, in one pool: per batch shape, largest
        first, a warm-up run, its FULL graphs, its PIECEWISE graphs."""
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
        from vllm.config import CUDAGraphMode

        m, det, phase = self.model, self.det, self.phase
        snap = m.snapshot()
        pool = torch.cuda.graph_pool_handle()  # one pool for every graph, as vLLM's
        need_full = {(s.batch, s.dbo) for s in schedule if s.graph == "full"}
        need_pw = {(s.batch, u) for s in schedule if s.graph == "piecewise"
                   for u in s.ubatches}
        for batch in sorted({b for b, _ in need_full | need_pw}, key=lambda b: -b.tokens):
            m.select(batch)
            for u in range(NUM_UBATCHES):
                m.load_ubatch(u, self.progress.of(u, batch), seed=u)
            m.forward_step(CUDAGraphMode.NONE)  # the warm-up, as vLLM's
            torch.cuda.synchronize()
            for use_dbo in sorted(d for b, d in need_full if b == batch):
                graph = torch.cuda.CUDAGraph()
                cap = torch.cuda.Stream(m.device)
                cap.wait_stream(torch.cuda.current_stream(m.device))
                finish = (self.dbo.begin(CUDAGraphMode.FULL, None, compute=cap) if use_dbo
                          else lambda: [m.forward_ubatch(0, CUDAGraphMode.FULL)])
                with torch.cuda.graph(graph, pool=pool, stream=cap), phase(det, "capture"):
                    static = finish()
                torch.cuda.synchronize()
                self.full[(batch, use_dbo)] = (graph, static)
            side = torch.cuda.Stream(m.device)
            side.wait_stream(torch.cuda.current_stream(m.device))
            m.dummy_metadata = self.mrv1
            try:
                for u in sorted(u for b, u in need_pw if b == batch):
                    cap = BreakableCUDAGraphCapture(pool=pool)
                    with torch.cuda.stream(side), phase(det, "capture"), cap:
                        out = m.forward_ubatch(u, CUDAGraphMode.PIECEWISE)
                    self.pieces[(batch, u)] = (cap, out)
            finally:
                m.dummy_metadata = False
            torch.cuda.synchronize()
        m.restore(snap)
        torch.cuda.synchronize()

    def step(self, i: int, step: Step) -> dict[str, Any]:
        """Serve step ``i``: its inputs, vLLM's choice of graph, the outputs."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker import ubatching

        m, meter = self.model, self.meter
        load(m, i, step, self.progress)
        l0 = self.count(m)
        if step.graph == "eager":
            xs = (self.dbo.forward(CUDAGraphMode.NONE, meter) if step.dbo
                  else [m.forward_ubatch(0, CUDAGraphMode.NONE, meter)])
        elif step.graph == "full":
            graph, xs = self.full[(step.batch, step.dbo)]
            with meter.layer():
                graph.replay()
        else:
            xs = []
            for u in step.ubatches:
                cap, out = self.pieces[(step.batch, u)]
                ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()] = u
                with set_forward_context(m.md[u], CUDAGraphMode.PIECEWISE), meter.layer():
                    cap.replay()
                xs.append(out)
        torch.cuda.synchronize()
        for u in step.ubatches:
            self.progress.advance(u, step.batch)
        return {"output": torch.stack(xs).cpu(), "leases": self.count(m) - l0,
                "allocations": meter.take()[0]}


def run_serve(model: Model, schedule: tuple[Step, ...], dbo: Any, mrv1: bool = False,
              det: Any = None, phase: Callable[[Any, str], Any] | None = None,
              leases: Callable[[Model], int] | None = None) -> dict[str, Any]:
    """Capture every graph ``schedule`` needs, then serve it (:class:`Server`)."""
    server = Server(model, dbo, mrv1, det, phase, leases)
    server.capture(schedule)
    with measuring(server.meter):
        done = [server.step(i, s) for i, s in enumerate(schedule)]
    return {"outputs": [d["output"] for d in done],
            "steps": [f"{s.graph}{'+dbo' if s.dbo else ''}:{s.batch.tokens}"
                      for s in schedule],
            "leases_per_step": [d["leases"] for d in done],
            "allocations_per_step": [d["allocations"] for d in done],
            "graphs": {"full": len(server.full), "piecewise": len(server.pieces),
                       "pool": "one, shared by every graph"}}
