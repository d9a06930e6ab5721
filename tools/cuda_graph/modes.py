# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the harness runs a model: eager, breakable PIECEWISE, FULL; on a GPU
or under ``simcuda``'s emulated runtime, with micro-batches run as vLLM's
ubatching runs them.

Micro-batches (``dbo``): two threads, each running its micro-batch through
every layer inside vLLM's own ``UBatchContext`` (``make_ubatch_contexts``,
cut verbatim), sharing one compute and one comm stream as vLLM's
``UBatchRunner`` does; they hand over at the MoE all-to-all between layers
(the stand-in calls ``dbo_yield_and_switch_from_compute_to_comm`` /
``dbo_switch_to_compute_sync``, naive DP/EP's pattern). The adversarial
variant (``sim-eager-yield``) also hands over just before each layer's
output projection reads the attention output, so the other micro-batch runs
a whole attention layer in between.

PIECEWISE captures each micro-batch with vLLM's ``BreakableCUDAGraphCapture``
and replays them in turn (the eager break runs its Python at replay); FULL
captures one graph of the whole step (both micro-batch threads inside it, as
``UBatchRunner.begin_capturable_run`` does for capture).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from model import BATCH, NUM_UBATCHES, RATIOS, SLEEP_CYCLES, Meter, Model, measuring

# Layer patterns (compress ratios; 0 and 1 are both SWA-only). "flash" is
# DeepSeek-V4-Flash's 43 layers; "ci" the same kinds in the same order, scaled
# down to seven (two SWA, then C4 / C128 alternating, ending on C4).
PATTERNS: dict[str, tuple[int, ...]] = {
    "default": RATIOS,
    "ci": (0, 0, 4, 128, 4, 128, 4),
}


def pattern(name: str) -> tuple[int, ...]:
    if name == "flash":
        from vllm_dsv4_backend.layer.plan import DSV4_FLASH_HF_CONFIG

        cfg = DSV4_FLASH_HF_CONFIG
        return tuple(cfg["compress_ratios"][: cfg["num_hidden_layers"]])
    if name not in PATTERNS:
        raise SystemExit(f"harness: unknown layer pattern {name!r}; known: "
                         f"{sorted(PATTERNS) + ['flash']}")
    return PATTERNS[name]


def leases_per_ubatch(ratios: tuple[int, ...], indexer: str = "fp8") -> dict[str, int]:
    """The leases one micro-batch takes per forward, from the CUDA lease plan:
    eager every family of every layer; at PIECEWISE replay only the eager
    break's (the C4 decode top-k); FULL replay none (no Python runs)."""
    from vllm_dsv4_backend.formats.constants import layer_kind
    from vllm_dsv4_backend.layer.plan import LEASE_PLAN

    plan = LEASE_PLAN["cuda"][indexer]
    kinds = [layer_kind(r) for r in ratios]
    return {"eager": sum(len(plan[k]) for k in kinds),
            "piecewise": sum("topk" in plan[k] for k in kinds), "full": 0}


def leases(model: Model) -> int:
    return int(model.ws.stats()["leases_total"]) if model.ws is not None else 0


def fences(model: Model) -> dict[str, Any]:
    if model.ws is None:
        return {}
    st = model.ws.stats()
    out = {"fence_waits_total": st.get("fence_waits_total")}
    dropped = getattr(model.ws.backend, "dropped", None)
    if dropped is not None:
        out["fences_dropped"] = dropped
    return out


def run_steps(model: Model, steps: int, meter: Meter,
              step_fn: Callable[[], list[torch.Tensor]], by_op: bool = False
              ) -> dict[str, Any]:
    """Every step: load its inputs, run ``step_fn`` (one forward or the replays;
    it returns the micro-batches' outputs), wait for the device, then record the
    outputs, the workspace leases and ``meter``'s allocations; with ``by_op``
    also step 0's allocations by op."""
    cuda = model.device.type == "cuda"
    outs, nleases, allocs, allocator = [], [], [], []
    by_op0: dict[str, int] = {}
    from vllm import _harness_recording as R

    for step in range(steps):
        model.load_step(step)
        R.CONTEXT["step"] = step
        l0 = leases(model)
        xs = step_fn()
        if cuda or model.sim:
            torch.cuda.synchronize()
        outs.append(torch.stack(xs).cpu())
        nleases.append(leases(model) - l0)
        f, a = meter.take()
        allocs.append(f)
        allocator.append(a)
        if step == 0:
            by_op0 = meter.last_by_op
    R.CONTEXT["step"] = None
    res: dict[str, Any] = {"outputs": outs, "leases_per_step": nleases,
                           "allocations_per_step": allocs,
                           "allocator_requests_per_step": allocator if cuda else None}
    if by_op:
        res["allocations_by_op_step0"] = by_op0
    return res


# --- micro-batches as vLLM's ubatching runs them --------------------------------------------


def moe_exchange(x: torch.Tensor) -> torch.Tensor:
    """The MoE all-to-all between layers (stand-in: a copy on the comm stream),
    where vLLM's micro-batch threads hand over. Its output is allocated on the
    compute stream, where the next layer's streams read it and its block is
    freed (a block allocated on the comm stream and read elsewhere would need
    ``record_stream``: the caching allocator would hand it back to the comm
    stream while those reads may still be pending)."""
    from vllm.v1.worker.ubatching import (
        dbo_switch_to_compute_sync,
        dbo_yield_and_switch_from_compute_to_comm,
    )

    y = torch.empty_like(x)
    dbo_yield_and_switch_from_compute_to_comm()
    y.copy_(x)
    dbo_switch_to_compute_sync()
    return y


class DboRunner:
    """Both micro-batches in vLLM's ``UBatchContext`` threads (see the module
    docstring); ``activate`` enters per-thread context (the emulator's
    dispatch mode, the coverage tracer)."""

    def __init__(self, model: Model, activate: Callable[[], Any] | None = None) -> None:
        self.model = model
        self.comm = torch.cuda.Stream(model.device)
        self.activate = activate or contextlib.nullcontext
        self.order: list[tuple[int, int]] = []  # (micro-batch, layer) as they ran

    def forward(self, mode: Any, meter: Meter | None, compute: Any = None
                ) -> list[torch.Tensor]:
        return self.begin(mode, meter, compute)()

    def begin(self, mode: Any, meter: Meter | None, compute: Any = None
              ) -> Callable[[], list[torch.Tensor]]:
        """Start the threads (parked); the callback runs and joins them."""
        from vllm.forward_context import ForwardContext
        from vllm.v1.worker import ubatching

        m = self.model
        compute = compute if compute is not None else torch.cuda.current_stream()
        barrier = threading.Barrier(NUM_UBATCHES + 1)
        ctxs = ubatching.make_ubatch_contexts(
            num_micro_batches=NUM_UBATCHES, comm_stream=self.comm, compute_stream=compute,
            forward_contexts=[ForwardContext(m.md[u], mode) for u in range(NUM_UBATCHES)],
            ready_barrier=barrier)
        outs: dict[int, torch.Tensor] = {}
        errors: dict[int, BaseException] = {}
        errors_at: list[float] = []

        def run(ctx: Any) -> None:
            try:
                with self.activate(), ctx:
                    x = m.hidden[ctx.id]
                    for i, layer in enumerate(m.layers):
                        self.order.append((ctx.id, i))
                        x = m.layer_in_thread(layer, ctx.id, x, meter)
                        x = moe_exchange(x)
                    outs[ctx.id] = x
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                import traceback

                e.add_note(traceback.format_exc()[-3000:])
                errors[ctx.id] = e
                errors_at.append(time.monotonic())
                ctx.cpu_signal_event.set()  # let the other micro-batch run on

        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in ctxs]
        for t in threads:
            t.start()
        barrier.wait()

        def finish() -> list[torch.Tensor]:
            ctxs[0].cpu_wait_event.set()
            # A micro-batch that raised leaves the other parked at a hand-over that
            # never comes (vLLM's protocol has no abort): report the error, leave
            # the parked daemon thread behind.
            limit = time.monotonic() + float(os.environ.get("HARNESS_UBATCH_TIMEOUT", "300"))
            while any(t.is_alive() for t in threads) and time.monotonic() < limit:
                for t in threads:
                    t.join(timeout=0.2)
                if errors and time.monotonic() > min(errors_at) + 2.0:
                    break
            if any(t.is_alive() for t in threads) and not errors:
                raise RuntimeError("a micro-batch thread hung (a hand-over never came)")
            if errors:
                u = next(iter(errors))  # the first to fail; the other may fail after it
                raise RuntimeError(f"micro-batch {u} failed: {errors[u]!r}\n"
                                   + "\n".join(getattr(errors[u], "__notes__", []))
                                   ) from errors[u]
            return [outs[u] for u in range(NUM_UBATCHES)]

        return finish


