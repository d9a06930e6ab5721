# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mutation runner: every mutant of ``mutants.py`` must be killed.

    .venv/bin/python tools/mutants/run.py [--only NAME,...] [--json FILE] [--full] [--jobs N]

For each mutant: copy the package, ``tools/`` and ``tests/`` into a
temporary folder, apply the one edit there (the working tree is never
touched), then run checks until one reports the bug's symptom: the
mutant's ``hint`` first, then (with ``--full``, or when the hint does not
kill it) every check in ``CHECKS``: the test files, the negative controls
and every harness mode (``modes.MODES``) but those :data:`NOT_RUN` names
with its reason. Each check imports the copy (``PYTHONPATH``; checked).

A mutant is *killed* only by a symptom of the bug (:func:`symptom`): a race
(the detector's, or a workspace access on a stream its lease never
declared), wrong bits, a contract difference, or a refusal (the
workspace's, a recording stand-in's, the emulated CUDA's), or a failed
assertion of a test. A check that fails otherwise (an exception, a
timeout) is listed apart as a *crash* and kills nothing. Prints one line
per mutant and the mutation score; exit 1 unless every mutant is killed, 2
when the environment is missing (the vLLM 0.34 venv for the stub and
``tests/cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from mutants import MUTANTS, Mutant

REPO = Path(__file__).resolve().parents[2]
VENV_PY = REPO / ".venv" / "bin" / "python"
CUDA_VENV = REPO / ".venv-vllm034"
# A hang guard per check, not a budget: in CI the runner shares the CPU (at nice 15)
# with the engine tests, and a harness mode alone takes up to ~2 minutes.
TIMEOUT = 1800
sys.path.insert(0, str(REPO / "tools" / "cuda_graph"))
from modes import MODES  # noqa: E402  (the harness's mode table; imports torch only)

# Harness modes no mutant needs to be checked in, each with the reason.
NOT_RUN = {m.name: "needs a GPU: scripts/gpu_check.sh runs it on the lent box"
           for m in MODES if m.where == "cuda"}
NOT_RUN["mrv1"] = NOT_RUN["sim-piecewise-mrv1"] = NOT_RUN["sim-serve-mrv1"] = (
    "vLLM 0.33 only; the runner's stub is 0.34's (tests/cuda runs them in .venv-vllm033)")
# The full list, cheapest first; the hint of each mutant runs before these.
CHECKS = (
    "pytest:tests/cuda/test_structure.py",
    "pytest:tests/cuda/test_layer_streams.py",
    "contract:eager",
    "contract:sim-eager",
    "control:no_fence",
    *(f"harness:{m.name}" for m in MODES if m.name not in NOT_RUN),
    "pytest:tests/core/test_workspace.py",
    "pytest:tests/core/test_stream_schedule.py",
)
# What a failing check says when it reports the bug itself (see symptom()).
REFUSALS = ("WorkspaceLeaseError", "WorkspaceCapacityError", "ContractError", "SimCudaError")


def _copy(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "data")
    for d in ("vllm_dsv4_backend", "tools", "tests"):
        shutil.copytree(REPO / d, dst / d, ignore=ignore)
    (dst / "tests" / "data").mkdir(exist_ok=True)
    # pytest's configuration travels with the copy: without it pytest searches the
    # folders above the copy for one, and a temporary folder inside a checkout
    # (TMPDIR there) would put that checkout's package first on sys.path.
    shutil.copy2(REPO / "pyproject.toml", dst / "pyproject.toml")


def _pytest_cmd(py: Path, root: Path, *args: str) -> list[str]:
    return [str(py), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
            "-c", str(root / "pyproject.toml"), "--rootdir", str(root), *args]


def apply(m: Mutant, root: Path) -> None:
    p = root / m.path
    text = p.read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutant {m.name}: expected its text once in {m.path}, found {n}")
    p.write_text(text.replace(m.old, m.new))


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    return p.returncode, (p.stdout + p.stderr)[-2000:]


def symptom(what: str, report: dict, tail: str) -> str | None:
    """The bug's symptom a failed check reports, or None (a crash)."""
    if what == "pytest":
        return "a test assertion" if "AssertionError" in tail or "\nE       assert" in tail \
            else None
    found = []
    for name, c in report.get("contract", {}).items():
        if c.get("diff"):
            found.append(f"contract difference ({name})")
    for name, entry in report.get("modes", {}).items():
        for impl, res in entry.items():
            err = res.get("error", "")
            refusal = next((r for r in REFUSALS if r in err), None)
            if refusal:
                found.append(f"refusal: {refusal} ({name})")
            elif err:
                continue  # an exception of another kind: a crash
            races = res.get("races", {})
            if races.get("races") or races.get("undeclared_stream_accesses"):
                found.append(f"race ({name} {impl})")
            if res.get("bitwise_equal") is False:
                found.append(f"wrong bits ({name} {impl})")
    for name, ctl in report.get("controls", {}).items():
        if ctl.get("detected") is False and "error" not in ctl:
            found += _control_symptoms(name, ctl)
    return "; ".join(found[:3]) or None


def _control_symptoms(name: str, ctl: dict) -> list[str]:
    """The runs of a negative control that must be clean (fences on, record_stream
    kept), where they race or corrupt. A fault the control stops seeing is not
    a symptom of the bug."""
    good: list[tuple[str, dict]] = [("", {"mismatches": ctl.get("mismatches_with_fences")})]
    for order in ("lazy", "random"):
        if isinstance(ctl.get(order), dict):
            good.append((order, {"mismatches": ctl[order].get("mismatches_with_fences"),
                                 "races": ctl[order].get("races_with_fences")}))
    for part, key in (("off", "with_record_stream"), ("captured", "with_fences")):
        if isinstance(ctl.get(part), dict):
            good.append((part, ctl[part].get(key, {})))
    out = []
    for part, res in good:
        where = f"control {name}{' ' + part if part else ''}"
        if res.get("races"):
            out.append(f"race ({where}: {res['races']})")
        if res.get("mismatches"):
            out.append(f"wrong bits ({where}: {res['mismatches']} words)")
    return out


def check(kind: str, root: Path, stub: Path) -> tuple[str, str]:
    """``killed`` (the check reports the bug's symptom), ``crashed`` (it fails
    otherwise) or ``passed``, with the evidence."""
    what, _, arg = kind.partition(":")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", None)
    out = root / f"report-{what}-{arg.replace('/', '_')}.json"
    if what == "pytest":
        py = CUDA_VENV / "bin" / "python" if arg.startswith("tests/cuda") else VENV_PY
        env["PYTHONPATH"] = str(root)
        cmd = _pytest_cmd(py, root, arg)
    else:
        env["PYTHONPATH"] = f"{stub}{os.pathsep}{root}"
        # contract: both layers, their kernel calls compared; else the plugin's alone.
        impls = "plugin,vllm" if what == "contract" else "plugin"
        cmd = [str(VENV_PY), str(root / "tools" / "cuda_graph" / "harness.py"), "--steps", "2",
               "--impls", impls, "--fail-fast", "--json", str(out)]
        if what in ("harness", "contract"):
            cmd += ["--modes", arg, "--controls", ""]
        else:
            cmd += ["--modes", "eager", "--controls", arg]
    rc, tail = _run(cmd, env, root)
    if rc == 0:
        return "passed", tail
    try:
        report = json.loads(out.read_text()) if out.exists() else {}
    except ValueError:
        report = {}
    found = symptom(what, report, tail)
    if found is None:
        return "crashed", f"(failed without a symptom of the bug)\n{tail}"
    return "killed", f"{found}\n{tail}"


def _imports_copy(root: Path, stub: Path) -> None:
    """Each interpreter, bare and under pytest as the checks run it, must import the
    package from the copy, not the checkout."""
    probe = root / "tests" / "test_mutant_probe.py"
    probe.write_text("import vllm_dsv4_backend as p\n\n\ndef test_copy():\n"
                     f"    assert p.__file__.startswith({str(root)!r}), p.__file__\n")
    try:
        for py, path in ((VENV_PY, f"{stub}{os.pathsep}{root}"),
                         (CUDA_VENV / "bin" / "python", str(root))):
            env = dict(os.environ, PYTHONPATH=path)
            out = subprocess.run(
                [str(py), "-c", "import vllm_dsv4_backend as p; print(p.__file__)"],
                env=env, capture_output=True, text=True, cwd=root)
            if not out.stdout.strip().startswith(str(root)):
                raise SystemExit(f"mutants: {py} imports {out.stdout.strip() or out.stderr[-300:]},"
                                 f" not the copy under {root}")
            rc, tail = _run(_pytest_cmd(py, root, str(probe)), env, root)
            if rc != 0:
                raise SystemExit(f"mutants: pytest under {py} does not import the copy under "
                                 f"{root}:\n{tail}")
    finally:
        probe.unlink()


def build_stub(tmp: Path) -> Path:
    where = ("import importlib.util, os; "
             "print(os.path.dirname(importlib.util.find_spec('vllm').origin))")
    src = subprocess.run([str(CUDA_VENV / "bin" / "python"), "-c", where], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=""))
    stub = tmp / "stub"
    subprocess.run([str(VENV_PY), str(REPO / "tools" / "cuda_graph" / "build_stub.py"),
                    "--vllm-src", src.stdout.strip(), "--out", str(stub)], check=True,
                   capture_output=True)
    return stub


def _run_mutant(m: Mutant, tmp: Path, stub: Path, full: bool) -> dict:
    """Apply ``m`` to its own copy under ``tmp`` and run checks until one kills it."""
    root = tmp / m.name
    _copy(root)
    apply(m, root)
    order = [m.hint] + [c for c in CHECKS if c != m.hint]
    killed_by: list[str] = []
    crashed_in: list[str] = []
    found: list[str] = []  # the symptom each killing check reported
    tail = ""
    t = time.time()
    for c in order:
        verdict, out = check(c, root, stub)
        if verdict == "killed":
            killed_by.append(c)
            found.append(out.splitlines()[0])
            tail = out
            if not full:
                break
        elif verdict == "crashed":
            crashed_in.append(c)
            tail = tail or out
        elif c == m.hint:
            tail = f"(hint {c} did not kill it)"
    shutil.rmtree(root, ignore_errors=True)
    return {"mutant": m.name, "bug_class": m.bug_class, "file": m.path,
            "killed": bool(killed_by), "killed_by": killed_by, "symptoms": found,
            "crashed_in": crashed_in,
            "seconds": round(time.time() - t, 1), "evidence": tail[-600:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--full", action="store_true",
                    help="run every check for every mutant (which checks kill which)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="mutants checked at once, each on its own copy (default 1)")
    args = ap.parse_args(argv)
    if not (CUDA_VENV / "bin" / "python").exists() or not VENV_PY.exists():
        print("mutants: needs .venv and .venv-vllm034 (bash scripts/setup_vllm_cuda.sh 0.34)")
        return 2
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    for mode, why in NOT_RUN.items():
        print(f"[mode  ] {mode:28s} not run for mutants: {why}")
    results = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dsv4-mutants-") as tmp_s:
        tmp = Path(tmp_s)
        stub = build_stub(tmp)
        probe = tmp / "probe"
        _copy(probe)
        _imports_copy(probe, stub)
        shutil.rmtree(probe, ignore_errors=True)
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(_run_mutant, m, tmp, stub, args.full) for m in chosen]
            for fut in as_completed(futures):
                r = fut.result()
                results.append(r)
                state = "KILLED" if r["killed"] else "SURVIVED"
                print(f"[mutant] {r['mutant']:42s} {state} "
                      f"by {', '.join(r['killed_by']) or '-'} ({r['seconds']} s)"
                      + (f"; symptom: {r['symptoms'][0][:120]}" if r["killed"] else "")
                      + (f"; crashed (not a kill): {', '.join(r['crashed_in'])}"
                         if r["crashed_in"] else ""), flush=True)
    order = {m.name: i for i, m in enumerate(chosen)}
    results.sort(key=lambda r: order[r["mutant"]])
    killed = sum(r["killed"] for r in results)
    score = 100.0 * killed / len(results) if results else 0.0
    crashed = sum(bool(r["crashed_in"]) for r in results)
    print(f"mutation score: {killed}/{len(results)} killed by a symptom of the bug "
          f"({score:.0f} %) in {time.time() - t0:.0f} s; {crashed} crashed a check "
          "somewhere (listed apart, never counted)")
    # The plain closing line a CI reads: a killed mutant is a passed check.
    print(f"mutants: {killed} passed, {len(results) - killed} failed")
    if args.json:
        Path(args.json).write_text(json.dumps({"score": score, "killed": killed,
                                               "mutants": results}, indent=1))
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
