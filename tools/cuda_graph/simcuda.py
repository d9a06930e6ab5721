# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An emulated CUDA runtime on CPU tensors: streams, events, graphs.

``SimCuda.install()`` replaces the ``torch.cuda`` names vLLM's cut bodies,
the plugin's ``GraphSafeCudaStreamBackend`` and the harness call
(``Stream``, ``Event``, ``current_stream``, ``stream``, ``set_stream``,
``synchronize``, ``CUDAGraph``, ``graph``, ``graph_pool_handle``,
``is_current_stream_capturing``, ``_sleep``; and ``torch.Event`` for vLLM's
ubatching) and activates a ``TorchDispatchMode`` that turns every aten op
into a *launch* on the calling thread's current stream. So vLLM's own
fork / join / parallel-branch / ``add_eager`` / capture code runs on CPU
exactly as it is written for a GPU.

CUDA's semantics, kept here:

* a stream is a FIFO queue; ``record(event, s)`` marks the tail of ``s``;
  ``s2.wait_event(event)`` orders everything enqueued on ``s2`` afterwards
  after the latest record *at the time of the call* (a never-recorded event
  is a no-op); nothing else orders two streams;
* graphs (capture, replay): :mod:`replay`.

Execution policy (``policy``): ``"program"`` runs each launch as it is
enqueued (a legal order: the order the host issued it); ``"lazy"`` runs
work on every stream, the default one included, only when something must
wait for it (an event wait that names it, a synchronisation, a host read),
which is the latest order CUDA allows and turns a missing fence into wrong
bits in either direction (a default-stream read overtaken by an unfenced
side-stream write, or the reverse); ``"random"`` drains random prefixes of
every stream at each launch (``seed``). A host read that bypasses the
dispatcher (``Tensor.tolist`` / ``numpy``) synchronises first, as a device
tensor's copy to the host does. Every launch, record
and wait is also reported to ``observer`` (the race detector) in issue
order, with the stream it was enqueued on, the way CUDA's sanitizer sees a
GPU trace.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from allocator import CachingAllocator, materialize, patched_record_stream
from replay import GraphRuntime, SimCudaError, SimGraph
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["SimCuda", "SimCudaError", "SimEvent", "SimGraph", "SimStream"]

# Ops that read device memory on the host: a synchronisation (illegal in a capture).
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "item",
                           "_assert_async", "masked_select", "unique", "_unique2"})
# Allocations without a kernel (the detector's NO_KERNEL).
_NO_KERNEL_FACTORIES = frozenset({"empty", "empty_strided", "empty_like", "new_empty",
                                  "new_empty_strided"})


class _Token:
    """One event record: a point in one stream's queue."""

    __slots__ = ("id", "stream", "done", "graph")
    _ids = itertools.count(1)

    def __init__(self, stream: SimStream, graph: SimGraph | None) -> None:
        self.id = next(self._ids)
        self.stream = stream
        self.done = False
        self.graph = graph


class SimStream:
    """A stream: a FIFO of pending launches, records and waits."""

    def __init__(self, rt: SimCuda, name: str) -> None:
        self.rt = rt
        self.name = name
        self.cuda_stream = next(rt._stream_ids)
        self.device_index = 0
        self.device = torch.device("cuda", 0)
        self.priority = 0
        self.queue: deque[tuple[str, Any]] = deque()
        rt.streams.append(self)
        rt._observe("stream_created", self)

    def wait_event(self, event: SimEvent) -> None:
        event.wait(self)

    def wait_stream(self, stream: SimStream) -> None:
        ev = SimEvent()
        ev.record(stream)
        ev.wait(self)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else SimEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.rt.sync_stream(self)

    def query(self) -> bool:
        return not self.queue

    def __enter__(self) -> SimStream:
        self._ctx = self.rt.stream_ctx(self)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self) -> int:
        return hash(("SimStream", self.cuda_stream))

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