# --- modes ----------------------------------------------------------------------------------


def run_eager(model: Model, steps: int, dbo: DboRunner | None = None) -> dict[str, Any]:
    from vllm.config import CUDAGraphMode

    meter = Meter(model.device)
    if dbo is not None:
        def step() -> list[torch.Tensor]:
            return dbo.forward(CUDAGraphMode.NONE, meter)
    else:
        def step() -> list[torch.Tensor]:
            return model.forward_step(CUDAGraphMode.NONE, meter)
    with measuring(meter):
        return run_steps(model, steps, meter, step, by_op=True)


@contextlib.contextmanager
def phase(det: Any, name: str) -> Iterator[None]:
    if det is None:
        yield
        return
    det.phase = name
    try:
        yield
    finally:
        det.phase = "run"


def run_piecewise(model: Model, steps: int, capture_metadata: bool = True,
                  det: Any = None) -> dict[str, Any]:
    """Breakable PIECEWISE: warm-up, capture per micro-batch on a side stream,
    then replay every step. MRV2 captures with real metadata; MRV1
    (``capture_metadata=False``, vLLM 0.33) with ``attn_metadata=None``, the
    wide eager break ``_prepare_and_attn_eager`` then doing the work at replay."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker import ubatching

    snap = model.snapshot()
    model.load_step(0)
    model.forward_step(CUDAGraphMode.NONE)  # warm-up, as vLLM runs forward_fn(NONE) first
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(model.device)
    caps, static = [], []
    side.wait_stream(torch.cuda.current_stream(model.device))
    model.dummy_metadata = not capture_metadata
    try:
        with torch.cuda.stream(side), phase(det, "capture"):
            for u in range(NUM_UBATCHES):
                cap = BreakableCUDAGraphCapture(pool=pool)
                with cap:
                    static.append(model.forward_ubatch(u, CUDAGraphMode.PIECEWISE))
                caps.append(cap)
    finally:
        model.dummy_metadata = False
    torch.cuda.synchronize()
    model.restore(snap)
    torch.cuda.synchronize()
    meter = Meter(model.device)

    def replay() -> list[torch.Tensor]:
        for u in range(NUM_UBATCHES):
            ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()] = u
            with set_forward_context(model.md[u], CUDAGraphMode.PIECEWISE), meter.layer():
                caps[u].replay()
        return static

    with measuring(meter):
        res = run_steps(model, steps, meter, replay)
    return {**res, "graphs": [c.num_graphs for c in caps],
            "eager_breaks": [c.num_eager_breaks for c in caps]}


def run_full(model: Model, steps: int, dbo: DboRunner | None = None,
             det: Any = None) -> dict[str, Any]:
    """MRV2 FULL: one graph of the whole step (both micro-batches, forward-context
    mode FULL: the eager break runs inline and is captured); with ``dbo`` the
    micro-batch threads run inside the capture on its stream."""
    from vllm.config import CUDAGraphMode

    snap = model.snapshot()
    model.load_step(0)
    side = torch.cuda.Stream(model.device)
    side.wait_stream(torch.cuda.current_stream(model.device))
    with torch.cuda.stream(side):
        model.forward_step(CUDAGraphMode.NONE)  # warm-up on a side stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream(model.device)
    if dbo is not None:
        finish = dbo.begin(CUDAGraphMode.FULL, None, compute=cap)  # threads parked outside
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=cap), \
                phase(det, "capture"):
            static = finish()
    else:
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=cap), \
                phase(det, "capture"):
            static = model.forward_step(CUDAGraphMode.FULL)
    torch.cuda.synchronize()
    model.restore(snap)
    torch.cuda.synchronize()
    meter = Meter(model.device)

    def replay() -> list[torch.Tensor]:
        with meter.layer():
            graph.replay()
        return static

    return run_steps(model, steps, meter, replay)


# --- the mode table -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way to run the model.

    ``where``: ``cpu`` (no streams), ``sim`` (``simcuda``: vLLM's streams,
    events and graphs emulated on CPU, the race detector watching) or ``cuda``.
    ``run``: ``eager``, ``piecewise`` or ``full``. ``order``: the emulator's
    execution policy. ``dbo``: micro-batches in vLLM's ``UBatchContext``
    threads (else alternated per layer by the harness). ``stage``: the layer
    indices of a pipeline stage (None: all).
    """

    name: str
    where: str
    run: str = "eager"
    policy: str = "shared"
    order: str = "program"
    dbo: bool = False
    yield_before_o_proj: bool = False
    debug: bool = False
    gemm0: bool = False
    mrv1: bool = False
    cutedsl: bool = False
    slow: bool = False
    stage: tuple[int, ...] | None = None
    layers: str = "default"
    indexer: str = "fp8"
    seeds: int = 1  # emulator orders tried (``random``: one run per seed)
    extended: bool = False  # only when named (--modes) or asked for (--extended)
    # The vLLM minors whose default run includes the mode (--extended: every one). The
    # plugin's code is the same under both; 0.33 keeps the modes its own control flow
    # changes (MRV1, the fork/join, capture and the served schedule) in CI time.
    versions: tuple[str, ...] = ("0.33", "0.34")
    # vLLM's own layer runs the mode too by default (its kernel calls compared, its
    # races counted); False for an order or debug variant of a mode that already
    # compares them: vLLM's layer has no workspace, so its calls are that mode's.
    vllm_layer: bool = True

    def ratios(self, layers: str | None = None) -> tuple[int, ...]:
        r = pattern(layers or self.layers)
        return tuple(r[i] for i in self.stage) if self.stage is not None else r

    def expected_leases(self, kind: str | None = None, ubatches: int = NUM_UBATCHES,
                        layers: str | None = None) -> int:
        return leases_per_ubatch(self.ratios(layers), self.indexer)[kind or self.run] * ubatches


