# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashMLA against the plugin's serial torch reference: the eager cases (two layers on
one plan, ``out=`` into a sentinel buffer), the CUDA-graph capture/replay (vLLM's FULL
mode) and the fenced side stream (the CUDA layer's fork/join)."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from tools.gpu_flashmla import cases as C

__all__ = ["run_case", "step_cases", "step_graph", "step_streams", "stream_run"]

SENTINEL = 7.0  # out= buffer rows outside the call's slice must keep it


def _fresh_q(case: C.DecodeCase, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(9000 + seed)
    return C.random_q(tuple(case.q.shape), g)


def _with_q(case: C.DecodeCase, q: torch.Tensor) -> C.DecodeCase:
    t = case.tensors()
    t["q"] = q
    return C.DecodeCase(case.spec, facts=case.facts, **t)  # type: ignore[arg-type]


def _cmp(out: torch.Tensor, lse: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]
         ) -> dict[str, Any]:
    o = C.compare(out, ref[0], "out")
    ls = C.compare(lse, ref[1], "lse")
    return {"ok": o["ok"] and ls["ok"], "out": o, "lse": ls}


def run_case(iface: Any, spec: C.CaseSpec, device: str) -> dict[str, Any]:
    case = C.build_case(spec)
    layer2 = _with_q(case, _fresh_q(case, spec.seed))  # second layer of the type
    refs = [C.reference(case), C.reference(layer2)]
    dev, dev2 = case.to(device), layer2.to(device)
    n, h = case.q.shape[0], case.q.shape[2]
    sched = iface.get_mla_metadata()[0]
    res: dict[str, Any] = {"facts": case.facts, "calls": []}
    for i, c in enumerate((dev, dev2)):
        # out= a slice of a larger sentinel buffer, as vLLM passes output.unsqueeze(1).
        buf = torch.full((n + 4, h, C.D), SENTINEL, dtype=torch.bfloat16, device=device)
        view = buf[2: n + 2].unsqueeze(1)
        out, lse = iface.flash_mla_with_kvcache(
            **c.kwargs(), tile_scheduler_metadata=sched, out=view)
        if device != "cpu":
            torch.cuda.synchronize()
        call = _cmp(out, lse, refs[i])
        call["out_is_buffer"] = out.data_ptr() == view.data_ptr()
        call["sentinel_kept"] = bool((buf[:2] == SENTINEL).all() and
                                     (buf[n + 2:] == SENTINEL).all())
        call["ok"] = call["ok"] and call["out_is_buffer"] and call["sentinel_kept"]
        res["calls"].append(call)
    res["sched"] = {
        "tile_scheduler_metadata": list(sched.tile_scheduler_metadata.shape)
        if sched.tile_scheduler_metadata is not None else None,
        "num_splits": list(sched.num_splits.shape) if sched.num_splits is not None else None,
    }
    res["ok"] = all(c["ok"] for c in res["calls"])
    # The tolerance's headroom for the kernel's known rounding (informational).
    emu = _cmp(*C.bf16_p_emulation(case), refs[0])
    res["bf16_p_emulation"] = {"ok": emu["ok"], **{
        f"{k}_{m}": emu[k][m] for k in ("out", "lse") for m in ("max_abs_err", "cos_diff")}}
    return res


def step_cases(iface: Any, specs: list[C.CaseSpec], device: str) -> dict[str, Any]:
    res: dict[str, Any] = {"device": device, "tolerance": C.TOLERANCE, "cases": {}}
    for spec in specs:
        try:
            res["cases"][spec.name] = run_case(iface, spec, device)
        except Exception as e:  # noqa: BLE001 - one case's failure must not hide the rest
            res["cases"][spec.name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                       "traceback": traceback.format_exc(limit=6)}
            # Under TORCH_CUDA_SANITIZER=1 a race raises CUDASanitizerErrors: count it.
            errors = getattr(e, "errors", None)
            if type(e).__name__ == "CUDASanitizerErrors" and errors is not None:
                res["cases"][spec.name].update(
                    races=len(errors), race_reports=[str(x)[:2000] for x in errors[:3]])
    bad = [k for k, v in res["cases"].items() if not v["ok"]]
    res["status"] = "PASS" if not bad else "FAIL"
    res["failed"] = bad
    return res


def step_graph(iface: Any, spec: C.CaseSpec) -> dict[str, Any]:
    """vLLM's FULL-graph pattern: a fresh plan captured with the planner inside, two
    calls on it, replayed on new steps' values copied into the static inputs."""
    case = C.build_case(spec)
    st = case.to("cuda")
    q2 = _fresh_q(case, spec.seed).cuda()
    n, h = case.q.shape[0], case.q.shape[2]
    out1 = torch.empty(n, 1, h, C.D, dtype=torch.bfloat16, device="cuda")
    out2 = torch.empty_like(out1)
    # Warm-up outside the capture (module load, first-call planner allocations).
    iface.flash_mla_with_kvcache(**st.kwargs(),
                                 tile_scheduler_metadata=iface.get_mla_metadata()[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    kw2 = dict(st.kwargs(), q=q2)
    with torch.cuda.graph(graph):
        sched = iface.get_mla_metadata()[0]
        _, lse1 = iface.flash_mla_with_kvcache(**st.kwargs(), tile_scheduler_metadata=sched,
                                               out=out1)
        _, lse2 = iface.flash_mla_with_kvcache(**kw2, tile_scheduler_metadata=sched, out=out2)
    res: dict[str, Any] = {"case": spec.name, "replays": []}
    for step in (0, 1, 2):
        nxt = case if step == 0 else C.next_step(case, step)
        nq2 = _fresh_q(case, 100 + step)
        for dst, src in ((st.q, nxt.q), (st.swa_indices, nxt.swa_indices),
                         (st.swa_lens, nxt.swa_lens), (st.extra_indices, nxt.extra_indices),
                         (st.extra_lens, nxt.extra_lens), (q2, nq2)):
            if dst is not None:
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        r1, r2 = C.reference(nxt), C.reference(_with_q(nxt, nq2))
        c1, c2 = _cmp(out1, lse1, r1), _cmp(out2, lse2, r2)
        res["replays"].append({"step": step, "ok": c1["ok"] and c2["ok"],
                               "layer1": c1, "layer2": c2})
    res["status"] = "PASS" if all(r["ok"] for r in res["replays"]) else "FAIL"
    return res


def stream_run(iface: Any, case: C.DecodeCase, fence_fork: bool) -> tuple[Any, Any]:
    """Producer on the main stream, FlashMLA on an aux stream, consumer on main: the
    CUDA layer's fork/join. ``fence_fork=False`` drops the fork's wait (the control)."""
    main = torch.cuda.current_stream()
    aux = torch.cuda.Stream()
    dev = case.to("cuda")
    q = dev.q * 1  # produced on main right before the fork
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
    if fence_fork:
        aux.wait_stream(main)
    with torch.cuda.stream(aux):
        _, lse = iface.flash_mla_with_kvcache(**dict(dev.kwargs(), q=q),
                                              tile_scheduler_metadata=iface.get_mla_metadata()[0],
                                              out=out)
        done = torch.cuda.Event()
        done.record(aux)
    main.wait_event(done)
    res = out.clone(), lse.clone()  # the consumer, on main
    torch.cuda.synchronize()
    return res


def step_streams(iface: Any, spec: C.CaseSpec) -> dict[str, Any]:
    case = C.build_case(spec)
    ref = C.reference(case)
    out, lse = stream_run(iface, case, fence_fork=True)
    eager_out, eager_lse = iface.flash_mla_with_kvcache(
        **case.to("cuda").kwargs(), tile_scheduler_metadata=iface.get_mla_metadata()[0])
    torch.cuda.synchronize()
    res = _cmp(out, lse, ref)
    res["bitwise_equal_to_eager"] = bool(torch.equal(out, eager_out.view_as(out)) and
                                         torch.equal(lse, eager_lse))
    res["status"] = "PASS" if res["ok"] else "FAIL"
    return res