class SimEvent:
    """``torch.cuda.Event`` / ``torch.Event``: ordering only (no timing)."""

    rt: SimCuda | None = None  # set by install()

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **_: Any) -> None:
        self.token: _Token | None = None

    def record(self, stream: SimStream | None = None) -> None:
        rt = SimEvent.rt
        assert rt is not None, "SimEvent outside SimCuda.install()"
        self.token = rt.enqueue_record(stream if stream is not None else rt.current_stream())

    def wait(self, stream: SimStream | None = None) -> None:
        rt = SimEvent.rt
        assert rt is not None, "SimEvent outside SimCuda.install()"
        if self.token is not None:  # CUDA: waiting on a never-recorded event is a no-op
            rt.enqueue_wait(stream if stream is not None else rt.current_stream(), self.token)

    def synchronize(self) -> None:
        if self.token is not None and SimEvent.rt is not None:
            SimEvent.rt.drain_to(self.token)

    def query(self) -> bool:
        return self.token is None or self.token.done

    def elapsed_time(self, other: SimEvent) -> float:
        return 0.0


class _Launch:
    """One aten op as a kernel: ``func(*args)`` into ``outputs`` (or in place)."""

    __slots__ = ("func", "args", "kwargs", "outputs", "inplace")

    def __init__(self, func: Any, args: Any, kwargs: Any, outputs: Any, inplace: bool) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outputs, self.inplace = outputs, inplace

    def run(self) -> None:
        with _disable_current_modes():
            args, kwargs = tree_map(materialize, self.args), tree_map(materialize, self.kwargs)
            res = self.func(*args, **kwargs)
            if not self.inplace:
                outputs = tree_map(materialize, self.outputs)
                for dst, src in zip(tree_flatten(outputs)[0], tree_flatten(res)[0]):
                    if isinstance(dst, torch.Tensor) and dst is not src:
                        dst.copy_(src)

    def __repr__(self) -> str:
        return f"launch({self.func})"


class _Mode(TorchDispatchMode):
    def __init__(self, rt: SimCuda) -> None:
        super().__init__()
        self.rt = rt

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return self.rt.launch(func, args, kwargs or {})


def _is_view(schema: Any) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _writes(schema: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _draws(schema: Any) -> bool:
    return any("Generator" in str(a.type) for a in schema.arguments)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _placeholder(m: Any) -> Any:
    if not isinstance(m, torch.Tensor):
        return m
    with _disable_current_modes():
        t = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device="cpu")
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.zero_()
    return t