STAGE = (3, 4, 5, 6)
NEWEST = ("0.34",)
MODES = (
    Mode("eager", "cpu"),
    Mode("private", "cpu", policy="private"),
    Mode("mrv1", "cpu", mrv1=True),
    Mode("sim-eager", "sim", dbo=True),
    Mode("sim-eager-lazy", "sim", order="lazy", dbo=True, extended=True),
    Mode("sim-eager-random", "sim", order="random", dbo=True, extended=True),
    Mode("sim-eager-yield", "sim", order="lazy", dbo=True, yield_before_o_proj=True,
         vllm_layer=False),
    Mode("sim-eager-debug", "sim", order="lazy", dbo=True, debug=True, versions=NEWEST,
         vllm_layer=False),
    Mode("sim-eager-cutedsl", "sim", order="lazy", dbo=True, cutedsl=True, versions=NEWEST),
    Mode("sim-private", "sim", policy="private", order="lazy", dbo=True, extended=True),
    # ``off``: every lease a fresh block of the caching-allocator model, the
    # consumer streams declared with record_stream (allocator.py).
    Mode("sim-off", "sim", policy="off", order="lazy", dbo=True, versions=NEWEST),
    Mode("sim-off-random", "sim", policy="off", order="random", dbo=True, extended=True),
    Mode("sim-piecewise", "sim", run="piecewise", order="lazy"),
    Mode("sim-piecewise-debug", "sim", run="piecewise", order="lazy", debug=True,
         versions=NEWEST, vllm_layer=False),
    Mode("sim-piecewise-gemm0", "sim", run="piecewise", order="lazy", gemm0=True,
         versions=NEWEST),
    Mode("sim-piecewise-mrv1", "sim", run="piecewise", order="lazy", mrv1=True,
         extended=True),
    Mode("sim-full", "sim", run="full", order="lazy", dbo=True),
    Mode("sim-stage", "sim", order="lazy", dbo=True, stage=STAGE, versions=NEWEST,
         vllm_layer=False),
    # A served process (serve.py): FULL / PIECEWISE / eager steps and micro-batches
    # on and off interleaved over one workspace and one graph pool.
    Mode("sim-serve", "sim", run="serve", order="lazy", layers="ci"),
    Mode("sim-serve-mxfp4", "sim", run="serve", order="random", layers="ci",
         indexer="mxfp4", versions=NEWEST),
    Mode("sim-serve-random", "sim", run="serve", order="random", layers="ci", seeds=3,
         extended=True),
    Mode("sim-serve-debug", "sim", run="serve", order="lazy", layers="ci", debug=True,
         extended=True),
    Mode("sim-serve-mrv1", "sim", run="serve", order="lazy", layers="ci", mrv1=True),
    Mode("cuda-eager", "cuda", slow=True),
    Mode("cuda-piecewise", "cuda", run="piecewise"),
    Mode("cuda-piecewise-gemm0", "cuda", run="piecewise", gemm0=True),
    Mode("cuda-piecewise-mrv1", "cuda", run="piecewise", mrv1=True),
    Mode("cuda-full", "cuda", run="full"),
    Mode("cuda-serve", "cuda", run="serve", layers="ci"),
    Mode("cuda-serve-mxfp4", "cuda", run="serve", layers="ci", indexer="mxfp4"),
)
MODE_BY_NAME = {m.name: m for m in MODES}


