# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sanitizer pass: ``check.py`` again in a subprocess under ``TORCH_CUDA_SANITIZER=1``
(PyTorch's CUDA Sanitizer checks every kernel's reads and writes against the streams'
event/wait order and raises ``CUDASanitizerErrors`` on an unordered pair)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tools.gpu_flashmla import cases as C
from tools.gpu_flashmla import runs
from tools.gpu_flashmla.report import Report

__all__ = ["child_main", "step_sanitizer"]

CHECK = Path(__file__).with_name("check.py")


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
        cmd = [sys.executable, str(CHECK), "--sanitizer-child",
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

    rep.step("cases", lambda: runs.step_cases(iface, specs, device))
    races["cases"] = sum(c.get("races", 0) for c in
                         rep.doc["steps"]["cases"].get("cases", {}).values())
    if device == "cuda":
        stream_spec = next((s for s in specs if s.kind != "swa"), specs[0])
        guarded("streams", lambda: runs.step_streams(iface, stream_spec))

        def control() -> dict[str, Any]:
            try:
                runs.stream_run(iface, C.build_case(stream_spec), fence_fork=False)
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
