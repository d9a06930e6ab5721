# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-V4 stream fan-out through the workspace, for race tests (torch only).

``enqueue_dsv4_step`` issues, in CPU program order, what one model step does
with the workspace: for every layer and micro-batch, leases on the streams
DeepSeek-V4 uses, producer kernels that write a unique *stamp* into every
leased view, and consumer kernels that check the stamp (before and after an
optional delay, so a producer that overwrites while a consumer is still
reading is caught). It runs unchanged on ``SimStreamBackend`` (queued, then
executed in random legal orders) and on ``CudaStreamBackend`` (real streams;
the delay is ``torch.cuda._sleep``).

Stream roles per micro-batch (``default``, ``aux0``, ``aux1``):

* ``wide`` (MRV1's wide eager region, the one #49236 served): default: q/KV
  insert produces ``q``, attention consumes ``q`` and ``topk``; aux0: the
  indexer produces ``indexer_q``, consumes it (logits) and produces ``topk``;
  aux1: the compressor produces and consumes ``scratch``.
* ``narrow`` (#51430): aux0 produces ``indexer_q``; the default stream
  consumes it (indexer op) and produces and consumes ``topk``.
* ``random``: every family gets a random producer stream and 1-3 random
  consumer streams per layer; all families are live at once.

The only cross-stream dependencies the program records itself are data
dependencies inside a layer (a consumer waits for its producer). DeepSeek-V4's
own fork/join events (``maybe_execute_in_parallel``) are left out on purpose:
#52836 showed that safety resting on them breaks under reordering, skipped
joins and DBO. Reuse of memory across layers, steps and families must be made
safe by the manager alone.

Test support only (the serving code never imports it); it lived in
``workspace/schedule.py``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_dsv4_backend.workspace.manager import Lease, WorkspaceManager
from vllm_dsv4_backend.workspace.streams import StreamBackend

VARIANTS: tuple[str, ...] = ("wide", "narrow", "random")
STREAM_ROLES: tuple[str, ...] = ("default", "aux0", "aux1")

# The schedule's lease plan (for ``layer.plan.build_workspace_config(plan=...)``):
# every family each layer kind uses in vLLM's wide eager region (MRV1, the
# region #49236 served), C4's compressor scratch included (one of the ways
# the pool broke), and the attention output as the q family.
WIDE_PLAN: dict[str, dict[str, tuple[str, ...]]] = {
    "swa": {"q": ("out",)},
    "c4": {"q": ("out",), "indexer_q": ("q", "scales", "weights"),
           "topk": ("local", "global", "lens"), "compressor": ("scratch",)},
    "c128": {"q": ("out",), "compressor": ("scratch",)},
}


def as_int32_words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view's bytes as a flat int32 tensor.

    Needs a byte size divisible by 4, true of every DeepSeek-V4 view (MXFP4
    scales are ``Di/32`` = 4 bytes per head at ``Di`` = 128).
    """
    b = t.reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        raise ValueError(f"t: expected a byte size divisible by 4, got {b.numel()} ({t.shape})")
    return b.view(torch.int32)


class StampKernels:
    """Producer/consumer kernels writing and checking stamps in leased views.

    ``produce`` enqueues, on the given stream, a fill of every view's bytes
    (as int32 words) with the stamp. ``consume`` enqueues a check that every
    word equals the stamp, an optional ``torch.cuda._sleep(sleep_cycles)``,
    and the same check again; each check counts its wrong words (read with
    ``mismatches()`` once the work ran). ``reset()`` zeroes the counts before
    a program is executed again.

    With ``use_numpy`` (default on CPU) the kernels touch the leased memory
    through NumPy views of the same bytes (a few times faster than tiny torch
    ops, which lets the simulation run hundreds of schedules); otherwise they
    are torch kernels whose counts live in 0-dim int64 tensors on ``device``,
    allocated on the consumer's stream.
    """

    def __init__(self, backend: StreamBackend, device: torch.device | str = "cpu",
                 sleep_cycles: int = 0, use_numpy: bool | None = None) -> None:
        self.backend = backend
        self.device = torch.device(device)
        self.sleep_cycles = sleep_cycles
        if use_numpy is None:
            use_numpy = self.device.type == "cpu"
        if use_numpy and self.device.type != "cpu":
            raise ValueError(f"use_numpy: needs a CPU device, got {self.device}")
        self._cpu = use_numpy
        self._tags: list[str] = []
        self._counts: list[Any] = []  # int (CPU) or 0-dim int64 tensor
        self.num_produced = 0

    def _words(self, lease: Lease) -> list[Any]:
        words = [as_int32_words(v) for v in lease.views.values()]
        return [w.numpy() for w in words] if self._cpu else words

    def produce(self, stream: Any, lease: Lease, stamp: int) -> None:
        words = self._words(lease)
        if self._cpu:

            def run() -> None:
                for w in words:
                    w.fill(stamp)

        else:

            def run() -> None:
                for w in words:
                    w.fill_(stamp)

        self.backend.launch(stream, run)
        self.num_produced += 1

    def consume(self, stream: Any, lease: Lease, stamp: int, tag: str) -> None:
        # Two queued operations, start and end of the read, so on simulated
        # streams other streams can run in between, as a slow kernel allows.
        words = self._words(lease)
        self._tags += [tag + " (start)", tag + " (end)"]
        if self._cpu:
            import numpy as np

            counts = self._counts
            i = len(counts)
            counts += [0, 0]

            def check(j: int) -> None:
                for w in words:
                    counts[j] += int(np.count_nonzero(w != stamp))

            self.backend.launch(stream, lambda: check(i))
            self.backend.launch(stream, lambda: check(i + 1))
        else:
            # Zeroed on the consumer's stream, so the zeroing is ordered before
            # the checks without tying that stream to any other.
            cnt: list[torch.Tensor] = []
            self.backend.launch(stream, lambda: cnt.extend(
                torch.zeros((), dtype=torch.int64, device=self.device) for _ in range(2)
            ))
            if not cnt:
                raise RuntimeError("StampKernels with use_numpy=False needs a backend "
                                   "that launches immediately (CUDA or no streams)")
            before, after = cnt
            self._counts += [before, after]
            sleep = self.sleep_cycles

            def start() -> None:
                for w in words:
                    before.add_(torch.ne(w, stamp).sum())

            def end() -> None:
                if sleep:
                    torch.cuda._sleep(sleep)
                for w in words:
                    after.add_(torch.ne(w, stamp).sum())

            self.backend.launch(stream, start)
            self.backend.launch(stream, end)

    def reset(self) -> None:
        for j, c in enumerate(self._counts):
            if self._cpu:
                self._counts[j] = 0
            else:
                c.zero_()

    def mismatches(self) -> list[tuple[str, int]]:
        """``(tag, wrong words)`` for every check that saw a wrong stamp.

        On CUDA this synchronizes the device first (the checks ran on other
        streams than the one ``.item()`` would use).
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return [(t, int(c)) for t, c in zip(self._tags, self._counts) if int(c)]


class _StampSource:
    def __init__(self, start: int = 1) -> None:
        self.next = start

    def __call__(self) -> int:
        # Positive, so never a poison word (-1, -2**31) or a zeroed buffer.
        s = self.next
        self.next = s + 1 if s < 2**31 - 1 else 1
        return s


def make_stamp_source(start: int = 1) -> _StampSource:
    """Unique int32 stamps, one per producer."""
    return _StampSource(start)


def _dep(backend: StreamBackend, producer: Any, consumer: Any) -> None:
    """The data dependency consumer-after-producer, if on different streams."""
    if backend.stream_key(producer) != backend.stream_key(consumer):
        ev = backend.new_event()
        backend.record(ev, producer)
        backend.wait(consumer, ev)


@dataclass(frozen=True)
class _LayerStep:
    """One layer's part of a step for one micro-batch: what both schedules need."""

    mgr: WorkspaceManager
    k: StampKernels
    layer: str
    ubatch: int
    num_tokens: int
    s: Mapping[str, Any]
    stamps: _StampSource
    tag: str

    def lease(self, family: str, stream: Any) -> Lease:
        return self.mgr.lease(self.layer, family, self.num_tokens, self.ubatch, stream=stream)


def _layer_fixed(c: _LayerStep, variant: str) -> None:
    be, k, stamps, tag = c.mgr.backend, c.k, c.stamps, c.tag
    fams = c.mgr.layer_families(c.layer)
    d, a0, a1 = c.s["default"], c.s["aux0"], c.s["aux1"]
    q = c.lease("q", d)
    sq = stamps()
    k.produce(d, q, sq)  # fused qnorm/rope/KV insert writes padded q
    if "compressor" in fams:
        cl = c.lease("compressor", a1)
        sc = stamps()
        k.produce(a1, cl, sc)
        k.consume(a1, cl, sc, f"{tag} compressor")
        cl.release()
    tk: Lease | None = None
    stk = 0
    if "indexer_q" in fams:
        iq = c.lease("indexer_q", a0)
        siq = stamps()
        k.produce(a0, iq, siq)  # fused indexer q rope + quant
        if variant == "wide":
            k.consume(a0, iq, siq, f"{tag} indexer_q")  # logits on aux0
            tk = c.lease("topk", a0)
            stk = stamps()
            k.produce(a0, tk, stk)  # top-k on aux0
            iq.release()
            _dep(be, a0, d)
            tk.used_on(d)
        else:
            _dep(be, a0, d)
            iq.used_on(d)
            k.consume(d, iq, siq, f"{tag} indexer_q")  # indexer op on default
            tk = c.lease("topk", d)
            stk = stamps()
            k.produce(d, tk, stk)
            iq.release()
    if tk is not None:
        k.consume(d, tk, stk, f"{tag} topk")  # local->global + attention
    k.consume(d, q, sq, f"{tag} q")  # sparse MLA reads padded q
    if tk is not None:
        tk.release()
    q.release()


def _layer_random(c: _LayerStep, rng: random.Random) -> None:
    streams = [c.s[r] for r in STREAM_ROLES]
    fams = list(c.mgr.layer_families(c.layer))
    rng.shuffle(fams)
    live: list[tuple[str, Lease, Any, int]] = []
    for f in fams:
        p = rng.choice(streams)
        ls = c.lease(f, p)
        st = c.stamps()
        c.k.produce(p, ls, st)
        live.append((f, ls, p, st))
    rng.shuffle(live)
    for f, ls, p, st in live:
        for consumer in rng.sample(streams, rng.randint(1, len(streams))):
            _dep(c.mgr.backend, p, consumer)
            ls.used_on(consumer)
            c.k.consume(consumer, ls, st, f"{c.tag} {f}")
    rng.shuffle(live)
    for _, ls, _, _ in live:
        ls.release()


def enqueue_dsv4_step(
    mgr: WorkspaceManager,
    kernels: StampKernels,
    streams: Sequence[Mapping[str, Any]],
    num_tokens: Sequence[int],
    *,
    variant: str = "wide",
    rng: random.Random | None = None,
    stamps: _StampSource | None = None,
    step: int = 0,
) -> None:
    """Issue one model step through ``mgr`` (see module docstring).

    ``streams[u]`` maps ``default``/``aux0``/``aux1`` to micro-batch ``u``'s
    streams; ``num_tokens[u]`` is its token count. Micro-batches alternate
    layer by layer, in a random order per layer when ``rng`` is given (DBO
    switches threads at yield points inside the layer stack).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    if len(streams) != len(num_tokens):
        raise ValueError(
            f"num_tokens: expected one entry per micro-batch ({len(streams)}), "
            f"got {len(num_tokens)}"
        )
    if variant == "random" and rng is None:
        raise ValueError("rng: the 'random' variant needs an rng")
    stamps = stamps or make_stamp_source()
    order = list(range(len(streams)))
    for layer in mgr.layers:
        if rng is not None:
            rng.shuffle(order)
        for u in order:
            c = _LayerStep(mgr, kernels, layer, u, num_tokens[u], streams[u], stamps,
                           f"step {step} ubatch {u} {layer}")
            if variant == "random":
                assert rng is not None
                _layer_random(c, rng)
            else:
                _layer_fixed(c, variant)
