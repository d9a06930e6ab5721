# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An exception inside one attention layer's eager step, in a real vLLM engine.

Issue 13 (field regression): no workspace lease stays held, and the engine reports
the error clearly (the original exception, not a later "still leased"
``WorkspaceLeaseError``). ``tests/core/test_field_regressions.py`` covers
``eager.Region`` alone; here the tiny model (``configs/tiny-dsv4``,
``FLASHMLA_SPARSE_DSV4``, fp8 KV cache, dummy weights, the plugin's layer) runs
in vLLM 0.32's engine and layer 1 (C4) raises :class:`InjectedLayerFault` once
from its ``forward_mqa``, mid-request (the request's second decode step, the
token at position ``PROMPT_LEN + 1``), while its step holds its ``q`` lease.

The fault is this file's own: :func:`_arm` wraps
``vllm_dsv4_backend.testing.after_layer_loaded`` (the layer calls it after
loading its weights, in the process that runs the model) to replace layer 1's
``forward_mqa`` on that instance. Each engine runs in a subprocess (this file as
a script), so a dead or wedged engine cannot take pytest with it. With
multiprocessing, vLLM *spawns* the engine core and its worker; a spawned process
imports the script as ``__mp_main__`` and arms itself from ``DSV4_TEST_LAYER_FAULT``.
(No ``VLLM_DSV4_*`` knob: ``tests/core/test_settings.py`` wants a malformed-value
case for every declared setting, and the fault needs none outside this file.)

What vLLM 0.32 does by design, as observed here:

- multiprocess engine (``LLM``'s default, and what ``vllm serve`` runs): the
  worker logs ``WorkerProc hit an exception.`` with the layer's traceback; the
  engine core logs ``EngineCore encountered a fatal error.`` (``RuntimeError:
  Worker failed with error '<the layer's message>'``) and exits; the caller gets
  ``EngineDeadError: EngineCore encountered an issue. See stack trace (above) for
  the root cause.``, and so does every later request. The engine dies by design
  (``ParallelConfig.enable_fault_tolerance``, off by default, is the only
  recovery path); the root cause in the log is the layer's exception, never
  "still leased".
- in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``EngineCore.step``
  lets the exception out (after dumping the scheduler state to the log), so
  ``LLM.generate`` raises the original :class:`InjectedLayerFault`; every lease
  is already back (``leased_bytes_now == 0``, no slot held). The engine keeps
  running, but vLLM leaves the interrupted request in its scheduler, RUNNING with
  ``num_computed_tokens == num_tokens`` (advanced when the failed step was
  scheduled): it is never scheduled again, so the next ``generate`` finishes its
  own request and then spins forever on ``has_unfinished_requests()``. After the
  caller aborts the interrupted request (``llm.llm_engine.abort_request``), a
  following request succeeds.

``test_leaked_lease_is_caught`` is the negative control: with ``eager.Region`` made
to keep its leases when the step raises (the regression this guards against), the
same checks see the held slot, and the next request fails with "still leased".
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, worker_env

MODEL = ROOT / "configs" / "tiny-dsv4"
FAULT_ENV = "DSV4_TEST_LAYER_FAULT"  # "<layer index>:<position>"; only this file reads it
FAULT_LAYER = 1  # C4: window + compressed entries
PROMPT_LEN = 16
FAULT_POSITION = PROMPT_LEN + 1  # the first request's second decode step
MAX_TOKENS = 6
FAULT_TAG = "injected layer fault"
WORKER_TIMEOUT_S = 900  # a bound for a wedged engine, not a speed assertion
MODES = ("inprocess", "inprocess-leak", "multiprocess")


class InjectedLayerFault(RuntimeError):
    """What the armed layer raises (once per process)."""


# --------------------------------------------------------------------------------------------
# the fault (runs in the process that runs the model)
# --------------------------------------------------------------------------------------------
_fault: dict[str, Any] = {"fired": False, "held": None, "armed": []}


def _arm(spec: str) -> None:
    """Layer ``<index>`` raises once, from inside its eager step: in its ``forward_mqa``
    call for the single decode token at ``<position>`` (no warm-up or profiling run
    has one token at a position past 0)."""
    from vllm_dsv4_backend import testing

    layer_index, position = (int(v) for v in spec.split(":"))
    pattern = re.compile(rf"(^|\.)layers\.{layer_index}\.")
    loaded = testing.after_layer_loaded

    def after_layer_loaded(layer: Any) -> None:
        loaded(layer)
        if not pattern.search(layer.prefix):
            return
        forward_mqa = layer.forward_mqa  # bound to the layer's class method

        def faulty_forward_mqa(self: Any, q: Any, kv: Any, positions: Any, *args: Any,
                               **kwargs: Any) -> Any:
            if not _fault["fired"] and positions.numel() == 1 and int(positions[0]) == position:
                _fault["fired"] = True
                region = self._dsv4_current_region()
                # What the step holds as it raises: what must come back.
                _fault["held"] = list(region.held()) if region else None
                print(f"[fault] {self.prefix} raises at position {position} holding "
                      f"{_fault['held']} (pid {os.getpid()})", file=sys.stderr, flush=True)
                raise InjectedLayerFault(f"{FAULT_TAG} in {self.prefix} at position "
                                         f"{position} (leases held: {_fault['held']})")
            return forward_mqa(q, kv, positions, *args, **kwargs)

        # An instance attribute: this layer only; the layer calls self.forward_mqa(...).
        layer.forward_mqa = types.MethodType(faulty_forward_mqa, layer)
        _fault["armed"].append(layer.prefix)

    testing.after_layer_loaded = after_layer_loaded


def _leak_leases_on_exception() -> None:
    """The regression, simulated: a step that raises keeps its leases."""
    from vllm_dsv4_backend import eager

    close_on_exit = eager.Region.__exit__

    def exit_keeping_leases_on_error(self: Any, *exc: Any) -> None:
        if exc[0] is None:
            close_on_exit(self, *exc)

    eager.Region.__exit__ = exit_keeping_leases_on_error


if __name__ == "__mp_main__" and os.environ.get(FAULT_ENV):
    # A spawned engine-core / worker process imports this script as __mp_main__
    # before it builds the model: arm the fault there.
    _arm(os.environ[FAULT_ENV])


# --------------------------------------------------------------------------------------------
# the worker (this file as a script): one engine, two requests, a JSON report
# --------------------------------------------------------------------------------------------
def _error(e: BaseException) -> dict[str, Any]:
    chain, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return {"type": type(e).__name__, "message": str(e), "chain": chain,
            "traceback": "".join(traceback.format_exception(e))[-4000:]}


def _lease_report() -> list[dict[str, Any]]:
    """Per workspace manager of this process: what is leased now."""
    from vllm_dsv4_backend.layer import core

    report = []
    for mgr in core._managers.values():
        s = mgr.stats()
        report.append({
            "policy": s["policy"], "leases_total": s["leases_total"],
            "leased_bytes_now": s["leased_bytes_now"],
            "held_slots": [f"{sl.family}[{sl.index}] by {sl.holder.layer_name}"
                           for sl in mgr._slots if sl.holder is not None],
        })
    return report


def _worker(mode: str, out_path: str) -> None:
    # kill -USR1 <pid> prints every thread's stack (for a wedged engine).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if mode not in MODES:
        raise SystemExit(f"mode: expected one of {MODES}, got {mode!r}")
    inprocess = mode.startswith("inprocess")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if inprocess else "1"
    os.environ[FAULT_ENV] = f"{FAULT_LAYER}:{FAULT_POSITION}"
    if inprocess:
        _arm(os.environ[FAULT_ENV])
    if mode == "inprocess-leak":
        _leak_leases_on_exception()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(MODEL), load_format="dummy", tokenizer_mode="hf",
              kv_cache_dtype="fp8", enforce_eager=True, max_model_len=1024,
              max_num_batched_tokens=1024, seed=0, attention_backend="FLASHMLA_SPARSE_DSV4")
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
    prompts = [[(7 * i + 3) % 500 + 2 for i in range(PROMPT_LEN)],
               [(5 * i + 1) % 500 + 2 for i in range(PROMPT_LEN)]]
    engine = llm.llm_engine
    report: dict[str, Any] = {"mode": mode}
    for name, ids in zip(("first", "second"), prompts):
        t0 = time.perf_counter()
        try:
            outs = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
            r: dict[str, Any] = {"ok": True, "tokens": [len(o.outputs[0].token_ids)
                                                        for o in outs]}
        except Exception as e:  # noqa: BLE001  (the report is the point)
            r = {"ok": False, **_error(e)}
        r["seconds"] = time.perf_counter() - t0
        if inprocess:
            r["leases"] = _lease_report()
            # Requests vLLM still counts as unfinished, with the scheduler's view of them;
            # then abort them, as a caller must (see the module docstring).
            live = list(engine.output_processor.request_states)
            r["unfinished"] = [
                {"status": q.status.name, "num_computed_tokens": q.num_computed_tokens,
                 "num_tokens": q.num_tokens}
                for q in engine.engine_core.engine_core.scheduler.running
                if q.request_id in live]
            if live:
                engine.abort_request(live, internal=True)
        report[name] = r
    report["fault"] = _fault
    Path(out_path).write_text(json.dumps(report, indent=1))
    # A dead multiprocess engine may leave threads behind: do not wait for them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


# --------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(mode: str, tmp_path: Path) -> tuple[dict[str, Any], str]:
    pytest.importorskip("vllm")
    out = tmp_path / "report.json"
    # Per test, so concurrent sessions do not share IPC sockets; short, because a
    # ZMQ ipc path (TMPDIR + a uuid) must fit in 107 bytes.
    ipc_dir = tempfile.mkdtemp(prefix="dsv4-lx-")
    env = {**os.environ, "VLLM_DSV4_ATTN_IMPL": "plugin", "PYTHONUNBUFFERED": "1",
           "TMPDIR": ipc_dir}
    env.pop(FAULT_ENV, None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    try:
        proc = subprocess.run([sys.executable, __file__, mode, str(out)], capture_output=True,
                              text=True, timeout=WORKER_TIMEOUT_S, env=worker_env(env),
                              cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{mode} worker still running after {WORKER_TIMEOUT_S} s (a wedged "
                    f"engine?):\n{str(e.stderr)[-4000:]}")
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    log = proc.stdout + proc.stderr
    (tmp_path / "worker.log").write_text(log)
    if proc.returncode != 0 or not out.is_file():
        pytest.fail(f"{mode} worker failed (rc {proc.returncode}):\n{log[-6000:]}")
    report = json.loads(out.read_text())
    return report, log


def _no_lease_error(text: str) -> None:
    assert "still leased" not in text and "WorkspaceLeaseError" not in text


def _fault_line(log: str) -> re.Match[str] | None:
    # The layer raised inside its step while holding its q lease (else nothing could leak).
    return re.search(rf"\[fault\] model\.layers\.{FAULT_LAYER}\.\S+ raises at position "
                     rf"{FAULT_POSITION} holding \['q'", log)


def test_inprocess_engine_raises_the_layer_error_and_releases_every_lease(tmp_path: Path) -> None:
    report, log = _run("inprocess", tmp_path)
    fault, first, second = report["fault"], report["first"], report["second"]
    assert fault["fired"] and len(fault["armed"]) == 1, fault
    assert "q" in fault["held"], fault
    # The error that reaches the caller is the layer's own exception, message and all.
    assert not first["ok"], "the faulty step did not fail the request"
    assert first["type"] == "InjectedLayerFault", first["chain"]
    assert first["message"].startswith(f"{FAULT_TAG} in model.layers.{FAULT_LAYER}.")
    _no_lease_error(json.dumps(first))
    # No lease stays held: no leased byte, no slot with a holder.
    assert first["leases"] and all(m["leases_total"] > 0 for m in first["leases"])
    for m in first["leases"]:
        assert m["leased_bytes_now"] == 0 and m["held_slots"] == [], m
    # vLLM keeps the interrupted request, with nothing left to schedule (docstring).
    assert [(u["status"], u["num_computed_tokens"] == u["num_tokens"])
            for u in first["unfinished"]] == [("RUNNING", True)], first["unfinished"]
    # The engine survives: once that request is aborted, the next one runs to the end.
    assert second["ok"], second.get("chain")
    assert second["tokens"] == [MAX_TOKENS] and second["unfinished"] == [], second
    for m in second["leases"]:
        assert m["leased_bytes_now"] == 0 and m["held_slots"] == [], m
    assert _fault_line(log), log[-3000:]
    _no_lease_error(log)


def test_multiprocess_engine_dies_naming_the_layer_error(tmp_path: Path) -> None:
    report, log = _run("multiprocess", tmp_path)
    first, second = report["first"], report["second"]
    assert _fault_line(log), log[-3000:]
    # By design the engine core dies on a failed model step; the caller is told so ...
    assert not first["ok"] and first["type"] == "EngineDeadError", first
    assert "See stack trace (above) for the root cause" in first["message"]
    _no_lease_error(json.dumps(first))
    # ... and the root cause in the log is the layer's exception: the worker's traceback
    # and the engine core's fatal error both name it.
    assert f"InjectedLayerFault: {FAULT_TAG} in model.layers.{FAULT_LAYER}." in log
    assert "EngineCore encountered a fatal error" in log
    assert f"Worker failed with error '{FAULT_TAG} in model.layers.{FAULT_LAYER}." in log
    # Nothing about a lease: the layer released it on the way out.
    _no_lease_error(log)
    # A dead engine stays dead: the next request gets the same clear error.
    assert not second["ok"] and second["type"] == "EngineDeadError", second


def test_leaked_lease_is_caught(tmp_path: Path) -> None:
    """Negative control: the checks above see a lease that a raising step keeps, and the
    user would then get "still leased" from the next request instead of an answer."""
    report, _ = _run("inprocess-leak", tmp_path)
    first, second = report["first"], report["second"]
    assert not first["ok"] and first["type"] == "InjectedLayerFault", first
    held = [s for m in first["leases"] for s in m["held_slots"]]
    assert any(s.startswith("q[") and f"layers.{FAULT_LAYER}." in s for s in held), held
    assert any(m["leased_bytes_now"] > 0 for m in first["leases"]), first["leases"]
    assert not second["ok"] and second["type"] == "WorkspaceLeaseError", second
    assert "still leased" in second["message"], second["message"]
