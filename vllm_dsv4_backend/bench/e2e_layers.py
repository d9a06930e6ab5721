# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end: the plugin's layer vs vLLM's own layer, served side by side.

Two ``vllm serve`` of the tiny model (``configs/serve/tiny-dsv4-cpu.yaml``), one
with ``VLLM_DSV4_ATTN_IMPL=plugin`` and one with ``vllm``, both up at once. For
each scenario, many short ``vllm bench serve`` rounds alternate between them
(plugin first in even rounds, vLLM first in odd ones; the other server idles),
so a change in machine load hits both alike. Besides TTFT, TPOT and output
throughput (wall time), each round records the **CPU time of the server's
process tree** (API server, engine core, workers: ``/proc/<pid>/stat`` utime +
stime of every process in the server's session) per generated token, which
other load on the machine disturbs much less than wall time.

Scenarios (``SCENARIOS``; ``vllm bench serve`` flags over the bench config):
``c1`` (concurrency 1, 2-token prompts, 64 output tokens), ``c8``
(concurrency 8, 16 prompts), ``long`` (1500-token prompts, 16 output tokens,
concurrency 2). Ratios are vLLM / plugin for times (>= 1: plugin at least as
fast) and plugin / vLLM for throughput, the median of the per-round pairs with
their min..max.

``python -m vllm_dsv4_backend.bench.e2e_layers [--rounds 6] [--json out.json]``.
vLLM runs only in subprocesses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from vllm_dsv4_backend.bench import finish
from vllm_dsv4_backend.bench.e2e import BENCH_CONFIG, REPO, SERVE_CONFIG, E2EError

SCHEMA = "vllm-dsv4-e2e-layers/1"
IMPLS = ("plugin", "vllm")
SCENARIOS: dict[str, list[str]] = {
    "c1": ["num-prompts=4", "max-concurrency=1", "random-output-len=64"],
    "c8": ["num-prompts=16", "max-concurrency=8", "random-output-len=32"],
    "long": ["num-prompts=4", "max-concurrency=2", "random-input-len=1500",
             "random-output-len=16"],
}
# metric -> True if lower is better (the ratio is vLLM / plugin), False for
# throughput (plugin / vLLM); either way >= 1 means the plugin is at least as good.
METRICS: dict[str, bool] = {
    "mean_ttft_ms": True, "mean_tpot_ms": True, "output_throughput": False,
    "cpu_ms_per_token": True,
}
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def session_cpu_s(sid: int) -> float:
    """utime + stime (s) of every live process in session ``sid`` (the server
    runs in its own session, so that is the API server, engine core and workers)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command: state ppid pgrp session ... utime(14) stime(15).
        if int(fields[3]) == sid:
            total += int(fields[11]) + int(fields[12])
    return total / _CLK


def _ratio(plugin: float | None, vllm: float | None, lower_is_better: bool) -> float | None:
    if not plugin or not vllm:
        return None
    return vllm / plugin if lower_is_better else plugin / vllm


@contextlib.contextmanager
def served_layers(serve: Any, out: Path, scratch: Path, health_timeout: float,
                  say: Callable[[str], None], progress: TextIO | None
                  ) -> Iterator[tuple[dict[str, Any], dict[str, dict[str, str]]]]:
    """Both layers served at once (``VLLM_DSV4_ATTN_IMPL`` per server, logs under
    ``out``), healthy on entry, stopped on exit: ``(servers, envs)`` keyed by impl."""
    from vllm_dsv4_backend import run as R

    servers: dict[str, Any] = {}
    envs: dict[str, dict[str, str]] = {}
    try:
        for impl in IMPLS:
            envs[impl] = R.cpu_env(scratch, {**os.environ, "VLLM_DSV4_ATTN_IMPL": impl})
            servers[impl] = R.make_server(serve, log_path=out / f"server-{impl}.log",
                                          env=envs[impl])
            say(f"{impl}: starting vllm serve (log {servers[impl].log_path})")
            servers[impl].start()
        for impl in IMPLS:
            servers[impl].wait_healthy(timeout=health_timeout, progress=progress)
        yield servers, envs
    finally:
        for server in servers.values():
            server.stop()


def run(*, rounds: int = 6, scenarios: Mapping[str, Sequence[str]] = SCENARIOS,
        out_dir: str | os.PathLike[str] | None = None, health_timeout: float = 1200.0,
        progress: TextIO | None = sys.stderr) -> dict[str, Any]:
    """Serve both layers, run ``rounds`` alternating rounds per scenario; returns the result."""
    from vllm_dsv4_backend import run as R

    if rounds < 1:
        raise ValueError(f"rounds: expected a positive int, got {rounds!r}")
    serve = R.load_serve_config(SERVE_CONFIG)
    scratch = Path(os.environ.get("DSV4_SCRATCH", REPO / ".scratch"))
    out = Path(out_dir) if out_dir else scratch / "runs" / (
        time.strftime("%Y%m%d-%H%M%S") + "-e2e-layers")
    out.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        if progress is not None:
            progress.write(f"[e2e-layers] {msg}\n")
            progress.flush()

    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    try:
        with served_layers(serve, out, scratch, health_timeout, say, progress) as (servers,
                                                                                   envs):
            for name, overrides in scenarios.items():
                bench = R.load_bench_config(BENCH_CONFIG)
                R.apply_overrides(bench.args, list(overrides))
                for r in range(rounds):
                    for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
                        tag = f"{name}-{impl}-r{r}"
                        cmd = R.build_bench_command(
                            bench, base_url=servers[impl].base_url,
                            model_name=serve.served_model_name, tokenizer=serve.tokenizer,
                            tokenizer_mode=serve.tokenizer_mode, result_dir=out,
                            result_filename=f"{tag}.json", overrides=list(overrides),
                        )
                        say(f"{name} round {r + 1}/{rounds}: {impl}")
                        sid = servers[impl].proc.pid
                        cpu0 = session_cpu_s(sid)
                        R.run_logged(cmd, out / f"{tag}.log", envs[impl], "vllm bench serve")
                        cpu = session_cpu_s(sid) - cpu0
                        raw = json.loads((out / f"{tag}.json").read_text())
                        tokens = raw.get("total_output_tokens") or 0
                        metrics = {m: raw.get(m) for m in METRICS if m != "cpu_ms_per_token"}
                        metrics["cpu_ms_per_token"] = 1e3 * cpu / tokens if tokens else None
                        runs.append({"scenario": name, "impl": impl, "round": r,
                                     "completed": raw.get("completed"), "failed": raw.get("failed"),
                                     "cpu_s": cpu, "output_tokens": tokens, "metrics": metrics})
    except (R.RunError, R.ConfigError) as e:
        raise E2EError(str(e)) from e

    summary: dict[str, Any] = {}
    for name in scenarios:
        rows = {}
        for m, lower in METRICS.items():
            med = {impl: _median([x["metrics"][m] for x in runs
                                  if x["scenario"] == name and x["impl"] == impl])
                   for impl in IMPLS}
            pairs = [p for p in (
                _ratio(_one(runs, name, "plugin", r, m), _one(runs, name, "vllm", r, m), lower)
                for r in range(rounds)) if p is not None]
            rows[m] = {"plugin": med["plugin"], "vllm": med["vllm"],
                       "ratio_median": _median(pairs),
                       "ratio_min": min(pairs) if pairs else None,
                       "ratio_max": max(pairs) if pairs else None}
        summary[name] = rows
    return {"schema": SCHEMA, "rounds": rounds, "scenarios": {k: list(v) for k, v in
                                                              scenarios.items()},
            "summary": summary, "runs": runs, "wall_s": time.monotonic() - t0,
            "load_avg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _median(xs: Sequence[Any]) -> float | None:
    vals = [x for x in xs if isinstance(x, int | float) and not isinstance(x, bool)]
    return statistics.median(vals) if vals else None


def _one(runs: Sequence[Mapping[str, Any]], name: str, impl: str, r: int, m: str) -> Any:
    return next((x["metrics"][m] for x in runs
                 if x["scenario"] == name and x["impl"] == impl and x["round"] == r), None)


def format_result(res: Mapping[str, Any]) -> str:
    lines = [(f"plugin layer vs vLLM layer, {res['rounds']} alternating rounds per scenario; "
             "ratio >= 1: plugin at least as good (median of per-round pairs, min..max)"),
             f"{'scenario':<9}{'metric':<20}{'plugin':>10}{'vllm':>10}{'ratio':>8}  spread"]
    for name, rows in res["summary"].items():
        for m, row in rows.items():
            def f(v: Any) -> str:
                return "n/a" if v is None else f"{v:.3f}"
            lines.append(f"{name:<9}{m:<20}{f(row['plugin']):>10}{f(row['vllm']):>10}"
                         f"{f(row['ratio_median']):>8}  {f(row['ratio_min'])}.."
                         f"{f(row['ratio_max'])}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds per scenario (default 6)")
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                   help="run only these scenarios (repeatable; default all)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    chosen = {k: SCENARIOS[k] for k in (args.scenario or SCENARIOS)}
    try:
        res = run(rounds=args.rounds, scenarios=chosen)
    except (E2EError, ValueError) as e:
        print(f"e2e-layers failed: {e}", file=sys.stderr)
        return 3
    return finish(res, args.json, format_result(res))


if __name__ == "__main__":
    sys.exit(main())
