# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real FlashMLA sparse decode (vLLM 0.34's ``_flashmla_C.abi3.so``, carried) against the
plugin's serial torch reference, on a lent GPU whose image has torch but no vLLM.

Steps, each reported in one JSON (written after every step, so a timeout keeps what ran;
a failing step reports its error and the next one still runs):

1. ``env``: python / torch / CUDA / GPU, and that ``import vllm`` fails (as on the box);
2. ``bundle``: :func:`tools.gpu_flashmla.bundle.verify_bundle` (files, sizes, sha256);
3. ``load``: which of the torch stable-ABI and C++ symbols the ``.so`` needs this
   torch and libstdc++ lack, then ``import dsv4_flashmla.flash_mla_interface`` (which
   loads the ``.so``), with the error if it fails: the wheel pins torch 2.14, the box has
   2.11 (whose libraries define every symbol it needs: ``bundle.py --verify --against``);
4. ``cases``: every :data:`tools.gpu_flashmla.cases.CASES` case eagerly, two calls per
   step on one ``get_mla_metadata()`` plan (two layers of a type, as vLLM shares it),
   ``out=`` a slice of a sentinel-filled buffer, each against the reference
   (:data:`~tools.gpu_flashmla.cases.TOLERANCE`);
5. ``graph``: the two calls captured in one CUDA graph with the planner inside (vLLM's
   FULL mode), replayed on two further steps' inputs copied into the static tensors;
6. ``streams``: the call on an auxiliary stream fenced both ways (the CUDA layer's
   pattern), against the reference and bitwise against the eager result;
