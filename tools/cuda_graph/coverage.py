# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Line coverage of vLLM's cut fork / join / eager-break / capture /
micro-batch bodies in the stub, over every thread a mode runs.

``BODIES``: the functions the workspace's safety rests on, each with the
*key lines* (a substring of a source line) that must run: the fork onto an
aux stream, the join, the eager break's ``add_eager``, a segment's capture
begin / end, the replay loop, the micro-batch hand-overs. The report gives,
per body, the statement lines hit of all, and per key line whether it ran.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

# (stub module, qualname) -> key lines that must run in some mode.
BODIES: dict[tuple[str, str], tuple[str, ...]] = {
    ("vllm.utils.multi_stream_utils", "execute_in_parallel"):
        ("start_event.record()", "with torch.cuda.stream(aux_streams[i]):", "start_event.wait()",
         "done_events[i].record()", "ev.wait()"),
    ("vllm.utils.multi_stream_utils", "maybe_execute_in_parallel"):
        ("event0.record()", "with torch.cuda.stream(aux_stream):", "event1.wait()",
         "aux_stream = None"),
    ("vllm.compilation.breakable_cudagraph", "eager_break_during_capture"):
        ("return capture.add_eager(lambda: fn(*weak_args, **weak_kwargs))",
         "return fn(*args, **kwargs)"),
    ("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphCapture._begin_segment"):
        ("g.capture_begin(pool=self.pool)",),
    ("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphCapture._end_segment"):
        ("self._current_graph.capture_end()",),
    ("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphCapture.add_eager"):
        ("self._end_segment()", "self._begin_segment()"),
    ("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphCapture.replay"): ("r()",),
    ("vllm.v1.worker.ubatching", "UBatchContext.__enter__"): ("self.ready_barrier.wait()",),
    ("vllm.v1.worker.ubatching", "UBatchContext._cpu_yield"): ("self.cpu_wait_event.wait()",),
    ("vllm.v1.worker.ubatching", "UBatchContext.yield_and_switch_from_compute_to_comm"):
        ("self._wait_compute_done()",),
    ("vllm.v1.worker.ubatching", "UBatchContext.switch_to_compute_sync"):
        ("self._wait_comm_done()",),
    ("vllm.v1.worker.ubatching", "UBatchContext.yield_"): ("self._cpu_yield()",),
}


def _def_node(tree: ast.AST, qualname: str) -> ast.AST | None:
    node: Any = tree
    for part in qualname.split("."):
        node = next((n for n in ast.iter_child_nodes(node)
                     if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
    return node


class Coverage:
    """Records executed lines of the stub's files (``sys.settrace`` and
    ``threading.settrace``, only frames of those files)."""

    def __init__(self) -> None:
        import importlib

        self.files: dict[str, str] = {}
        self.hit: set[tuple[str, int]] = set()
        self.bodies: dict[tuple[str, str], tuple[str, set[int], dict[str, int]]] = {}
        for mod_name, qual in BODIES:
            mod = importlib.import_module(mod_name)
            path = mod.__file__
            assert path is not None
            with open(path, encoding="utf-8") as f:
                text = f.read()
            self.files[path] = mod_name
            node = _def_node(ast.parse(text), qual)
            if node is None:
                continue
            stmts = {n.lineno for n in ast.walk(node) if isinstance(n, ast.stmt)} - {
                node.lineno}  # type: ignore[attr-defined]
            lines = text.splitlines()
            keys: dict[str, int] = {}
            for k in BODIES[(mod_name, qual)]:
                for ln in sorted(stmts):
                    if lines[ln - 1].strip() == k or lines[ln - 1].strip().startswith(k):
                        keys[k] = ln
                        break
            self.bodies[(mod_name, qual)] = (path, stmts, keys)

    def _tracer(self, frame: FrameType, event: str, arg: Any) -> Any:
        path = frame.f_code.co_filename
        if path not in self.files:
            return None

        def local(f: FrameType, ev: str, a: Any) -> Any:
            if ev == "line":
                self.hit.add((path, f.f_lineno))
            return local

        return local

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        old = sys.gettrace()
        sys.settrace(self._tracer)
        threading.settrace(self._tracer)
        try:
            yield
        finally:
            sys.settrace(old)
            threading.settrace(None)  # type: ignore[arg-type]

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for (mod_name, qual), (path, stmts, keys) in self.bodies.items():
            hit = {ln for p, ln in self.hit if p == path} & stmts
            out[f"{mod_name}:{qual}"] = {
                "lines_hit": len(hit), "lines": len(stmts),
                "key_lines": {k: (ln in hit) for k, ln in keys.items()},
                "missing_key_lines": [k for k in BODIES[(mod_name, qual)] if k not in keys],
            }
        return out

