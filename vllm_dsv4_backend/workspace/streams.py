# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stream/event backends for the workspace manager (torch only).

The manager's sharing proof is written against the small ``StreamBackend``
protocol so the same manager code runs on real CUDA streams
(``CudaStreamBackend``), on a stream-less CPU (``NullStreamBackend``) and on
simulated streams (``SimStreamBackend``) whose queued operations a test can
execute in any order the recorded dependencies allow.

Semantics (CUDA's): work enqueued on one stream runs in enqueue order;
``record(event, s)`` marks the point in ``s`` reached so far; ``wait(s2,
event)`` makes everything enqueued on ``s2`` afterwards wait for the most
recent record of ``event`` *at the time of the call* (never-recorded events
are no-ops); nothing else orders two streams.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class StreamBackend(Protocol):
    """What the manager needs from a device's streams."""

    def current_stream(self) -> Any:
        """The stream work is enqueued on right now."""
        ...

    def stream_key(self, stream: Any) -> Hashable:
        """A hashable identity: equal keys mean the same FIFO queue."""
        ...

    def new_event(self) -> Any:
        """A reusable event object (recording it again moves it)."""
        ...

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` at the current tail of ``stream``."""
        ...

    def wait(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event``'s latest record."""
        ...

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        """Enqueue the torch work ``fn`` issues onto ``stream``."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator ``stream`` uses ``tensor`` (``off`` policy)."""
        ...


class NullStreamBackend:
    """A device without streams (CPU): one implicit queue, work runs inline."""

    STREAM = "cpu"

    def current_stream(self) -> Any:
        return self.STREAM

    def stream_key(self, stream: Any) -> Hashable:
        return stream

    def new_event(self) -> Any:
        return None

    def record(self, event: Any, stream: Any) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        return None


class CudaStreamBackend:
    """Real CUDA streams and events on ``device``."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device: expected a CUDA device, got {self.device}")

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def stream_key(self, stream: Any) -> Hashable:
        return (stream.device_index, stream.cuda_stream)

    def new_event(self) -> Any:
        # No timing: cheaper to record, and the only use is ordering.
        return torch.cuda.Event(enable_timing=False)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


def default_backend(device: torch.device | str) -> StreamBackend:
    """``CudaStreamBackend`` for CUDA devices, ``NullStreamBackend`` otherwise."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaStreamBackend(dev)
    return NullStreamBackend()


# --- simulated streams --------------------------------------------------------------

_KERNEL, _RECORD, _WAIT = 0, 1, 2


class SimStream:
    """A simulated stream: a FIFO list of queued operations."""

    __slots__ = ("name", "ops")

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[tuple[int, Any]] = []

    def __repr__(self) -> str:
        return f"SimStream({self.name!r}, {len(self.ops)} ops)"


class SimEvent:
    """A simulated event; ``last_record`` is the id of its latest record op."""

    __slots__ = ("last_record",)

    def __init__(self) -> None:
        self.last_record: int | None = None


class SimStreamBackend:
    """Simulated streams: operations are queued, not run, until ``execute``.

    ``execute(rng)`` runs every queued operation in a random order that
    respects only the per-stream FIFO order and the recorded event waits, the
    same guarantees CUDA gives. Kernels are the closures given to ``launch``.
    The queue is kept, so one program can be executed under many orders.
    """

    def __init__(self, names: Sequence[str] = ("default",)) -> None:
        if not names:
            raise ValueError("names: expected at least one stream name")
        self.streams: dict[str, SimStream] = {n: SimStream(n) for n in names}
        self._current = self.streams[names[0]]
        self._num_records = 0

    def stream(self, name: str) -> SimStream:
        return self.streams[name]

    def add_stream(self, name: str) -> SimStream:
        if name in self.streams:
            raise ValueError(f"name: stream {name!r} exists")
        s = self.streams[name] = SimStream(name)
        return s

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[SimStream]:
        """Make ``stream`` the current stream inside the block."""
        prev, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = prev

    def current_stream(self) -> SimStream:
        return self._current

    def stream_key(self, stream: Any) -> Hashable:
        return stream.name

    def new_event(self) -> SimEvent:
        return SimEvent()

    def record(self, event: SimEvent, stream: SimStream) -> None:
        rid = self._num_records
        self._num_records += 1
        stream.ops.append((_RECORD, rid))
        event.last_record = rid

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if event.last_record is not None:
            stream.ops.append((_WAIT, event.last_record))

    def launch(self, stream: SimStream, fn: Callable[[], None]) -> None:
        stream.ops.append((_KERNEL, fn))

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        return None

    def num_ops(self) -> int:
        return sum(len(s.ops) for s in self.streams.values())

    def clear(self) -> None:
        """Drop every queued operation."""
        for s in self.streams.values():
            s.ops.clear()

    def execute(self, rng: random.Random | None = None, *, max_burst: int = 8) -> int:
        """Run all queued operations once, in a random legal order.

        Each round picks a stream whose next operation is ready (a wait is
        ready once its record ran) with a per-call random weight per stream,
        so some streams race ahead while others lag, then runs up to
        ``max_burst`` of its operations. ``rng=None`` runs the streams round
        robin. Returns the number of operations run; raises ``RuntimeError``
        if no stream can make progress (impossible for programs built through
        this backend, since a wait only names an already queued record).
        """
        queues = [s.ops for s in self.streams.values() if s.ops]
        pos = [0] * len(queues)
        done = bytearray(self._num_records)
        weights = [rng.random() ** 3 + 1e-3 for _ in queues] if rng is not None else None
        active = list(range(len(queues)))
        ran = 0
        rr = 0
        while active:
            ready = []
            for i in active:
                kind, arg = queues[i][pos[i]]
                if kind != _WAIT or done[arg]:
                    ready.append(i)
            if not ready:
                raise RuntimeError("simulated streams deadlocked: every head op waits")
            if rng is None:
                i = ready[rr % len(ready)]
                rr += 1
                burst = 1
            else:
                i = rng.choices(ready, [weights[j] for j in ready])[0]
                burst = rng.randint(1, max_burst)
            q = queues[i]
            p = pos[i]
            while burst and p < len(q):
                kind, arg = q[p]
                if kind == _WAIT:
                    if not done[arg]:
                        break
                elif kind == _RECORD:
                    done[arg] = 1
                else:
                    arg()
                p += 1
                burst -= 1
                ran += 1
            pos[i] = p
            if p == len(q):
                active.remove(i)
        return ran
