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
import os
import platform
import sys
import traceback
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repo is the package root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tools.gpu_flashmla import bundle as bundle_mod  # noqa: E402
from tools.gpu_flashmla import cases as C  # noqa: E402
from tools.gpu_flashmla import runs, sanitizer  # noqa: E402
from tools.gpu_flashmla.report import Report  # noqa: E402

DEFAULT_OUT = os.path.join(os.environ.get("OUT") or str(ROOT / ".scratch" / "gpu_check"),
                           "flashmla_check.json")


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
        rep.doc["status"] = sanitizer.child_main(args, rep, iface, specs, device)
        rep.write()
        return 0 if rep.doc["status"] == "PASS" else 1
    rep.step("cases", lambda: runs.step_cases(iface, specs, device))
    graph_spec = next((s for s in specs if s.kind == "c4a"), specs[0])
    for name, fn in (("graph", lambda: runs.step_graph(iface, graph_spec)),
                     ("streams", lambda: runs.step_streams(iface, graph_spec))):
        rep.step(name, fn if cuda else lambda: {"status": "SKIPPED", "why": "needs CUDA"})
    rep.step("sanitizer", (lambda: {"status": "SKIPPED", "why": "--no-sanitizer"})
             if args.no_sanitizer else (lambda: sanitizer.step_sanitizer(args)))
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
