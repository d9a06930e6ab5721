# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The safety case of cross-layer workspace reuse (vllm-project/afd-plugin#292), as
five test modules, one per item, each recording its figure:

1. ``test_1_parity``: tokens and top logprobs of ``shared`` bitwise equal to ``off``;
2. ``test_2_stress``: concurrency 16 and 32, ``shared`` + debug poisoning: no NaN, no
   failed request, 0 far divergences beyond vLLM's own layer's batch variance;
3. ``test_3_events``: simulated-stream schedules: fenced clean, unfenced corrupt, and
   #49236's layout corrupt under the same schedules;
4. ``test_4_memory``: ``shared`` bytes constant in the layer count, ``private`` linear,
   #49236's pool beside them;
5. ``test_5_cost``: per engine step, the workspace's lease/release/fence time against
   the allocator calls it saves (printed, not asserted).

``bash scripts/test.sh tests/safety`` runs them and prints the five figures as a table
at the end (``pytest_terminal_summary``); ``DSV4_SAFETY_JSON=path`` (or
``--safety-json path`` when this conftest is an initial one) also writes them as JSON.
``DSV4_SAFETY_FULL=1`` (or ``--safety-full``) runs the larger variants: more prompts and
tokens, more schedules, ``private`` in the parity check, concurrent steps in item 5, and
item 2 also through two served ``vllm serve`` processes (``bench.solo_identity``); the
default run is the CI-sized one. ``DSV4_SAFETY_ENGINE_RESULTS=dir`` re-judges a previous
run's engine outputs (the ``safety-engines`` dir of its pytest temp dir) without
starting engines.

Items 1, 2 and 5 share one run of the tiny model (``engine_runs``): two worker
processes (``engine_worker.py``), one with the plugin's layer (variants ``off``,
``shared``, ``shared_debug``, and ``private`` in the full run), one with vLLM's own layer
(``VLLM_DSV4_ATTN_IMPL`` is applied once per process), started in parallel.
Extra parity modes (e.g. the CUDA graph harness of tools/cuda_graph/) can be added as
variants of the plugin worker through :data:`EXTRA_PARITY_VARIANTS`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.safety import ITEMS, engine_spec, full_mode
from tests.support.served import omp_threads
from tests.support.vllm_helpers import run_workers_at_once


def pytest_addoption(parser: pytest.Parser) -> None:
    # Only seen when this conftest is an initial one (pytest tests/safety ...);
    # the environment variables work from anywhere.
    group = parser.getgroup("safety")
    group.addoption("--safety-json", default=None, help="write the safety figures here")
    group.addoption("--safety-full", action="store_true", default=False,
                    help="run the larger safety variants")


class Figures:
    """The five figures, filled by the tests, printed at the end."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, Any]] = {}

    def record(self, item: int, figure: str, data: dict[str, Any] | None = None) -> None:
        row = self.rows.setdefault(item, {"item": item, "claim": _claim(item), "figures": [],
                                          "data": {}})
        row["figures"].append(figure)
        row["data"].update(data or {})
        print(f"[safety item {item}] {figure}")


def _claim(item: int) -> str:
    return next(c for n, c in ITEMS.values() if n == item)


_FIGURES = pytest.StashKey[Figures]()


def _figures(config: pytest.Config) -> Figures:
    f = config.stash.get(_FIGURES, None)
    if f is None:
        f = config.stash[_FIGURES] = Figures()
    return f


@pytest.fixture(scope="session")
def safety_full(request: pytest.FixtureRequest) -> bool:
    """Whether this is the full run (``DSV4_SAFETY_FULL=1`` / ``--safety-full``)."""
    return full_mode(request.config)


@pytest.fixture(scope="session")
def figures(request: pytest.FixtureRequest) -> Figures:
    return _figures(request.config)


def _item_of(nodeid: str) -> int | None:
    for mod, (n, _) in ITEMS.items():
        if f"/{mod}.py" in nodeid or nodeid.startswith(f"{mod}.py"):
            return n
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        n = _item_of(report.nodeid)
        if n is not None:
            _FAILED.add(n)


_FAILED: set[int] = set()


def format_table(rows: list[dict[str, Any]], failed: set[int]) -> str:
    lines = ["| # | claim | figure | verdict |", "|---|---|---|---|"]
    for r in rows:
        n = r["item"]
        verdict = "FAIL" if n in failed else ("figure" if n == 5 else "pass")
        lines.append(f"| {n} | {r['claim']} | {'; '.join(r['figures'])} | {verdict} |")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config
                            ) -> None:
    f = config.stash.get(_FIGURES, None)
    if f is None or not f.rows:
        return
    rows = [f.rows[k] for k in sorted(f.rows)]
    mode = "full" if full_mode(config) else "default"
    tr = terminalreporter
    tr.write_sep("=", f"workspace safety case (afd-plugin#292), {mode} run")
    tr.write_line(format_table(rows, _FAILED))
    path = config.getoption("--safety-json", default=None) or os.environ.get("DSV4_SAFETY_JSON")
    if path:
        Path(path).write_text(json.dumps(
            {"schema": "vllm-dsv4-safety/1", "mode": mode, "failed": sorted(_FAILED),
             "rows": rows}, indent=1, default=str))
        tr.write_line(f"safety figures written to {path}")


# --- the shared engine run (items 1, 2, 5) ----------------------------------------------


@pytest.fixture(scope="session")
def engine_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[dict[str, Any]]:
    """Both workers' results merged: ``{variant: {"runs": {"set@conc": [...]}, ...}}``."""
    pytest.importorskip("vllm")
    full = full_mode(request.config)
    reuse = os.environ.get("DSV4_SAFETY_ENGINE_RESULTS")
    if reuse:
        # A previous run's worker outputs (its dir is in the JSON's _meta): re-judge
        # and re-print without running the engines again.
        merged = {}
        for name in ("plugin", "vllm"):
            merged.update(json.loads((Path(reuse) / f"{name}-out.json").read_text()))
        merged["_meta"] = {"wall_s": 0.0, "full": full, "dir": reuse, "reused": True}
        yield merged
        return
    d = tmp_path_factory.mktemp("safety-engines")
    env = {**os.environ, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1500",
           "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_DSV4_WORKSPACE", None)
    env.pop("VLLM_DSV4_WORKSPACE_DEBUG", None)
    t0 = time.monotonic()
    specs = engine_spec(full)
    # The two workers' engines run at the same time: each gets its share of the CPUs.
    env["OMP_NUM_THREADS"] = omp_threads(len(specs))
    reports = run_workers_at_once(Path(__file__).with_name("engine_worker.py"),
                                  dict(zip(("plugin", "vllm"), specs, strict=True)), d,
                                  {"plugin": env, "vllm": env}, timeout=2400)
    merged: dict[str, Any] = {k: v for r in reports.values() for k, v in r.items()}
    merged["_meta"] = {"wall_s": time.monotonic() - t0, "full": full, "dir": str(d)}
    yield merged