class SimCuda(GraphRuntime):
    """The emulated runtime (see the module docstring).

    Args:
        policy: ``"program"``, ``"lazy"`` or ``"random"``.
        observer: receives ``(event, *args)`` for stream creation, records,
            waits, launches and synchronisations (the race detector).
        seed: for ``"random"``.
    """

    def __init__(self, policy: str = "program", observer: Callable[..., None] | None = None,
                 seed: int = 0, allocator: bool = True) -> None:
        if policy not in ("program", "lazy", "random"):
            raise ValueError(f"policy: expected program, lazy or random, got {policy!r}")
        self.policy = policy
        self.observer = observer
        self.rng = random.Random(seed)
        self._stream_ids = itertools.count(1)
        self.streams: list[SimStream] = []
        self._tls = threading.local()
        self.default = SimStream(self, "default")
        self._capture: dict[int, SimGraph] = {}  # stream id -> graph capturing on it
        self.launches = 0
        self.captured_launches = 0
        self.replayed_launches = 0
        self.host_syncs = 0
        self._pool_ids = itertools.count()
        self.graphs: list[SimGraph] = []  # captured here (emptied at uninstall)
        # allocator.py: PyTorch's caching allocator and graph pools (None: every
        # result from the CPU allocator, kept alive until a synchronisation).
        self.alloc = CachingAllocator(self) if allocator else None
        self._unpooled: list[Any] = []  # results made outside the model: never freed
        if self.alloc is not None:
            self._observe("allocator", self.alloc)

    # --- streams ---------------------------------------------------------------------

    def _observe(self, event: str, *args: Any) -> None:
        if self.observer is not None:
            self.observer(event, *args)

    def current_stream(self, device: Any = None) -> SimStream:
        return getattr(self._tls, "stream", None) or self.default

    def set_stream(self, stream: SimStream | None) -> None:
        self._tls.stream = stream

    @contextlib.contextmanager
    def stream_ctx(self, stream: SimStream | None) -> Iterator[SimStream | None]:
        if stream is None:
            yield None
            return
        prev = getattr(self._tls, "stream", None)
        self._tls.stream = stream
        try:
            yield stream
        finally:
            self._tls.stream = prev

    def _stream_class(self) -> type:
        """``torch.cuda.Stream``: a class (vLLM's annotations write ``Stream | None``)."""
        rt = self

        class Stream(SimStream):
            def __new__(cls, device: Any = None, priority: int = 0, **_: Any) -> SimStream:
                return rt.new_stream()

        return Stream

    def new_stream(self, name: str | None = None) -> SimStream:
        return SimStream(self, name or f"s{len(self.streams)}")

    def capture_pool(self, stream: SimStream) -> Any:
        """The graph pool an allocation on ``stream`` comes from (None: none)."""
        graph = self._capture.get(stream.cuda_stream)
        return graph.pool_id if graph is not None else None

    def new_pool(self) -> Any:
        return ("pool", next(self._pool_ids))

    def capturing(self, stream: SimStream | None = None) -> bool:
        s = stream if stream is not None else self.current_stream()
        return s.cuda_stream in self._capture

    # --- enqueue ---------------------------------------------------------------------

    def enqueue_record(self, stream: SimStream) -> _Token:
        graph = self._capture.get(stream.cuda_stream)
        tok = _Token(stream, graph)
        if graph is None:  # captured work is observed when it is replayed
            self._observe("record", tok.id, stream)
        if graph is not None:
            graph.entries.append((stream, "rec", tok))
        else:
            stream.queue.append(("rec", tok))
            self._settle(stream)
        return tok

    def enqueue_wait(self, stream: SimStream, tok: _Token) -> None:
        graph = self._capture.get(stream.cuda_stream)
        if tok.graph is not None and graph is None:
            if tok.graph.origin is not None and tok.graph in self._capture.values():
                # The fork into a capture: the waiting stream joins it.
                graph = tok.graph
                self._capture[stream.cuda_stream] = graph
                graph.streams.append(stream)
            else:
                raise SimCudaError(f"{stream.name} waits on an event recorded in a finished "
                                   "capture outside any capture")
        elif graph is not None and tok.graph is not graph:
            raise SimCudaError(
                f"captured wait on {stream.name} for an event recorded outside the capture "
                f"(on {tok.stream.name}): CUDA refuses a cross-capture dependency")
        if graph is not None:
            graph.entries.append((stream, "wait", tok))
            return
        self._observe("wait", tok.id, stream)
        stream.queue.append(("wait", tok))
        self._settle(stream)

    def launch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """One aten op issued on the current stream (the dispatch mode's body)."""
        stream = self.current_stream()
        schema = func._schema
        name = func.overloadpacket.__name__
        if func is torch.ops.aten.record_stream.default:
            return None
        graph = self._capture.get(stream.cuda_stream)
        if name in HOST_SYNC_OPS:
            if graph is not None:
                raise SimCudaError(f"host sync ({name}) on {stream.name} while it captures")
            self.host_syncs += 1
            self._observe("sync_stream", stream)
            self.drain_all()
            with _disable_current_modes():
                out = func(*args, **kwargs)
            self._unpooled.append(out)
            self._observe("launch", stream, func, args, kwargs, out)
            return out
        if _is_view(schema):  # metadata only: no kernel
            with _disable_current_modes():
                return func(*args, **kwargs)
        inplace = _writes(schema)
        base = name.rstrip("_")
        defer = graph is not None or self.policy != "program"
        if graph is None and _draws(schema):
            # A random op draws from its generator when it runs, and computing its
            # meta shape draws too: run it now, in order, so the draws match.
            self.drain_all()
            defer = False
        if inplace:
            outputs = self._inplace_result(schema, args, kwargs)
            if outputs is None:
                raise SimCudaError(f"{name}: cannot tell what the in-place op returns")
        elif self.alloc is not None and not (not defer and _draws(schema)):
            # Every allocation from the caching-allocator model: the op's result
            # goes into a block of this stream (or of the capture's pool).
            try:
                meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            except Exception:  # noqa: BLE001 - no meta kernel: run it now (a legal order)
                if graph is not None:
                    raise
                return self._run_now(stream, func, args, kwargs)
            outputs = tree_map(lambda m: self._block_tensor(m, stream), meta)
            if base in _NO_KERNEL_FACTORIES:
                self._observe("launch", stream, func, args, kwargs, outputs)
                return outputs
        elif not defer or base in _NO_KERNEL_FACTORIES:
            with _disable_current_modes():
                outputs = func(*args, **kwargs)
            if self.alloc is not None:
                outputs = self._into_blocks(outputs, stream)
            if base in _NO_KERNEL_FACTORIES:
                self._observe("launch", stream, func, args, kwargs, outputs)
                return outputs
            if self.alloc is None or _draws(schema):
                self._observe("launch", stream, func, args, kwargs, outputs)
                self.launches += 1
                return outputs  # ran above, in issue order
        else:
            try:
                meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
                outputs = tree_map(_placeholder, meta)
            except Exception:  # noqa: BLE001 - no meta kernel: run it now (a legal order)
                if graph is not None:
                    raise
                return self._run_now(stream, func, args, kwargs)
        if self.alloc is not None:
            # As on a GPU, a queued kernel does not keep its tensors allocated.
            ref = self.alloc.ref
            job = _Launch(func, tree_map(ref, args), tree_map(ref, kwargs),
                          tree_map(ref, outputs), inplace)
        else:
            job = _Launch(func, args, kwargs, outputs, inplace)
        if graph is not None:
            graph.entries.append((stream, "op", job))
            self.captured_launches += 1
            self._observe("captured_launch", stream, func, args, kwargs, outputs)
            return outputs
        self._observe("launch", stream, func, args, kwargs, outputs)
        self.launches += 1
        stream.queue.append(("op", job))
        if defer:
            self._settle(stream)
        else:
            self._drain(stream)
        return outputs

    def _run_now(self, stream: SimStream, func: Any, args: tuple, kwargs: dict) -> Any:
        self.drain_all()
        with _disable_current_modes():
            outputs = func(*args, **kwargs)
        if self.alloc is not None:
            outputs = self._into_blocks(outputs, stream)
        self._observe("launch", stream, func, args, kwargs, outputs)
        return outputs

    def _block_tensor(self, meta: Any, stream: SimStream) -> Any:
        if not isinstance(meta, torch.Tensor):
            return meta
        assert self.alloc is not None
        with _disable_current_modes():
            t = self.alloc.empty(meta, stream)
            if self.alloc.counts["fresh"] and t.numel() and self._fresh_block(t):
                # A fresh block holds no value yet: NaN (0 for integers) shows a read
                # before any write. A reused block keeps its bytes, as on a GPU.
                t.fill_(float("nan")) if t.is_floating_point() else t.zero_()
        return t

    def _fresh_block(self, t: torch.Tensor) -> bool:
        assert self.alloc is not None
        return self.alloc.last_fresh == t.untyped_storage().data_ptr()

    def _into_blocks(self, outputs: Any, stream: SimStream) -> Any:
        """Results computed now by the CPU allocator, copied into blocks."""

        def move(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            t = self._block_tensor(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                       device="meta"), stream)
            with _disable_current_modes():
                t.copy_(x)
            return t

        return tree_map(move, outputs)

    @staticmethod
    def _inplace_result(schema: Any, args: tuple, kwargs: dict) -> Any:
        """What an in-place / ``out=`` op returns: its written arguments."""
        written = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                written.append(v)
        if not schema.returns:
            return ()
        if len(schema.returns) == 1:
            return written[0] if len(written) == 1 else written[-1] if written else None
        return tuple(written) if len(written) == len(schema.returns) else None

    # --- execution -------------------------------------------------------------------

    def _settle(self, stream: SimStream) -> None:
        """Run what the policy runs now (after an enqueue on ``stream``)."""
        if self.policy == "program":
            self._drain(stream)
        if self.policy == "random":
            for s in list(self.streams):
                if s.queue and self.rng.random() < 0.3:
                    self._drain(s, limit=self.rng.randint(1, 8))

    def _drain(self, stream: SimStream, limit: int | None = None,
               upto: _Token | None = None) -> None:
        q = stream.queue
        n = 0
        while q and (limit is None or n < limit):
            kind, item = q[0]
            if kind == "wait":
                if not item.done:
                    self._drain(item.stream, upto=item)
                    if not item.done:
                        raise SimCudaError(f"{stream.name} waits on a record that never runs")
            elif kind == "rec":
                item.done = True
            else:
                item.run()
            q.popleft()
            n += 1
            if upto is not None and kind == "rec" and item is upto:
                return

    def drain_to(self, tok: _Token) -> None:
        if not tok.done:
            self._drain(tok.stream, upto=tok)

    def drain_all(self) -> None:
        for _ in range(len(self.streams) + 1):
            for s in list(self.streams):
                if s.queue:
                    self._drain(s)
            if not any(s.queue for s in self.streams):
                return

    def sync_stream(self, stream: SimStream) -> None:
        self._drain(stream)
        self._observe("sync_stream", stream)

    def synchronize(self, device: Any = None) -> None:
        if self._capture:
            raise SimCudaError("synchronize() while a stream captures")
        self.drain_all()
        self._observe("sync_all")

    # --- graphs ----------------------------------------------------------------------

    @contextlib.contextmanager
    def install(self) -> Iterator[SimCuda]:
        """Patch ``torch.cuda`` / ``torch.Event`` and dispatch every op here (this
        thread; other threads call :meth:`activate`)."""
        cuda = torch.cuda
        names = {
            "Stream": self._stream_class(),
            "Event": SimEvent,
            "current_stream": self.current_stream,
            "default_stream": lambda device=None: self.default,
            "set_stream": self.set_stream,
            "stream": self.stream_ctx,
            "synchronize": self.synchronize,
            "CUDAGraph": SimGraph,
            "graph": self.graph_ctx,
            "graph_pool_handle": self.new_pool,
            "is_current_stream_capturing": lambda: self.capturing(),
            "_sleep": lambda cycles: None,
            "current_device": lambda: 0,
        }
        saved = {k: cuda.__dict__.get(k, _MISSING) for k in names}
        saved_event = torch.Event
        host_reads = {k: getattr(torch.Tensor, k) for k in ("tolist", "numpy")}
        for k, f in host_reads.items():
            setattr(torch.Tensor, k, self._host_read(f))
        saved_record = torch.Tensor.record_stream
        torch.Tensor.record_stream = patched_record_stream(  # type: ignore[method-assign]
            lambda: self.alloc, saved_record)
        SimEvent.rt = SimGraph.rt = self
        for k, v in names.items():
            setattr(cuda, k, v)
        torch.Event = SimEvent  # type: ignore[misc, assignment]
        try:
            with self.activate():
                yield self
            if not self._capture:
                self.drain_all()
        finally:
            for k, v in saved.items():
                if v is _MISSING:
                    delattr(cuda, k)
                else:
                    setattr(cuda, k, v)
            torch.Event = saved_event  # type: ignore[misc]
            for k, f in host_reads.items():
                setattr(torch.Tensor, k, f)
            torch.Tensor.record_stream = saved_record  # type: ignore[method-assign]
            if self.alloc is not None:
                self.alloc.close()
            for g in self.graphs:  # nothing replays after the runtime is gone
                g.reset()
            self.graphs.clear()
            SimEvent.rt = SimGraph.rt = None

    def _host_read(self, read: Callable[..., Any]) -> Callable[..., Any]:
        """``Tensor.tolist`` / ``numpy`` read memory without the dispatcher: on a
        GPU the copy to the host synchronises; here it drains every stream."""
        rt = self

        def host_read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if rt._capture and rt.capturing():
                raise SimCudaError("host read of a tensor while the stream captures")
            rt.host_syncs += 1
            rt.drain_all()
            rt._observe("sync_all")
            return read(t, *args, **kwargs)

        return host_read

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """This thread's aten ops become launches (dispatch modes are per thread)."""
        with _Mode(self):
            yield


_MISSING = object()
