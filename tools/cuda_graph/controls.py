# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The harness's comparisons and negative controls (each must be detected):
(a) the workspace's no-fence switch under the fork-free DeepSeek-V4 fan-out
of ``testing.schedule`` (CPU: the workspace's simulated streams, and the
plugin's ``GraphSafeCudaStreamBackend`` over ``simcuda``; CUDA: real
streams); (b) a wrong stand-in; (c) vLLM's own flow with the fork's join
removed from ``execute_in_parallel`` (the race detector must report it);
and the capture lint (no host sync in a FULL forward).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from model import (
    HEAD_DIM,
    HEADS,
    INDEX_DIM,
    INDEX_HEADS,
    NUM_UBATCHES,
    RATIOS,
    TOPK,
    Model,
)

# The no-fence control's consumer delay on a real GPU (~2 ms on an H200): long enough
# that the GPU, not Python's issue of the next layer, is behind; at the harness's
# SLEEP_CYCLES (~0.1 ms) no unfenced producer overtook on an H200 (2026-12-04).
CONTROL_SLEEP_CYCLES = 4_000_000


def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, Any]:
    bad_steps = [i for i, (x, y) in enumerate(zip(a, b))
                 if not torch.equal(x.view(torch.int16), y.view(torch.int16))]
    worst = max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)),
                default=0.0)
    return {"bitwise_equal": not bad_steps and len(a) == len(b), "steps_differing": bad_steps,
            "max_abs_diff": worst}


@contextlib.contextmanager
def env(**kv: str | None) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in kv}
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _schedule_config() -> Any:
    """The fan-out schedule's workspace (64 tokens, the harness's head sizes)."""
    from vllm_dsv4_backend.layer.plan import Dims, build_workspace_config
    from vllm_dsv4_backend.testing.schedule import WIDE_PLAN

    dims = Dims(num_local_heads=HEADS, padded_q_heads=64, head_dim=HEAD_DIM,
                index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=TOPK)
    return build_workspace_config(dims, max_num_batched_tokens=64, indexer_kv_dtype="fp8",
                                  plan=WIDE_PLAN, num_ubatches=NUM_UBATCHES)


def control_no_fence_schedule(device: torch.device, seeds: int = 4,
                              sim: Any = None) -> dict[str, Any]:
    """(a) The plugin's workspace factory (``layer.cuda.make_workspace``: the
    no-fence switch from envs; ``GraphSafeCudaStreamBackend`` on CUDA and under
    ``simcuda``, whose factory ``sim(policy)`` runs each program) under
    ``testing.schedule``'s fork-free DeepSeek-V4 fan-out, slow consumers."""
    if sim is not None:
        return _no_fence_sim(sim, 1)  # every unfenced hand-over is a race: one seed tells
    from vllm_dsv4_backend.layer import cuda as plugin_cuda
    from vllm_dsv4_backend.testing.schedule import (
        STREAM_ROLES,
        StampKernels,
        enqueue_dsv4_step,
        make_stamp_source,
    )
    from vllm_dsv4_backend.workspace import SimStreamBackend

    cfg = _schedule_config()

    def run(fences: bool) -> int:
        with env(VLLM_DSV4_TEST_UNSAFE_NO_FENCES=None if fences else "1",
                  VLLM_DSV4_WORKSPACE="shared"):
            if device.type == "cuda":
                be: Any = plugin_cuda.GraphSafeCudaStreamBackend(device)
                names = None
            else:
                names = [f"{r}{u}" for u in range(NUM_UBATCHES) for r in STREAM_ROLES]
                be = SimStreamBackend(names)
            ws = plugin_cuda.make_workspace(cfg, device=device, streams=be)
            for i, r in enumerate(RATIOS):
                ws.add_layer(f"model.layers.{i}.attn", r)
            ws.reserve()
            bad = 0
            for seed in range(seeds if device.type == "cpu" else 2):
                rng = random.Random(seed)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    streams = [{r: torch.cuda.Stream(device) for r in STREAM_ROLES}
                               for _ in range(NUM_UBATCHES)]
                    k = StampKernels(be, device=device, sleep_cycles=CONTROL_SLEEP_CYCLES)
                else:
                    assert names is not None
                    be.clear()
                    streams = [{r: be.stream(f"{r}{u}") for r in STREAM_ROLES}
                               for u in range(NUM_UBATCHES)]
                    k = StampKernels(be, device="cpu")
                stamps = make_stamp_source()
                for step, toks in enumerate(((5, 3), (64, 17), (1, 64))):
                    enqueue_dsv4_step(ws, k, streams, toks, variant="random", rng=rng,
                                      stamps=stamps, step=step)
                if device.type == "cpu":
                    be.execute(random.Random(1000 + seed))
                bad += len(k.mismatches())
            return bad

    fenced, unfenced = run(True), run(False)
    return {"what": "no-fence switch, fork-free fan-out (testing.schedule), slow consumers",
            "mismatches_with_fences": fenced, "mismatches_without_fences": unfenced,
            "detected": unfenced > 0 and fenced == 0}


