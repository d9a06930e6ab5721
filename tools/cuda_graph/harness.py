# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's unmodified CUDA layer driven by vLLM's own control flow.

Run with the generated stand-in ``vllm`` first on the path::

    PYTHONPATH=build/vllm_stub/0.34:. python tools/cuda_graph/harness.py --json out.json

Seven layers (compress ratios 1, 4, 128, 4, 128, 4, 1) of the plugin's
``DSV4FlashMLAAttention`` and of vLLM's ``DeepseekV4FlashMLAAttention``
(vLLM's verbatim bodies, ``build_stub.py``), two micro-batches of mixed
decode + prefill, several steps (``model.py``), in every mode of
``modes.MODES`` this machine runs; each mode's output (the residual stream
after the last layer) is compared bit for bit with a serial reference of the
same class (no streams, workspace ``off``), and the plugin's with vLLM's.

The rooms: ``model.py`` (layers, caches, metadata, allocation meter),
``modes.py`` (eager / PIECEWISE / FULL, vLLM's micro-batch threads, the mode
table), ``simcuda.py`` (CUDA streams, events and graphs emulated on CPU:
vLLM's fork / join / ``add_eager`` / capture code runs as on a GPU),
``races.py`` (PyTorch's CUDA-sanitizer core as a happens-before race
detector over the emulator's trace), ``coverage.py`` (line coverage of the
cut fork / join / eager-break / capture / micro-batch bodies),
``controls.py`` (comparisons and negative controls), ``standins.py`` (the
kernels), this file (the driver and the JSON report).

The ``sim-*`` modes are the CPU evidence for the CUDA layer's lifetime
safety: vLLM's aux-stream fan-out and join, its micro-batch threads handing
over at the MoE all-to-all, breakable PIECEWISE capture with its eager break
replayed outside the captured region, FULL capture of both micro-batch
threads; side streams executed as late as CUDA allows (``lazy``) or in
random prefixes, micro-batches also interleaved at every kernel
(``sim-eager-yield``), the workspace's debug poisoning (``*-debug``), a
pipeline stage holding layers 3-6 (``sim-stage``), the ``off`` policy through
the caching-allocator model (``sim-off*``), and a served process
(``sim-serve*``, ``serve.py``): FULL, PIECEWISE and eager steps with
micro-batches on and off interleaved over one workspace and one graph pool,
FP8 and MXFP4 indexers. Each reports races (capture included; must be 0),
workspace accesses on a stream the holding lease never declared (must be 0),
leases per step (must be what ``LEASE_PLAN`` gives: eager every family,
PIECEWISE replay the C4 top-k, FULL replay none) and allocations. Every
emulated mode allocates through ``allocator.py``'s model of PyTorch's
caching allocator and graph pools.

Negative controls (must be detected): (a) the workspace's no-fence switch
under ``testing.schedule``'s fork-free fan-out (CPU simulated streams, the
plugin's ``GraphSafeCudaStreamBackend`` over the emulator, also captured in
one graph, and the ``off`` policy without its ``record_stream``; CUDA real
streams); (b) a wrong stand-in (top-k shifted by one); (c) vLLM's
``execute_in_parallel`` without its join: the race detector must report it.
The capture lint: no host sync in a FULL-mode forward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from controls import control_no_fence_schedule, diff, host_sync_lint, join_removed
from model import DECODES, NUM_UBATCHES, PREFILL, RATIOS, Model, _stub
from modes import MODE_BY_NAME, MODES, Mode, emulated, pattern, run_eager, run_mode
from serve import SCHEDULE, SERVE_BATCHES
from serve import reference as serve_reference