7. ``sanitizer``: this script again in a subprocess under ``TORCH_CUDA_SANITIZER=1``:
   the cases and the fenced stream run must raise no race, and a negative control (the
   fork's fence removed) must raise one.

``--dry-run`` (CPU CI): steps 1-3 for real (the load then fails on a CPU torch, reported),
then 4 and 7 through the real interface code with a CPU stand-in for the op (the plugin's
reference behind FlashMLA's shape asserts), so argument plumbing, sizes and the report
are exercised; 5 and 6 need CUDA and are reported as skipped.

    python tools/gpu_flashmla/check.py --bundle .scratch/gpu_bundle/flashmla --out OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repo is the package root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tools.gpu_flashmla import bundle as bundle_mod  # noqa: E402
from tools.gpu_flashmla import cases as C  # noqa: E402

DEFAULT_OUT = os.path.join(os.environ.get("OUT") or str(ROOT / ".scratch" / "gpu_check"),
                           "flashmla_check.json")
SENTINEL = 7.0  # out= buffer rows outside the call's slice must keep it


# ------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------
class Report:
    def __init__(self, path: str, doc: dict[str, Any]) -> None:
        self.path, self.doc = path, doc

    def write(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one step; an exception becomes ``{"status": "ERROR", ...}``, never a crash."""
        t0 = time.monotonic()
        print(f"== flashmla check: {name}", flush=True)
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - every step reports instead of crashing
            res = {"status": "ERROR", "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc(limit=8)}
        res["seconds"] = round(time.monotonic() - t0, 2)
        self.doc["steps"][name] = res
        print(f"   {name}: {res.get('status')} ({res['seconds']} s)"
              + (f" {res['error']}" if "error" in res else ""), flush=True)
        self.write()
        return res


# ------------------------------------------------------------------------------------------
# steps 1-3: environment, bundle, load
# ------------------------------------------------------------------------------------------
def step_env() -> dict[str, Any]:
    res: dict[str, Any] = {
        "status": "OK", "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "sanitizer_env": "TORCH_CUDA_SANITIZER" in os.environ,
    }
    if torch.cuda.is_available():
        res["gpu"] = torch.cuda.get_device_name(0)
        res["capability"] = list(torch.cuda.get_device_capability(0))
        res["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        import vllm  # noqa: F401

        res["vllm_importable"] = True
    except ImportError as e:
        res["vllm_importable"] = False
        res["vllm_import_error"] = str(e)
    return res


def _missing_symbols(elf: dict[str, Any]) -> dict[str, Any]:
    # dlsym on torch's own libraries and libstdc++ (already loaded by `import torch`; CDLL
    # returns the same handle): a symbol none of them defines makes the .so's load fail.
    libdir = Path(torch.__file__).parent / "lib"
    handles = []
    for name in ("libtorch_cpu.so", "libtorch_cuda.so", "libtorch.so", "libstdc++.so.6"):
        with contextlib.suppress(OSError):
            handles.append(ctypes.CDLL(name if name.startswith("libstdc") else
                                       str(libdir / name)))
    res: dict[str, Any] = {"libs": len(handles)}
    for key in ("torch_stable_abi_symbols", "cxx_symbols"):
        syms = elf.get(key) or []
        res[key] = {"checked": len(syms),
                    "missing": [s for s in syms if not any(hasattr(h, s) for h in handles)]}
    return res


def _has_op(name: str) -> bool:
    try:
        return hasattr(torch.ops._flashmla_C, name)
    except Exception:  # noqa: BLE001 - an unknown namespace is just "no"
        return False


def _import_over(fake_ext: types.ModuleType) -> Any:
    """Import the bundle's interface with ``fake_ext`` standing in for the extension
    module (its ``from . import _flashmla_C`` then finds it in ``sys.modules``)."""
    import importlib

    pkg = importlib.import_module(bundle_mod.PACKAGE)
    sys.modules[fake_ext.__name__] = fake_ext
    pkg._flashmla_C = fake_ext  # type: ignore[attr-defined]
    return importlib.import_module(bundle_mod.PACKAGE + ".flash_mla_interface")


def step_load(bundle_dir: str, dry: bool) -> tuple[dict[str, Any], Any]:
    """Import the bundle's interface, which loads the .so as vLLM does (an extension-module
    import); if that fails, try ``torch.ops.load_library`` (a plain dlopen, no module
    init) and report both. In the dry run, after reporting the real load, import the
    interface over a CPU stand-in op. Returns (report, module or None)."""
    import importlib

    verify = bundle_mod.verify_bundle(bundle_dir)
    res: dict[str, Any] = {"status": "OK", "torch": torch.__version__}
    res["symbols"] = _missing_symbols(verify.get("elf") or {})
    if bundle_dir not in sys.path:
        sys.path.insert(0, bundle_dir)
    fake_name = bundle_mod.PACKAGE + "._flashmla_C"
    try:
        iface = importlib.import_module(bundle_mod.PACKAGE + ".flash_mla_interface")
        res.update(loaded=True, method="extension import (as vLLM)", kernel="flashmla")
    except Exception as e:  # noqa: BLE001 - the report says why it did not load
        res.update(loaded=False, error=f"{type(e).__name__}: {e}",
                   traceback=traceback.format_exc(limit=6))
        iface = None
        so = Path(bundle_dir) / bundle_mod.PACKAGE / bundle_mod.SO_NAME
        try:
            torch.ops.load_library(str(so))
            if not _has_op("sparse_decode_fwd"):
                raise RuntimeError("loaded, but torch.ops._flashmla_C.sparse_decode_fwd "
                                   "is not registered")
            iface = _import_over(types.ModuleType(fake_name))
            res.update(loaded=True, method="torch.ops.load_library", kernel="flashmla")
        except Exception as e2:  # noqa: BLE001
            res["load_library_error"] = f"{type(e2).__name__}: {e2}"
    if iface is not None:
        res["ops"] = [n for n in ("sparse_decode_fwd", "sparse_prefill_fwd") if _has_op(n)]
        return res, iface
    if not dry:
        res["status"] = "FAIL"
        return res, None
    # Dry run: the interface is importable up to the .so; exercise the rest with a
    # stand-in module in the .so's place and a CPU op behind the interface's call.
    iface = _import_over(types.ModuleType(fake_name))
    iface.flash_mla_cuda = CpuStandIn()
    res["kernel"] = "cpu-standin (dry run)"
    return res, iface


class CpuStandIn:
    """``torch.ops._flashmla_C`` for the dry run: FlashMLA's sparse-decode asserts (the
    ``.so``'s messages), then the plugin's reference. Never used where CUDA runs."""

    def sparse_decode_fwd(self, q, kv, indices, topk_length, attn_sink, sched, splits,
                          extra_kv, extra_indices, extra_topk_length, d_v, sm_scale,
                          out=None, enable_batch_invariant=False):  # noqa: ANN001
        from vllm_dsv4_backend.ops.torch_sparse_mla import sparse_mla_decode

        bad = C.flashmla_problems(q, kv, indices, extra_kv, extra_indices)
        if bad or d_v != 512:
            raise RuntimeError("FlashMLA would refuse: " + "; ".join(bad or [f"d_v {d_v}"]))
        b = q.shape[0]
        o, lse = sparse_mla_decode(q, kv, indices, topk_length, attn_sink, sm_scale,
                                   extra_kv, extra_indices, extra_topk_length, out=out)
        if sched is None:  # the planner's outputs: (num_sm_parts, 8) and (b + 1,)
            sched = torch.zeros(1, 8, dtype=torch.int32)
            splits = torch.zeros(b + 1, dtype=torch.int32)
        return o, lse, sched, splits


# ------------------------------------------------------------------------------------------
# steps 4-6: FlashMLA against the reference
# ------------------------------------------------------------------------------------------
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


def _stream_run(iface: Any, case: C.DecodeCase, fence_fork: bool) -> tuple[Any, Any]:
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
    out, lse = _stream_run(iface, case, fence_fork=True)
    eager_out, eager_lse = iface.flash_mla_with_kvcache(
        **case.to("cuda").kwargs(), tile_scheduler_metadata=iface.get_mla_metadata()[0])
    torch.cuda.synchronize()
    res = _cmp(out, lse, ref)
    res["bitwise_equal_to_eager"] = bool(torch.equal(out, eager_out.view_as(out)) and
                                         torch.equal(lse, eager_lse))
    res["status"] = "PASS" if res["ok"] else "FAIL"
    return res


# ------------------------------------------------------------------------------------------
# step 7: the sanitizer pass (parent and child)
# ------------------------------------------------------------------------------------------
def step_sanitizer(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        child_out = os.path.join(tmp, "sanitizer.json")
        cases = args.cases
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.dry_run:
            # CSAN asks torch.cuda for the current stream on every op, which a CPU torch
            # refuses: the dry run checks the child's plumbing on its first case only.
            cases = cases.split(",")[0]
            env.pop("TORCH_CUDA_SANITIZER", None)
        else:
            env["TORCH_CUDA_SANITIZER"] = "1"
        cmd = [sys.executable, os.path.abspath(__file__), "--sanitizer-child",
               "--bundle", args.bundle, "--out", child_out, "--cases", cases]
        if args.dry_run:
            cmd.append("--dry-run")
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=args.sanitizer_timeout)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-4000:]
        except subprocess.TimeoutExpired as e:
            rc = 124
            tail = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                    else (e.stdout or ""))[-4000:]
        try:
            with open(child_out) as f:
                child = json.load(f)
        except (OSError, ValueError):
            child = None
    res: dict[str, Any] = {"rc": rc, "child": child, "output_tail": tail}
    if rc == 124:
        res["status"] = "TIMEOUT"  # the child's JSON holds the steps it finished
    elif child is None:
        res["status"] = f"ERROR(rc {rc}, no JSON)"
    else:
        res["status"] = child.get("status", "ERROR")
        res["races"] = child.get("races")
    return res


def child_main(args: argparse.Namespace, rep: Report, iface: Any, specs: list[C.CaseSpec],
               device: str) -> str:
    """Under ``TORCH_CUDA_SANITIZER=1``: cases and the fenced stream run must be silent;
    the control without the fork's fence must raise ``CUDASanitizerErrors``."""
    from torch.cuda import _sanitizer as csan

    rep.doc["sanitizer_enabled"] = bool(csan.cuda_sanitizer.enabled)
    if device == "cuda" and not csan.cuda_sanitizer.enabled:
        rep.doc["steps"]["sanitizer"] = {"status": "ERROR",
                                         "error": "TORCH_CUDA_SANITIZER=1 did not enable CSAN"}
        return "FAIL"
    races: dict[str, Any] = {}

    def guarded(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        # A race raises out of the op's dispatch: count it instead of failing the step.
        def run() -> dict[str, Any]:
            try:
                r = fn()
                races[name] = 0
                return r
            except csan.CUDASanitizerErrors as e:
                races[name] = len(e.errors)
                return {"status": "RACE", "errors": [str(x)[:2000] for x in e.errors[:3]]}
        rep.step(name, run)

    rep.step("cases", lambda: step_cases(iface, specs, device))
    races["cases"] = sum(c.get("races", 0) for c in
                         rep.doc["steps"]["cases"].get("cases", {}).values())
    if device == "cuda":
        stream_spec = next((s for s in specs if s.kind != "swa"), specs[0])
        guarded("streams", lambda: step_streams(iface, stream_spec))

        def control() -> dict[str, Any]:
            try:
                _stream_run(iface, C.build_case(stream_spec), fence_fork=False)
            except csan.CUDASanitizerErrors as e:
                torch.cuda.synchronize()  # the unfenced launch may still run: quiesce
                return {"status": "DETECTED", "races": len(e.errors),
                        "first": str(e.errors[0])[:2000]}
            return {"status": "MISSED"}
        rep.step("control_no_fork_fence", control)
    rep.doc["races"] = races
    ok = (all(v == 0 for v in races.values())
          and all(rep.doc["steps"][k].get("status") == "PASS" for k in races))
    if device == "cuda":
        ok = ok and rep.doc["steps"]["control_no_fork_fence"]["status"] == "DETECTED"
    return "PASS" if ok else "FAIL"


# ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=str(bundle_mod.DEFAULT_DEST))
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: real bundle and load report, then a CPU stand-in op")
    ap.add_argument("--cases", default=",".join(s.name for s in C.CASES),
                    help="comma-separated case names (default: all)")
    ap.add_argument("--no-sanitizer", action="store_true")
    ap.add_argument("--sanitizer-timeout", type=float, default=240.0)
    ap.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    known = {s.name: s for s in C.CASES}
    unknown = [c for c in args.cases.split(",") if c not in known]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; known: {sorted(known)}")
    args.bundle = os.path.abspath(args.bundle)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run and "OMP_NUM_THREADS" not in os.environ:
        # A plumbing check on shared CI cores: one thread (several oversubscribe them and
        # run many times slower); on the box the reference keeps every core.
        torch.set_num_threads(1)
    specs = [s for s in C.CASES if s.name in args.cases.split(",")]
    rep = Report(args.out, {
        "schema": 1, "tool": "tools/gpu_flashmla/check.py", "dry_run": args.dry_run,
        "mode": "sanitizer-child" if args.sanitizer_child else "main",
        "argv": sys.argv[1:] if argv is None else argv, "bundle_dir": args.bundle,
        "cases": [s.name for s in specs], "steps": {}, "status": "RUNNING"})
    rep.write()
    env = rep.step("env", step_env)

    def bundle() -> dict[str, Any]:
        v = bundle_mod.verify_bundle(args.bundle)
        return dict(v, status="OK" if v["ok"] else "FAIL")
    rep.step("bundle", bundle)
    holder: dict[str, Any] = {}

    def load() -> dict[str, Any]:
        r, holder["iface"] = step_load(args.bundle, args.dry_run)
        return r
    loaded = rep.step("load", load)
    iface = holder.get("iface")
    cuda = bool(env.get("cuda_available")) and not args.dry_run
    device = "cuda" if cuda else "cpu"
    if iface is None or (not cuda and not args.dry_run):
        why = ("FlashMLA did not load" if iface is None else "no CUDA (use --dry-run)")
        rep.doc["status"] = f"FAIL: {why}"
        rep.write()
        print(f"flashmla check: {rep.doc['status']}; {args.out}")
        return 1
    if args.sanitizer_child:
        rep.doc["status"] = child_main(args, rep, iface, specs, device)
        rep.write()
        return 0 if rep.doc["status"] == "PASS" else 1
    rep.step("cases", lambda: step_cases(iface, specs, device))
    graph_spec = next((s for s in specs if s.kind == "c4a"), specs[0])
    for name, fn in (("graph", lambda: step_graph(iface, graph_spec)),
                     ("streams", lambda: step_streams(iface, graph_spec))):
        rep.step(name, fn if cuda else lambda: {"status": "SKIPPED", "why": "needs CUDA"})
    rep.step("sanitizer", (lambda: {"status": "SKIPPED", "why": "--no-sanitizer"})
             if args.no_sanitizer else (lambda: step_sanitizer(args)))
    ok_states = ("OK", "PASS", "SKIPPED")
    bad = [k for k, v in rep.doc["steps"].items()
           if v.get("status") not in ok_states and not (k == "load" and args.dry_run)]
    summary = "PASS" if not bad else "FAIL: " + ", ".join(bad)
    rep.doc["status"] = ("DRY-RUN " if args.dry_run else "") + summary
    rep.doc["flashmla_loaded"] = bool(loaded.get("loaded"))
    rep.write()
    print(f"flashmla check: {rep.doc['status']} (FlashMLA loaded: "
          f"{rep.doc['flashmla_loaded']}, kernel {loaded.get('kernel')}); {args.out}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
