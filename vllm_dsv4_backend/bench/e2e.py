# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end: ``vllm bench serve`` TTFT/TPOT of the tiny model, workspace ``shared`` vs ``off``.

Starts ``vllm serve`` on ``configs/serve/tiny-dsv4-cpu.yaml`` (the tiny DeepSeek-V4,
``FLASHMLA_SPARSE_DSV4``, fp8 KV, dummy weights, eager) once per policy with
``VLLM_DSV4_WORKSPACE=<policy>`` and ``VLLM_DSV4_ATTN_IMPL=plugin``, runs the bench config
``configs/bench/tiny-cpu-smoke.yaml`` (random dataset, 2 input / 64 output tokens, 4
prompts, concurrency 1, seed 0) against it, one server at a time, and reports the metrics and
the shared/off ratios. Each server's layers write a marker (``VLLM_DSV4_MARKER_DIR``) that
names the workspace policy they ran with, so a run whose policy did not take effect is
flagged rather than compared.

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

REPO = Path(__file__).resolve().parents[2]
SERVE_CONFIG = REPO / "configs" / "serve" / "tiny-dsv4-cpu.yaml"
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
    rounds: int = 1,
    overrides: Sequence[str] = (),
    serve_config: str | os.PathLike[str] = SERVE_CONFIG,
    bench_config: str | os.PathLike[str] = BENCH_CONFIG,
    out_dir: str | os.PathLike[str] | None = None,
    health_timeout: float = 900.0,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Serve + bench once per policy and round (order alternates per round: shared, off;
    off, shared; ...). Returns a dict with ``E2E_KEYS``; ``ratios[m]`` = median over rounds
    of shared's ``m`` / median of off's."""
    from vllm_dsv4_backend import runner as R

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
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        order = POLICIES if r % 2 == 0 else POLICIES[::-1]
        for policy in order:
            tag = f"{policy}-r{r}"
            markers = out / f"markers-{tag}"
            env = R.cpu_env(scratch)
            env.update(VLLM_DSV4_WORKSPACE=policy, VLLM_DSV4_ATTN_IMPL="plugin",
                       VLLM_DSV4_MARKER_DIR=str(markers))
            server = R.make_server(serve, log_path=out / f"server-{tag}.log", env=env)
            result_name = f"bench-{tag}.json"
            if progress is not None:
                progress.write(f"[e2e] {tag}: starting vllm serve (log {server.log_path})\n")
                progress.flush()
            try:
                server.start()
                healthy = server.wait_healthy(timeout=health_timeout, progress=progress)
                cmd = R.build_bench_command(
                    bench, base_url=server.base_url, model_name=serve.served_model_name,
                    tokenizer=serve.tokenizer, tokenizer_mode=serve.tokenizer_mode,
                    result_dir=out, result_filename=result_name, overrides=overrides,
                )
                if progress is not None:
                    progress.write(f"[e2e] {tag}: vllm bench serve\n")
                    progress.flush()
                R.run_logged(cmd, out / f"bench-{tag}.log", env, "vllm bench serve")
            except R.RunError as e:
                raise E2EError(str(e)) from e
            finally:
                server.stop()
            raw = json.loads((out / result_name).read_text())
            seen = sorted({m.get("workspace_policy") for m in _markers(markers)} - {None})
            runs.append({
                "policy": policy, "round": r, "healthy_after_s": healthy,
                "metrics": {m: raw.get(m) for m in METRICS},
                "completed": raw.get("completed"), "failed": raw.get("failed"),
                "policy_seen": seen, "server_log": str(server.log_path),
                "result_file": str(out / result_name),
            })
    by_policy: dict[str, dict[str, float | None]] = {}
    for policy in POLICIES:
        by_policy[policy] = {}
        for m in METRICS:
            vals = [x["metrics"][m] for x in runs if x["policy"] == policy
                    and isinstance(x["metrics"][m], int | float)]
            by_policy[policy][m] = statistics.median(vals) if vals else None
    ratios: dict[str, float | None] = {}
    for m in METRICS:
        a, b = by_policy["shared"][m], by_policy["off"][m]
        ratios[m] = a / b if a is not None and b else None
    confirmed = all(x["policy_seen"] == [x["policy"]] for x in runs)
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
    lines = [f"{'metric':<18} {'shared':>10} {'off':>10} {'shared/off':>11}"]
    lines.append("-" * len(lines[0]))
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
