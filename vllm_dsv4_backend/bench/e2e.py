# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end: ``vllm bench serve`` TTFT/TPOT of the tiny model, workspace ``shared`` vs ``off``.

Starts two ``vllm serve`` on ``configs/serve/tiny-dsv4-cpu.yaml`` (the tiny DeepSeek-V4,
``FLASHMLA_SPARSE_DSV4``, fp8 KV, dummy weights, eager), one with
``VLLM_DSV4_WORKSPACE=shared`` and one with ``off`` (both ``VLLM_DSV4_ATTN_IMPL=plugin``),
then runs the bench config ``configs/bench/tiny-cpu-smoke.yaml`` (random dataset, 2 input /
64 output tokens, 4 prompts, concurrency 1, seed 0) against each in alternating rounds (the
other server idles), and reports the metrics and the paired shared/off ratios. Sequential
server runs were tried first: on a shared 2-core machine the load changed between them by
2x and so did the "ratio"; interleaved rounds cancel that drift. Each server's layers write
a marker (``VLLM_DSV4_MARKER_DIR``) that names the workspace policy they ran with, so a run
whose policy did not take effect is flagged rather than compared.

Uses :mod:`vllm_dsv4_backend.runner` as a library (server process, health wait, bench
command); vLLM runs only in subprocesses, so importing this module needs no vLLM.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from vllm_dsv4_backend.run.config import TINY_SERVE_CONFIG

REPO = Path(__file__).resolve().parents[2]
SERVE_CONFIG = TINY_SERVE_CONFIG
BENCH_CONFIG = REPO / "configs" / "bench" / "tiny-cpu-smoke.yaml"
POLICIES = ("shared", "off")
METRICS: tuple[str, ...] = (
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "output_throughput",
)
E2E_KEYS: tuple[str, ...] = (
    "serve_config", "bench_config", "bench_overrides", "rounds", "runs", "by_policy", "ratios",
    "policy_confirmed", "load_avg_start", "load_avg_end", "wall_s",
)


class E2EError(RuntimeError):
    """A server or benchmark failed (the message carries the log tail)."""