def workspace_namer(ws: Any) -> Callable[[int], str]:
    """Names a byte offset of the workspace storage by its slot."""
    slots = sorted(ws._slots, key=lambda s: s.offset)

    def name(off: int) -> str:
        for s in slots:
            if s.offset <= off < s.offset + s.nbytes:
                return f"workspace {s.family}[{s.index}] ubatch {s.ubatch}"
        return f"workspace +{off}"

    return name


@contextlib.contextmanager
def emulated(order: str, seed: int = 0, coverage: Any = None) -> Iterator[tuple[Any, Any]]:
    """``simcuda`` installed with a race detector (and line coverage) attached."""
    from races import RaceDetector
    from simcuda import SimCuda

    det = RaceDetector()
    rt = SimCuda(order, observer=det, seed=seed)
    with rt.install(), (coverage.tracing() if coverage is not None
                        else contextlib.nullcontext()):
        yield rt, det


def run_mode(mode: Mode, impl: str, seed: int, steps: int, coverage: Any = None,
             fault: Callable[[], Any] | None = None, order_seed: int | None = None,
             layers: str | None = None) -> dict[str, Any]:
    """One mode for one layer class: outputs, counts, fences, and under
    emulation the races and the emulator's launch counts. ``fault``: a
    context manager entered around the run (a negative control);
    ``order_seed``: the emulator's (default ``seed``); ``layers``: a layer
    pattern instead of the mode's (:data:`PATTERNS`, ``flash``)."""
    from controls import env
    from serve import SCHEDULE, SERVE_BATCHES, run_serve
    from vllm import _harness_recording as R
    from vllm import _harness_standins as S
    from vllm import envs as venvs

    threshold = venvs.VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD
    S.SLOW["cycles"] = SLEEP_CYCLES if mode.slow else 0
    S.YIELD_BEFORE_O_PROJ["on"] = mode.yield_before_o_proj
    if mode.gemm0:
        # The input GEMMs stay on the default stream: a C128 compressor captured
        # on it finds its last user (aux0, earlier) outside the segment, the
        # fence GraphSafeCudaStreamBackend must drop (review §2c).
        venvs.VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD = 0
    device = torch.device("cuda" if mode.where == "cuda" else "cpu")
    R.reset()
    sim = (emulated(mode.order, seed if order_seed is None else order_seed, coverage)
           if mode.where == "sim"
           else contextlib.nullcontext((None, None)))
    try:
        with env(VLLM_DSV4_WORKSPACE_DEBUG="1" if mode.debug else None,
                 HARNESS_CUTEDSL="1" if mode.cutedsl else None), sim as (rt, det), \
                (fault() if fault is not None else contextlib.nullcontext()):
            serving = mode.run == "serve"
            m = Model(impl, device, seed, policy=mode.policy,
                      aux_streams=mode.where != "cpu", mrv1=mode.mrv1,
                      sim=mode.where == "sim", layers=mode.stage,
                      ratios=pattern(layers or mode.layers),
                      batches=SERVE_BATCHES if serving else (BATCH,), indexer=mode.indexer)
            if det is not None and m.ws is not None and m.ws.storage is not None:
                det.add_region(m.ws.storage, workspace_namer(m.ws))
                det.watch_leases(m.ws, workspace_namer(m.ws))
            dbo = DboRunner(m, rt.activate if rt is not None else None) if mode.dbo else None
            if mode.run == "eager":
                res = run_eager(m, steps, dbo)
            elif serving:
                res = run_serve(m, SCHEDULE, dbo or DboRunner(m, rt.activate if rt else None),
                                mrv1=mode.mrv1, det=det, phase=phase, leases=leases)
                res["leases_expected_per_step"] = [
                    mode.expected_leases(s.graph, len(s.ubatches), layers) for s in SCHEDULE]
            elif mode.run == "piecewise":
                res = run_piecewise(m, steps, capture_metadata=not mode.mrv1, det=det)
            else:
                res = run_full(m, steps, dbo, det=det)
            if dbo is not None:
                switches = sum(a[0] != b[0] for a, b in zip(dbo.order, dbo.order[1:]))
                res["micro_batches"] = {"threads": "vLLM UBatchContext", "hand_overs": switches,
                                        "first_layers_run": dbo.order[:6],
                                        "interleaved": switches >= len(m.layers)}
            if rt is not None:
                res["emulator"] = {"order": mode.order, "launches": rt.launches,
                                   "captured_launches": rt.captured_launches,
                                   "replayed_launches": rt.replayed_launches,
                                   "host_syncs": rt.host_syncs,
                                   "allocator": (dict(rt.alloc.counts) if rt.alloc is not None
                                                 else None)}
                res["races"] = det.summary()
            if m.ws is not None:
                res["workspace_layers"] = list(m.ws.layers)
                res["first_layer"] = m.ws.first_layer
                # Model steps the live counters marked (at the first layer, micro-batch 0).
                res["model_steps_counted"] = m.ws.live_stats()["steps"]
    finally:
        S.SLOW["cycles"] = 0
        S.YIELD_BEFORE_O_PROJ["on"] = False
        venvs.VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD = threshold
    res.update(fences(m))
    # vLLM's kernel objects as this run called them (recording.py).
    res["kernel_calls"] = R.take()
    return res