# Ops that read device memory on the host (or copy host data in): illegal in a
# CUDA-graph capture. ``tolist()`` does not dispatch on CPU; none of the code
# under test calls it (grep).
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "item",
                           "lift_fresh", "_assert_async"})


def host_sync_lint(impl: str, seed: int) -> dict[str, int]:
    """One CPU step, forward-context mode FULL (the eager break inline, as in a
    FULL capture), under a dispatch mode that records host syncs: the CPU
    evidence that the whole forward (vLLM's bodies, the plugin's overrides,
    the stand-ins) can be captured."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.config import CUDAGraphMode

    found: Counter[str] = Counter()

    class Lint(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            name = func.overloadpacket.__name__
            if name in HOST_SYNC_OPS:
                found[name] += 1
            return func(*args, **(kwargs or {}))

    m = Model(impl, torch.device("cpu"), seed, policy="shared", aux_streams=False)
    m.load_step(0)
    with Lint():
        m.forward_step(CUDAGraphMode.FULL)
    return dict(found)



def _no_fence_sim(sim: Any, seeds: int) -> dict[str, Any]:
    """(a) on ``simcuda``: the plugin's ``GraphSafeCudaStreamBackend`` records and
    waits real (emulated) events; torch stamp kernels, side streams run as late
    as CUDA allows (``lazy``) or in random prefixes; the race detector watches."""
    from modes import workspace_namer

    from vllm_dsv4_backend.layer import cuda as plugin_cuda
    from vllm_dsv4_backend.testing.schedule import (
        STREAM_ROLES,
        StampKernels,
        enqueue_dsv4_step,
        make_stamp_source,
    )

    cfg = _schedule_config()

    def run(fences: bool, policy: str, seed: int, workspace: str = "shared",
            captured: bool = False) -> tuple[int, int]:
        with env(VLLM_DSV4_TEST_UNSAFE_NO_FENCES=None if fences else "1",
                 VLLM_DSV4_WORKSPACE=workspace), sim(policy, seed) as (rt, det), \
                (contextlib.nullcontext() if fences or workspace == "shared"
                 else record_stream_removed()):
            be = plugin_cuda.GraphSafeCudaStreamBackend(torch.device("cuda"))
            ws = plugin_cuda.make_workspace(cfg, device="cpu", streams=be)
            for i, r in enumerate(RATIOS):
                ws.add_layer(f"model.layers.{i}.attn", r)
            ws.reserve()
            if ws.storage is not None:
                det.add_region(ws.storage, workspace_namer(ws))
            rng = random.Random(seed)
            streams = [{r: torch.cuda.Stream() for r in STREAM_ROLES}
                       for _ in range(NUM_UBATCHES)]
            k = StampKernels(be, device="cpu", use_numpy=False)
            stamps = make_stamp_source()
            every = [s for by_role in streams for s in by_role.values()]
            graph = torch.cuda.CUDAGraph() if captured else None
            origin = torch.cuda.Stream()
            with (torch.cuda.graph(graph, stream=origin) if graph is not None
                  else contextlib.nullcontext()):
                if graph is not None:
                    for s in every:  # fork every stream into the capture
                        s.wait_stream(origin)
                # Few tokens: every 256-byte cell of a lease is tracked.
                for step, toks in enumerate(((5, 3), (8, 2), (1, 6))):
                    enqueue_dsv4_step(ws, k, streams, toks, variant="random", rng=rng,
                                      stamps=stamps, step=step)
                if graph is not None:
                    for s in every:  # and join them back: only the fences order the rest
                        origin.wait_stream(s)
            if graph is not None:
                for _ in range(2):
                    graph.replay()
            torch.cuda.synchronize()
            return len(k.mismatches()), det.total + det.undeclared

    out: dict[str, Any] = {"what": "no-fence switch, GraphSafeCudaStreamBackend over simcuda"}
    for policy in ("lazy", "random"):
        fenced = [run(True, policy, s) for s in range(seeds)]
        unfenced = [run(False, policy, s) for s in range(seeds)]
        out[policy] = {"mismatches_with_fences": sum(m for m, _ in fenced),
                       "races_with_fences": sum(r for _, r in fenced),
                       "mismatches_without_fences": sum(m for m, _ in unfenced),
                       "races_without_fences": sum(r for _, r in unfenced)}
    out["mismatches_with_fences"] = sum(out[p]["mismatches_with_fences"]
                                        for p in ("lazy", "random"))
    out["mismatches_without_fences"] = sum(out[p]["mismatches_without_fences"]
                                           for p in ("lazy", "random"))
    clean = all(out[p]["mismatches_with_fences"] == 0 and out[p]["races_with_fences"] == 0
                for p in ("lazy", "random"))
    caught = all(out[p]["races_without_fences"] > 0 for p in ("lazy", "random")) and \
        out["mismatches_without_fences"] > 0
    # The ``off`` policy: each lease a fresh block of simcuda's caching-allocator
    # model; its consumers' streams declared with record_stream, then removed.
    off = {"with_record_stream": [run(True, "random", s, "off") for s in range(seeds)],
           "without_record_stream": [run(False, "random", s, "off") for s in range(seeds)]}
    out["off"] = {k: {"mismatches": sum(m for m, _ in v), "races": sum(r for _, r in v)}
                  for k, v in off.items()}
    clean &= out["off"]["with_record_stream"] == {"mismatches": 0, "races": 0}
    caught &= out["off"]["without_record_stream"]["races"] > 0
    # The same fan-out captured in one CUDA graph (every stream forked into the
    # capture and joined at its end) and replayed twice: inside one graph the
    # hand-overs are ordered by the fences alone, which must be kept there.
    cap = {"with_fences": [run(True, "random", s, captured=True) for s in range(seeds)],
           "without_fences": [run(False, "random", s, captured=True) for s in range(seeds)]}
    out["captured"] = {k: {"mismatches": sum(m for m, _ in v), "races": sum(r for _, r in v)}
                       for k, v in cap.items()}
    clean &= out["captured"]["with_fences"] == {"mismatches": 0, "races": 0}
    caught &= out["captured"]["without_fences"]["races"] > 0
    out["detected"] = clean and caught
    return out


@contextlib.contextmanager
def record_stream_removed() -> Iterator[None]:
    """The ``off`` policy without its ``record_stream`` calls: the caching
    allocator may hand a lease's block back to its producer's stream while a
    consumer on another stream still reads it."""
    from vllm_dsv4_backend.workspace.streams import CudaStreamBackend

    saved = CudaStreamBackend.record_stream
    CudaStreamBackend.record_stream = lambda self, tensor, stream: None  # type: ignore
    try:
        yield
    finally:
        CudaStreamBackend.record_stream = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def join_removed() -> Iterator[None]:
    """(c) vLLM's ``execute_in_parallel`` with its join (the default stream's
    wait on each aux stream's done event) removed, bound where the cut
    attention bodies look it up: a fork that is never joined."""
    import inspect
    import textwrap

    from vllm.models.deepseek_v4 import attention
    from vllm.utils import multi_stream_utils as msu

    src = textwrap.dedent(inspect.getsource(msu.execute_in_parallel))
    join = "    for ev in pending:\n        ev.wait()\n"
    if join not in src:
        raise AssertionError("execute_in_parallel's join is not where the control expects it")
    ns: dict[str, Any] = dict(vars(msu))
    exec(compile(src.replace(join, "    pass\n"), msu.__file__ or "<msu>", "exec"), ns)
    saved = attention.execute_in_parallel
    attention.execute_in_parallel = ns["execute_in_parallel"]
    try:
        yield
    finally:
        attention.execute_in_parallel = saved