def _markers(marker_dir: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(glob.glob(str(marker_dir / "layer-*.json"))):
        try:
            out.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def run_e2e(
    *,
    rounds: int = 3,
    overrides: Sequence[str] = (),
    serve_config: str | os.PathLike[str] = SERVE_CONFIG,
    bench_config: str | os.PathLike[str] = BENCH_CONFIG,
    out_dir: str | os.PathLike[str] | None = None,
    health_timeout: float = 1200.0,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Both servers up at once, then ``rounds`` rounds of ``vllm bench serve`` against each,
    alternating the order (shared, off; off, shared; ...), so that a change in machine load
    hits both alike (one server idles while the other is measured).

    Returns a dict with ``E2E_KEYS``: ``by_policy[p][m]`` = median over rounds;
    ``ratios[m]`` = median over rounds of the paired ratio shared / off of the same round.
    """
    from vllm_dsv4_backend import run as R

    if rounds < 1:
        raise ValueError(f"rounds: expected a positive int, got {rounds!r}")
    try:
        serve = R.load_serve_config(serve_config)
        bench = R.load_bench_config(bench_config)
        R.apply_overrides(bench.args, overrides)
    except R.ConfigError as e:
        raise E2EError(str(e)) from e
    scratch = Path(os.environ.get("DSV4_SCRATCH", REPO / ".scratch"))
    out = Path(out_dir) if out_dir else scratch / "runs" / (
        time.strftime("%Y%m%d-%H%M%S") + "-bench-e2e")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    def say(msg: str) -> None:
        if progress is not None:
            progress.write(f"[e2e] {msg}\n")
            progress.flush()

    servers: dict[str, Any] = {}
    envs: dict[str, dict[str, str]] = {}
    healthy: dict[str, float] = {}
    runs: list[dict[str, Any]] = []
    try:
        for policy in POLICIES:
            env = R.cpu_env(scratch)
            env.update(VLLM_DSV4_WORKSPACE=policy, VLLM_DSV4_ATTN_IMPL="plugin",
                       VLLM_DSV4_MARKER_DIR=str(out / f"markers-{policy}"))
            envs[policy] = env
            servers[policy] = R.make_server(serve, log_path=out / f"server-{policy}.log",
                                            env=env)
            say(f"{policy}: starting vllm serve (log {servers[policy].log_path})")
            servers[policy].start()
        for policy in POLICIES:
            healthy[policy] = servers[policy].wait_healthy(timeout=health_timeout,
                                                           progress=progress)
        for r in range(rounds):
            order = POLICIES if r % 2 == 0 else POLICIES[::-1]
            for policy in order:
                tag = f"{policy}-r{r}"
                result_name = f"bench-{tag}.json"
                cmd = R.build_bench_command(
                    bench, base_url=servers[policy].base_url,
                    model_name=serve.served_model_name, tokenizer=serve.tokenizer,
                    tokenizer_mode=serve.tokenizer_mode, result_dir=out,
                    result_filename=result_name, overrides=overrides,
                )
                say(f"round {r + 1}/{rounds}: vllm bench serve against {policy}")
                R.run_logged(cmd, out / f"bench-{tag}.log", envs[policy], "vllm bench serve")
                raw = json.loads((out / result_name).read_text())
                runs.append({
                    "policy": policy, "round": r, "healthy_after_s": healthy[policy],
                    "metrics": {m: raw.get(m) for m in METRICS},
                    "completed": raw.get("completed"), "failed": raw.get("failed"),
                    "policy_seen": [], "server_log": str(servers[policy].log_path),
                    "result_file": str(out / result_name),
                })
    except R.RunError as e:
        raise E2EError(str(e)) from e
    finally:
        for server in servers.values():
            server.stop()
    for x in runs:
        seen = {m.get("workspace_policy") for m in _markers(out / f"markers-{x['policy']}")}
        x["policy_seen"] = sorted(seen - {None})

    def num(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    by_policy: dict[str, dict[str, float | None]] = {}
    for policy in POLICIES:
        by_policy[policy] = {}
        for m in METRICS:
            vals = [x["metrics"][m] for x in runs if x["policy"] == policy
                    and num(x["metrics"][m])]
            by_policy[policy][m] = statistics.median(vals) if vals else None
    ratios: dict[str, float | None] = {}
    for m in METRICS:
        paired = []
        for r in range(rounds):
            a = [x["metrics"][m] for x in runs if x["round"] == r and x["policy"] == "shared"]
            b = [x["metrics"][m] for x in runs if x["round"] == r and x["policy"] == "off"]
            if a and b and num(a[0]) and num(b[0]) and b[0]:
                paired.append(a[0] / b[0])
        ratios[m] = statistics.median(paired) if paired else None
    confirmed = bool(runs) and all(x["policy_seen"] == [x["policy"]] for x in runs)
    return {
        "serve_config": str(serve.path), "bench_config": str(bench.path),
        "bench_overrides": list(overrides), "rounds": rounds, "runs": runs,
        "by_policy": by_policy, "ratios": ratios, "policy_confirmed": confirmed,
        "load_avg_start": load0,
        "load_avg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "wall_s": time.monotonic() - t0,
    }


def format_e2e(e2e: Mapping[str, Any]) -> str:
    """Fixed-width table: metric, shared, off, shared/off."""
    if "error" in e2e:
        return f"failed: {e2e['error']}"
    head = f"{'metric':<18} {'shared':>10} {'off':>10} {'shared/off':>11}"
    lines = ["medians over rounds; shared/off = median of the per-round paired ratios", head,
             "-" * len(head)]
    for m in METRICS:
        a, b, r = e2e["by_policy"]["shared"][m], e2e["by_policy"]["off"][m], e2e["ratios"][m]
        lines.append(
            f"{m:<18} {'n/a' if a is None else f'{a:.3f}':>10} "
            f"{'n/a' if b is None else f'{b:.3f}':>10} {'n/a' if r is None else f'{r:.3f}':>11}"
        )
    note = "yes" if e2e["policy_confirmed"] else "NO (see runs[].policy_seen)"
    lines.append(f"rounds {e2e['rounds']}, policy confirmed by layer markers: {note}, "
                 f"{e2e['wall_s']:.0f} s")
    return "\n".join(lines)
