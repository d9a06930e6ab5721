# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The capture / replay emulator of :mod:`simcuda`, with CUDA-graph semantics.

* a capture begins on one stream (never the legacy default stream); a
  stream that waits on an event recorded on a capturing stream joins the
  capture (vLLM's fork into it); captured launches, records and waits do not
  run, they are recorded with the storages they read and write;
* at capture nothing executes: an out-of-place op's output is allocated
  from its meta shape (floats NaN), as a graph's buffers hold no computed
  value before the first replay; in-place ops leave their targets alone;
* a captured wait on an event recorded outside the capture, and a capture
  that ends with a joined stream not joined back into the origin stream
  (``cudaErrorStreamCaptureUnjoined``), raise :class:`SimCudaError`;
* ``replay()`` enqueues the captured work on the current stream: the origin
  stream's work there, each other captured stream's on a stream of the
  graph's own, ordered after everything enqueued before the replay and
  joined before anything after it; each op re-executes into the storages
  allocated at capture (the graph's pool), with no Python of the captured
  region; the race detector sees the replayed launches, not the captured
  ones (nothing ran at capture).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from allocator import materialize
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from simcuda import SimStream, _Token


class SimCudaError(RuntimeError):
    """What CUDA would refuse (capture isolation, unjoined capture, sync in capture)."""

class SimGraph:
    """``torch.cuda.CUDAGraph``: captured launches, records and waits."""

    rt: Any = None  # the installed SimCuda
    _ids = itertools.count()

    def __init__(self, keep_graph: bool = False) -> None:
        self.id = next(self._ids)
        self.entries: list[tuple[SimStream, str, Any]] = []
        self.streams: list[SimStream] = []
        self.origin: SimStream | None = None
        self.replays = 0
        self.replay_streams: dict[int, SimStream] = {}
        self.pool_id: Any = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        rt = SimGraph.rt
        assert rt is not None
        # Its allocations come from ``pool`` (shared with the graphs given the same
        # handle) or from a private pool of its own.
        self.pool_id = pool if pool is not None else ("graph", self.id)
        rt.graphs.append(self)
        rt.begin_capture(self, rt.current_stream())

    def capture_end(self) -> None:
        rt = SimGraph.rt
        assert rt is not None
        rt.end_capture(self)

    def replay(self) -> None:
        rt = SimGraph.rt
        assert rt is not None
        rt.replay(self)

    def reset(self) -> None:
        self.entries.clear()

    def pool(self) -> Any:
        return self.pool_id if self.pool_id is not None else ("graph", self.id)

    @property
    def num_launches(self) -> int:
        return sum(1 for _, kind, _ in self.entries if kind == "op")



class GraphRuntime:
    """The graph half of :class:`simcuda.SimCuda` (a mixin: it uses the
    runtime's streams, queues and observer)."""

    def begin_capture(self, graph: SimGraph, stream: SimStream) -> None:
        if stream.cuda_stream in self._capture:
            raise SimCudaError(f"{stream.name} is already capturing")
        if stream is self.default:
            raise SimCudaError("capture on the default (legacy) stream is not permitted")
        self.drain_all()  # a capture starts after the stream's earlier work
        graph.origin = stream
        graph.streams = [stream]
        graph.entries.clear()
        self._capture[stream.cuda_stream] = graph

    def end_capture(self, graph: SimGraph) -> None:
        origin = graph.origin
        assert origin is not None
        # Every forked stream must be joined back into the origin (vector clocks).
        clock: dict[int, dict[int, int]] = {s.cuda_stream: {} for s in graph.streams}
        pos: dict[int, int] = dict.fromkeys(clock, 0)
        snap: dict[int, dict[int, int]] = {}
        for s, kind, item in graph.entries:
            k = s.cuda_stream
            pos[k] += 1
            clock[k][k] = pos[k]
            if kind == "rec":
                snap[item.id] = dict(clock[k])
            elif kind == "wait":
                for kk, v in snap.get(item.id, {}).items():
                    if clock[k].get(kk, 0) < v:
                        clock[k][kk] = v
        for s in graph.streams:
            del self._capture[s.cuda_stream]
        if self.alloc is not None:
            self.alloc.capture_ended()
        unjoined = [s.name for s in graph.streams if s is not origin
                    and clock[origin.cuda_stream].get(s.cuda_stream, 0) < pos[s.cuda_stream]]
        if unjoined:
            raise SimCudaError(f"capture ended with {unjoined} not joined into {origin.name} "
                               "(cudaErrorStreamCaptureUnjoined)")

    def replay(self, graph: SimGraph) -> None:
        here = self.current_stream()
        if self.capturing(here):
            raise SimCudaError("replay() inside a capture")
        graph.replays += 1
        start = self.enqueue_record(here)
        side: dict[int, SimStream] = {}
        tokens: dict[int, _Token] = {}
        assert graph.origin is not None
        # The graph's own streams (made once): ordered after this stream's earlier
        # work, joined back below.
        own = graph.replay_streams
        for s in graph.streams:
            if s is graph.origin:
                side[s.cuda_stream] = here
            else:
                if s.cuda_stream not in own:
                    own[s.cuda_stream] = self.new_stream(f"{s.name}@graph{graph.id}")
                v = side[s.cuda_stream] = own[s.cuda_stream]
                self.enqueue_wait(v, start)
        for s, kind, item in graph.entries:
            target = side[s.cuda_stream]
            if kind == "rec":
                tokens[item.id] = self.enqueue_record(target)
            elif kind == "wait":
                self.enqueue_wait(target, tokens[item.id])
            else:
                job = copy.copy(item)
                # The detector sees the replayed tensors (a launch may hold
                # allocator.Ref recipes instead of tensors: views made here, not ops).
                with _disable_current_modes():
                    seen = tuple(tree_map(materialize, x)
                                 for x in (job.args, job.kwargs, job.outputs))
                self._observe("launch", target, job.func, *seen)
                self.replayed_launches += 1
                target.queue.append(("op", job))
                self._settle(target)
        for v in side.values():
            if v is not here:
                self.enqueue_wait(here, self.enqueue_record(v))

    # --- installation ----------------------------------------------------------------

    @contextlib.contextmanager
    def graph_ctx(self, graph: SimGraph, pool: Any = None, stream: SimStream | None = None,
                  capture_error_mode: str = "global") -> Iterator[SimGraph]:
        self.synchronize()
        s = stream if stream is not None else self.new_stream(f"graph{graph.id}")
        with self.stream_ctx(s):
            graph.capture_begin(pool=pool)
            try:
                yield graph
            finally:
                graph.capture_end()