def _write(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def default_modes(version: str, device: torch.device,
                  where: tuple[str, ...] = ("cpu", "sim", "cuda"),
                  extended: bool = False) -> list[str]:
    out = []
    for m in MODES:
        if m.where not in where or (m.extended and not extended):
            continue
        if m.mrv1 and not version.startswith("0.33."):
            continue  # MRV1 (_prepare_and_attn_eager) is 0.33's only
        if not extended and not any(version.startswith(v + ".") for v in m.versions):
            continue
        if m.where == "cuda" and device.type != "cuda":
            continue
        out.append(m.name)
    return out


def _error(e: BaseException) -> dict[str, Any]:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


CONTROLS = ("wrong_standin", "no_join", "no_fence")


def run_all(modes: list[str] | None = None, steps: int = 3, device: str | None = None,
            seed: int = 0, log: Callable[[str], None] = print,
            json_path: str | None = None, impls: tuple[str, ...] = ("plugin", "vllm"),
            controls_wanted: tuple[str, ...] = CONTROLS, fail_fast: bool = False,
            where: tuple[str, ...] = ("cpu", "sim", "cuda"),
            layers: str | None = None, extended: bool = False) -> dict[str, Any]:
    """Every mode, the comparisons and the controls; with ``json_path`` the
    report is rewritten after each mode (``complete`` false until the end), so
    a run killed by a timeout still leaves what it did. ``impls``, the
    controls and ``fail_fast`` (stop at the first failure) narrow a run (the
    mutation runner's); ``layers`` runs the serving modes over another layer
    pattern (``flash``: DeepSeek-V4-Flash's 43 layers)."""
    from coverage import Coverage

    vllm = _stub()
    from vllm._harness_recording import contract_diff

    # One CPU thread by default: OpenMP threads sharing busy cores collapse, and the
    # tensors here are small (HARNESS_THREADS to change it).
    torch.set_num_threads(int(os.environ.get("HARNESS_THREADS", "1")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    version = vllm.__version__
    # Every key line must run only when every emulated mode does.
    full_run = modes is None and "sim" in where
    if modes is None:
        modes = default_modes(version, dev, where, extended)
    unknown = [m for m in modes if m not in MODE_BY_NAME]
    if unknown:
        raise SystemExit(f"harness: unknown modes {unknown}; known: {sorted(MODE_BY_NAME)}")
    from races import TESTED_TORCH, self_check, torch_version_tested

    report: dict[str, Any] = {"vllm": version, "stub": os.path.dirname(vllm.__file__),
                              "torch": torch.__version__, "device": str(dev), "steps": steps,
                              "ratios": list(RATIOS), "ubatches": NUM_UBATCHES,
                              "serve": {"layers": layers or "each mode's",
                                        "schedule": [f"{s.graph}{'+dbo' if s.dbo else ''}:"
                                                     f"{s.batch.tokens}" for s in SCHEDULE]},
                              "tokens_per_ubatch": DECODES + PREFILL, "modes": {},
                              "contract": {}, "controls": {}, "complete": False,
                              "ok": False}
    detector = self_check()
    report["race_detector"] = {"self_check": detector, "torch_tested": list(TESTED_TORCH),
                               "torch_version_tested": torch_version_tested()}
    ok = bool(detector["ok"])
    t0 = time.time()
    refs: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def reference(impl: str, where: torch.device, stage: Any = None,
                  mode: Mode | None = None) -> list[torch.Tensor]:
        """The serial run (no streams, workspace ``off``) a mode must equal."""
        serving = mode is not None and mode.run == "serve"
        key = (impl, where.type, stage,
               (layers or mode.layers, mode.indexer) if serving and mode else None)
        if key not in refs:
            if serving and mode is not None:
                m = Model(impl, where, seed, policy="off", aux_streams=False,
                          ratios=pattern(layers or mode.layers), batches=SERVE_BATCHES,
                          indexer=mode.indexer)
                refs[key] = serve_reference(m, SCHEDULE)
            else:
                m = Model(impl, where, seed, policy="off", aux_streams=False, layers=stage)
                refs[key] = run_eager(m, steps)["outputs"]
        return refs[key]

    cov = Coverage()
    for name in modes:
        mode = MODE_BY_NAME[name]
        where = dev if mode.where == "cuda" else torch.device("cpu")
        entry: dict[str, Any] = {}
        for impl in impls:
            if mode.policy != "shared" and impl == "vllm":
                continue  # a workspace policy: vLLM's layer has none
            if impl == "vllm" and not mode.vllm_layer and not extended:
                continue  # its calls are another mode's (Mode.vllm_layer)
            t_mode = time.time()
            try:
                res, cmp = _run_seeds(mode, impl, seed, steps, cov, layers,
                                      reference(impl, where, mode.stage, mode))
            except Exception as e:  # noqa: BLE001 - keep going: the other modes still tell
                res, cmp = _error(e), {"bitwise_equal": False}
                log(f"[{name:20s}] {impl:6s} ERROR {res['error']}")
            res.update(cmp)
            res["seconds"] = round(time.time() - t_mode, 1)
            if "leases_per_step" in res:
                n = len(res["leases_per_step"])
                want = (res.pop("leases_expected_per_step", None)
                        or [mode.expected_leases(layers=layers)] * n)
                if impl != "plugin":
                    want = [0] * n
                res["leases_as_expected"] = res["leases_per_step"] == want
                ok &= res["leases_as_expected"]
            # An access on a stream the holding lease never declared counts as a race.
            races = (res.get("races", {}).get("races", 0)
                     + res.get("races", {}).get("undeclared_stream_accesses", 0))
            entry[impl] = res
            ok &= bool(cmp["bitwise_equal"]) and races == 0
            if "error" not in res:
                log(f"[{name:20s}] {impl:6s} bitwise={cmp['bitwise_equal']} "
                    f"leases/step={res['leases_per_step']} "
                    f"allocs/step={res['allocations_per_step']}"
                    + (f" races={races}" if "races" in res else "")
                    + (f" fences dropped={res['fences_dropped']}"
                       if "fences_dropped" in res else ""))
        if "plugin" in entry and "vllm" in entry and "error" not in entry["plugin"] \
                and "error" not in entry["vllm"]:
            # The adapter held to vLLM's own calls: same kernels, order, streams and
            # tensor metadata, but for the workspace's storages (recording.py).
            calls = (entry["plugin"].pop("kernel_calls"), entry["vllm"].pop("kernel_calls"))
            cdiff = contract_diff(*calls)
            report["contract"][name] = {"kernel_calls": [len(c) for c in calls],
                                        "kernels": sorted({e["kernel"] for e in calls[0]}),
                                        "diff": cdiff}
            ok &= not cdiff
            log(f"[{name:20s}] contract: {len(calls[0])} kernel calls, "
                + ("same as vLLM's layer" if not cdiff else f"DIFFERS {cdiff[:3]}"))
        for res in entry.values():
            res.pop("kernel_calls", None)
        report["modes"][name] = entry
        if json_path:
            _write(json_path, report)
        if fail_fast and not ok:
            report["seconds"] = round(time.time() - t0, 1)
            log(f"harness: stopped at {name} (--fail-fast)")
            return report
    report["coverage"] = cov.report()
    if full_run and any(MODE_BY_NAME[m].where == "sim" for m in modes):
        # Every key line of vLLM's fork / join / eager break / capture / hand-over ran.
        missed = [f"{b}: {k}" for b, r in report["coverage"].items()
                  for k, hit in r["key_lines"].items() if not hit]
        missed += [f"{b}: {k} (not found)" for b, r in report["coverage"].items()
                   for k in r["missing_key_lines"]]
        report["coverage_all_key_lines_hit"] = not missed
        report["coverage_missed"] = missed
        ok &= not missed
        log("[coverage            ] vLLM's cut bodies: "
            + ("every key line hit" if not missed else f"MISSED {missed}"))

    if fail_fast and not ok:
        report["seconds"] = round(time.time() - t0, 1)
        return report
    # The plugin's layer and vLLM's compute the same bits (same stand-ins).
    for where in ({torch.device("cpu")} | ({dev} if dev.type == "cuda" else set())
                  if "vllm" in impls else set()):
        try:
            same = diff(reference("plugin", where), reference("vllm", where))
        except Exception as e:  # noqa: BLE001 - reported as not equal
            same = {"bitwise_equal": False}
            report[f"plugin_equals_vllm_{where.type}_error"] = f"{type(e).__name__}: {e}"
        report[f"plugin_equals_vllm_{where.type}"] = same["bitwise_equal"]
        ok &= same["bitwise_equal"]
        log(f"plugin == vLLM ({where.type} reference): {same['bitwise_equal']}")

    for impl in impls:
        syncs = host_sync_lint(impl, seed)
        report.setdefault("host_syncs_in_forward_cpu", {})[impl] = syncs
        ok &= not syncs
        log(f"[capture lint        ] {impl:6s} host syncs in one forward: {syncs or 'none'}")

    report["controls"] = controls(dev, seed, steps, reference, log, json_path, report,
                                  controls_wanted)
    for ctl in report["controls"].values():
        if "detected" in ctl:
            ok &= bool(ctl["detected"])
    report["ok"] = bool(ok)
    report["complete"] = True
    report["seconds"] = round(time.time() - t0, 1)
    return report


def _run_seeds(mode: Mode, impl: str, seed: int, steps: int, cov: Any, layers: str | None,
               ref: list[torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``mode.seeds`` runs, the emulator's order drawn from ``seed``, ``seed + 1``, ...:
    the first run's report with every run's races added and its comparison, or
    the first that differs."""
    res: dict[str, Any] = {}
    cmp: dict[str, Any] = {}
    per_seed = []
    for k in range(mode.seeds):
        r = run_mode(mode, impl, seed, steps, cov if mode.where == "sim" else None,
                     order_seed=seed + k, layers=layers)
        c = diff(r.pop("outputs"), ref)
        per_seed.append({"order_seed": seed + k, "bitwise_equal": c["bitwise_equal"],
                         "races": r.get("races", {}).get("races", 0)})
        if not res:
            res, cmp = r, c
        else:
            res["races"]["races"] += r["races"]["races"]
            for k in ("races_in_capture", "undeclared_stream_accesses"):
                res["races"][k] += r["races"][k]
            res["races"]["first"] += r["races"]["first"][:4]
            if cmp["bitwise_equal"] and not c["bitwise_equal"]:
                cmp = c
    if mode.seeds > 1:
        res["seeds"] = per_seed
    return res, cmp


def controls(dev: torch.device, seed: int, steps: int, reference: Callable[..., Any],
             log: Callable[[str], None], json_path: str | None,
             report: dict[str, Any], wanted: tuple[str, ...] = CONTROLS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "wrong_standin" in wanted:
        out.update(_control_wrong_standin(seed, steps, reference, log))
    if "no_join" in wanted:
        out.update(_control_no_join(seed, steps, reference, log))
    if "no_fence" in wanted:
        out.update(_control_no_fence(dev, log, json_path, report, out))
    if dev.type == "cuda" and "cuda-eager" in report["modes"]:
        out.update(_info_no_fence_cuda(dev, seed, steps, reference))
    return out


def _control_wrong_standin(seed: int, steps: int, reference: Callable[..., Any],
                           log: Callable[[str], None]) -> dict[str, Any]:
    """(b) a wrong stand-in must be caught."""
    from vllm import _harness_standins as S

    out: dict[str, Any] = {}
    S.FAULTS["topk_off_by_one"] = True
    try:
        m = Model("plugin", torch.device("cpu"), seed, policy="shared", aux_streams=False)
        wrong = diff(run_eager(m, steps)["outputs"], reference("plugin", torch.device("cpu")))
    finally:
        S.FAULTS["topk_off_by_one"] = False
    out["wrong_standin_topk_off_by_one"] = {
        "steps_differing": wrong["steps_differing"], "detected": not wrong["bitwise_equal"]}
    log(f"[control b] top-k off by one detected={not wrong['bitwise_equal']} "
        f"(steps differing {wrong['steps_differing']})")
    return out


def _control_no_join(seed: int, steps: int, reference: Callable[..., Any],
                     log: Callable[[str], None]) -> dict[str, Any]:
    """(c) vLLM's own fan-out with its join removed: the race detector must see it."""
    out: dict[str, Any] = {}
    try:
        res = run_mode(Mode("sim-eager-lazy-nojoin", "sim", order="lazy", dbo=True),
                       "plugin", seed, steps, fault=join_removed)
        nojoin = {"races": res["races"]["races"], "first": res["races"]["first"][:3],
                  "bitwise_equal": diff(res["outputs"],
                                        reference("plugin", torch.device("cpu")))[
                                            "bitwise_equal"]}
        nojoin["detected"] = nojoin["races"] > 0
    except Exception as e:  # noqa: BLE001 - reported, counts as not detected
        nojoin = {**_error(e), "detected": False}
    out["no_join_execute_in_parallel"] = nojoin
    log(f"[control c] join removed: races={nojoin.get('races')} "
        f"bitwise={nojoin.get('bitwise_equal')} detected={nojoin['detected']}")
    return out


def _control_no_fence(dev: torch.device, log: Callable[[str], None], json_path: str | None,
                      report: dict[str, Any], done: dict[str, Any]) -> dict[str, Any]:
    """(a) the no-fence switch, on each kind of streams."""
    out: dict[str, Any] = {}
    wheres: list[tuple[str, Any]] = [("cpu", None), ("sim", emulated)]
    if dev.type == "cuda":
        wheres.append(("cuda", None))
    for label, sim in wheres:
        try:
            ctl = control_no_fence_schedule(dev if label == "cuda" else torch.device("cpu"),
                                            sim=sim)
        except Exception as e:  # noqa: BLE001 - reported, counts as not detected
            ctl = {**_error(e), "detected": False, "mismatches_without_fences": None,
                   "mismatches_with_fences": None}
        out[f"no_fence_schedule_{label}"] = ctl
        log(f"[control a/{label}] no-fence corrupt={ctl['mismatches_without_fences']} "
            f"fenced={ctl['mismatches_with_fences']} detected={ctl['detected']}"
            + (f" ERROR {ctl['error']}" if "error" in ctl else ""))
        if json_path:
            report["controls"] = {**done, **out}
            _write(json_path, report)
    return out


def _info_no_fence_cuda(dev: torch.device, seed: int, steps: int,
                        reference: Callable[..., Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    note = "information only: vLLM's own fork/join orders every hand-over"
    from controls import env

    try:
        with env(VLLM_DSV4_TEST_UNSAFE_NO_FENCES="1"):
            res = run_mode(MODE_BY_NAME["cuda-eager"], "plugin", seed, steps)
        info = diff(res["outputs"], reference("plugin", dev))
        out["info_no_fence_on_vllm_flow_cuda"] = {"bitwise_equal": info["bitwise_equal"],
                                                  "note": note}
    except Exception as e:  # noqa: BLE001 - information only
        out["info_no_fence_on_vllm_flow_cuda"] = {**_error(e), "note": note}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CUDA-graph harness for the plugin's CUDA layer")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--modes", help="comma-separated (default: every mode this device runs)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--impls", default="plugin,vllm", help="layer classes to run")
    ap.add_argument("--controls", default=",".join(CONTROLS),
                    help=f"negative controls to run (of {','.join(CONTROLS)}; '' for none)")
    ap.add_argument("--fail-fast", action="store_true", help="stop at the first failure")
    ap.add_argument("--where", default="cpu,sim,cuda",
                    help="default modes of these kinds: cpu, sim (emulated CUDA), cuda")
    ap.add_argument("--extended", action="store_true",
                    help="also the extended modes (more orders and seeds, the debug serving "
                    "schedule), every mode on every vLLM version, vLLM's layer in every mode")
    ap.add_argument("--layers", help="the serving modes' layer pattern (default: each "
                    "mode's; 'flash': DeepSeek-V4-Flash's 43 layers)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",") if args.modes else None
    report = run_all(modes, steps=args.steps, device=args.device, json_path=args.json,
                     impls=tuple(x for x in args.impls.split(",") if x),
                     controls_wanted=tuple(x for x in args.controls.split(",") if x),
                     fail_fast=args.fail_fast,
                     where=tuple(x for x in args.where.split(",") if x), layers=args.layers,
                     extended=args.extended)
    if args.json:
        _write(args.json, report)
    print(f"harness: vLLM {report['vllm']} stub, {report['device']}: "
          f"{'OK' if report['ok'] else 'FAILED'} in {report['seconds']} s")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
