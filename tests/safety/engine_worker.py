# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""In-process vLLM engines of the tiny model for the safety tests (a script, not a
test module): each variant is one ``LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the uniprocess executor), so the test can hold the number of requests in flight at
exactly ``concurrency`` (``LLMEngine.add_request``/``step``: new prefills join running
decodes as others finish) and time the workspace's own calls inside real steps.

Usage: python engine_worker.py SPEC.json OUT.json
SPEC: {"model": dir, "env": {...process-wide}, "engine": {...LLM kwargs...}, "logprobs": k,
       "prompt_sets": {set: {"prompts": [[ids...]], "max_tokens": n}},
       "variants": {name: {"env": {...}, "engine": {...}, "runs": [[set, concurrency], ...],
                           "time_workspace": bool}}}
OUT: {name: {"runs": {"<set>@<concurrency>": [{"token_ids", "logprobs", "top", "finish"}]},
             "init_s", "generate_s", "stats": [workspace stats], "timing"?: {run: [steps]}}}
``logprobs`` per output: the chosen token's logprob per step; ``top``: {id: logprob}.
Variants run one after another in this process; their env vars are set before each
``LLM()`` (the workspace settings are read when the layers are built), but the spec's
``env`` (``VLLM_DSV4_ATTN_IMPL``) must be process-wide: the plugin installs the layer
class once, when it loads.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


class WorkspaceTimer:
    """Wall time spent inside the workspace manager's calls (lease, release, fence),
    and in whole engine steps, accumulated per step; installed on the classes."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.views: int = 0
        self.steps: list[dict[str, Any]] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str, key: str) -> None:
        orig = getattr(owner, name)
        timer = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                timer.acc[key] += time.perf_counter() - t0
                timer.calls[key] += 1

        self._saved.append((owner, name, orig))
        setattr(owner, name, wrapped)

    def install(self, runner_cls: Any) -> None:
        from vllm_dsv4_backend.workspace import manager as M

        self._wrap(M.WorkspaceManager, "lease", "lease")
        self._wrap(M.WorkspaceManager, "_release", "release")
        self._wrap(M.WorkspaceManager, "_fence", "fence")
        orig_lease = M.WorkspaceManager.lease
        timer = self

        def lease(mgr: Any, layer_name: str, family: str, num_tokens: int, *a: Any,
                  **k: Any) -> Any:
            ls = orig_lease(mgr, layer_name, family, num_tokens, *a, **k)
            timer.views += len(ls.views)
            return ls

        M.WorkspaceManager.lease = lease  # type: ignore[method-assign]
        self._saved.append((M.WorkspaceManager, "lease", orig_lease))
        orig_exec = runner_cls.execute_model

        def execute_model(runner: Any, scheduler_output: Any, *a: Any, **k: Any) -> Any:
            before = dict(timer.acc), dict(timer.calls), timer.views
            t0 = time.perf_counter()
            try:
                return orig_exec(runner, scheduler_output, *a, **k)
            finally:
                dt = time.perf_counter() - t0
                tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0))
                if tokens:
                    timer.steps.append({
                        "step_s": dt, "tokens": tokens,
                        **{f"{key}_s": timer.acc[key] - before[0].get(key, 0.0)
                           for key in ("lease", "release", "fence")},
                        **{f"{key}_calls": timer.calls[key] - before[1].get(key, 0)
                           for key in ("lease", "release", "fence")},
                        "views": timer.views - before[2],
                    })

        runner_cls.execute_model = execute_model
        self._saved.append((runner_cls, "execute_model", orig_exec))

    def uninstall(self) -> None:
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)
        self._saved.clear()


def _workspaces(llm: Any) -> list[Any]:
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    model = core.model_executor.driver_worker.worker.model_runner.model
    seen: dict[int, Any] = {}
    for m in model.modules():
        ws = getattr(m, "_workspace", None)
        if ws is not None:
            seen[id(ws)] = ws
    return list(seen.values())


def _row(out: Any) -> dict[str, Any]:
    c = out.outputs[0]
    ids = list(c.token_ids)
    steps = c.logprobs or []
    return {
        "token_ids": ids,
        "logprobs": [step[t].logprob for t, step in zip(ids, steps)],
        "top": [{str(t): lp.logprob for t, lp in step.items()} for step in steps],
        "finish": c.finish_reason,
    }


def generate(llm: Any, prompts: list[list[int]], params: Any, concurrency: int
             ) -> list[dict[str, Any]]:
    """Greedy outputs of ``prompts`` with exactly ``min(concurrency, left)`` requests in
    flight: a new request is added as soon as one finishes (mixed prefill + decode)."""
    engine = llm.llm_engine
    results: dict[int, dict[str, Any]] = {}
    nxt = 0
    live = 0
    while nxt < len(prompts) or engine.has_unfinished_requests():
        while live < concurrency and nxt < len(prompts):
            engine.add_request(str(nxt), {"prompt_token_ids": prompts[nxt]}, params)
            nxt += 1
            live += 1
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = _row(out)
                live -= 1
    return [results[i] for i in range(len(prompts))]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Process-wide settings (VLLM_DSV4_ATTN_IMPL: the layer class is installed once,
    # when the plugin loads) go in before vLLM is imported.
    os.environ.update(spec.get("env", {}))
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    load_general_plugins()
    base_env = dict(os.environ)
    results: dict[str, Any] = {}
    keep: list[Any] = []  # engines stay alive: no id() of a config is ever reused
    for name, variant in spec["variants"].items():
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(variant.get("env", {}))
        engine_kw = {**spec["engine"], **variant.get("engine", {})}
        timer = WorkspaceTimer() if variant.get("time_workspace") else None
        t0 = time.perf_counter()
        llm = LLM(model=spec["model"], distributed_executor_backend="uni", **engine_kw)
        init_s = time.perf_counter() - t0
        runs: dict[str, Any] = {}
        timing: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            if timer is not None:
                timer.install(GPUModelRunner)
            for set_name, conc in variant["runs"]:
                ps = spec["prompt_sets"][set_name]
                params = SamplingParams(temperature=0.0, max_tokens=ps["max_tokens"],
                                        logprobs=spec["logprobs"], ignore_eos=True, seed=0)
                key = f"{set_name}@{conc}"
                if timer is not None:
                    timer.steps = []
                runs[key] = generate(llm, ps["prompts"], params, int(conc))
                if timer is not None:
                    timing[key] = timer.steps
        finally:
            if timer is not None:
                timer.uninstall()
        gen_s = time.perf_counter() - t0
        stats = [ws.stats() for ws in _workspaces(llm)]
        results[name] = {"runs": runs, "init_s": init_s, "generate_s": gen_s,
                         "stats": [{k: v for k, v in s.items()
                                    if k != "reserved_bytes_per_layer"} for s in stats]}
        if timer is not None:
            results[name]["timing"] = timing
        print(f"[safety-worker] {name}: init {init_s:.1f}s generate {gen_s:.1f}s", flush=True)
        keep.append(llm)
        gc.collect()
    Path(sys.argv[2]).write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
