# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end: the plugin's layer vs vLLM's own layer, served side by side.

Two ``vllm serve`` of the tiny model (``configs/serve/tiny-dsv4-cpu.yaml``), one
with ``VLLM_DSV4_ATTN_IMPL=plugin`` and one with ``vllm``, both up at once. A
**round** sends one block of streamed ``/v1/completions`` requests (greedy,
``ignore_eos``, prompts as token ids so lengths are exact) to one server, waits
for all of them, then the same block to the other (plugin first in even rounds,
vLLM first in odd ones; the other server idles). Every round draws new prompts,
so no round hits the prefix cache of an earlier one, and both servers see the
same ones. A few unrecorded warm-up rounds per scenario come first (a new
shape's first pass pays oneDNN primitive creation: 4x the TTFT of later rounds).

Before each block the bench waits ``settle_s`` (1.5 s) and then sends the server
one unrecorded 1-token request. Both servers' workers are pinned to the same
core (vLLM's ``VLLM_CPU_OMP_THREADS_BIND=auto`` on 2 cores), and a vLLM worker
keeps polling its message queue for 1 s after its last step
(``shm_broadcast``'s ``busy_loop_s``), then sleeps until notified; without the
pause the measured server shared its core with the other one's polling, and
without the wake-up its first request paid the sleep: the second block of a
round measured up to 1 s more TTFT than the first, whichever layer it was.

Why rounds of a second or two, with an in-process client, rather than
``vllm bench serve`` runs: on a shared 2-core box the speed of the same server
drifts by 2x over tens of seconds, and each ``vllm bench serve`` spends ~10 s of
CPU importing vLLM before it sends anything. Pairing blocks a second apart
cancels the drift; the median of many pairs and its confidence interval say
whether what is left can tell the layers apart.

Per block and server it records the mean TTFT and TPOT of the requests (TPOT =
(last token - first token) / (tokens - 1), as ``vllm bench serve`` computes it),
output throughput (tokens / block wall time) and the **CPU time of the server's
process tree** (API server, engine core, workers: ``/proc/<pid>/stat`` utime +
stime of every process in the server's session) per generated token.

Scenarios (``SCENARIOS``): ``c1`` (concurrency 1, 16-token prompts, 64 output
tokens), ``c8`` (8 concurrent requests, 32 output tokens), ``long`` (1500-token
prompts, 2 concurrent, 16 output tokens). Ratios are vLLM / plugin for times
(>= 1: plugin at least as fast) and plugin / vLLM for throughput: the median of
the per-round pairs with its distribution-free 95% confidence interval, their
Hodges-Lehmann estimate with its signed-rank 95% interval (the same data resolve
about 1.5x as finely when the pairs' log ratios are symmetric, which the
alternating order gives), and min..max. Each verdict is ``plugin`` or ``vllm``
only when its interval excludes 1.

``python -m vllm_dsv4_backend.bench.e2e_layers [--rounds 30] [--json out.json]``.
vLLM runs only in subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from vllm_dsv4_backend.bench import ab
from vllm_dsv4_backend.bench.ab import SIDES, E2EError, hodges_lehmann_ci, verdict

SCHEMA = "vllm-dsv4-e2e-layers/3"


@dataclass(frozen=True)
class Scenario:
    """One block of a round: ``concurrency`` requests of ``prompt_len`` prompt tokens and
    ``output_len`` generated tokens, sent at once."""

    concurrency: int
    prompt_len: int
    output_len: int


SCENARIOS: dict[str, Scenario] = {
    "c1": Scenario(concurrency=1, prompt_len=16, output_len=64),
    "c8": Scenario(concurrency=8, prompt_len=16, output_len=32),
    "long": Scenario(concurrency=2, prompt_len=1500, output_len=16),
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


async def stream_completion(session: Any, url: str, model: str, prompt: list[int],
                            tokens: int) -> dict[str, float | int]:
    """One streamed greedy completion: ``ttft_s``, ``tpot_s`` (None for one token),
    ``tokens`` (the server's ``completion_tokens``). Raises :class:`E2EError` on an HTTP
    error or a stream that ends without a token."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise E2EError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            msg = json.loads(line[5:])
            if msg.get("choices"):
                last = time.perf_counter()
                if first is None:
                    first = last
            if msg.get("usage"):
                n = int(msg["usage"]["completion_tokens"])
    if first is None or last is None or n < 1:
        raise E2EError(f"{url}: the stream ended without a generated token")
    return {"ttft_s": first - t0, "tpot_s": (last - first) / (n - 1) if n > 1 else None,
            "tokens": n}


async def _block(url: str, model: str, prompts: Sequence[list[int]], tokens: int
                 ) -> list[dict[str, Any]]:
    import aiohttp

    try:
        async with ab.client_session() as session:
            return list(await asyncio.gather(
                *(stream_completion(session, url, model, p, tokens) for p in prompts)))
    except (TimeoutError, aiohttp.ClientError) as e:
        raise E2EError(f"{url}: {e!r} (the server's log is in the run directory)") from e


def measure_block(url: str, model: str, prompts: Sequence[list[int]], tokens: int,
                  sid: int) -> dict[str, float | None]:
    """Send ``prompts`` at once to ``url``; the block's metrics (``METRICS`` keys)."""
    cpu0, t0 = session_cpu_s(sid), time.perf_counter()
    reqs = asyncio.run(_block(url, model, prompts, tokens))
    wall, cpu = time.perf_counter() - t0, session_cpu_s(sid) - cpu0
    n = sum(int(r["tokens"]) for r in reqs)
    tpots = [r["tpot_s"] for r in reqs if r["tpot_s"] is not None]
    return {"mean_ttft_ms": 1e3 * statistics.mean(r["ttft_s"] for r in reqs),
            "mean_tpot_ms": 1e3 * statistics.mean(tpots) if tpots else None,
            "output_throughput": n / wall, "cpu_ms_per_token": 1e3 * cpu / n,
            "output_tokens": n, "wall_s": wall}


def _ratio(plugin: float | None, vllm: float | None, lower_is_better: bool) -> float | None:
    if not plugin or not vllm:
        return None
    return vllm / plugin if lower_is_better else plugin / vllm


def summarize(runs: Sequence[Mapping[str, Any]], name: str, rounds: int
              ) -> dict[str, dict[str, Any]]:
    """Per metric: both layers' medians and the per-round ratios' median, 95% CI of the
    median, min, max and verdict; and their Hodges-Lehmann estimate with its 95% CI and
    verdict (``hl_*``: :func:`~vllm_dsv4_backend.bench.ab.hodges_lehmann_ci`). Warm-up rounds
    (``round < 0``) are left out."""
    rows = {}
    for m, lower in METRICS.items():
        med = {side: _median([x["metrics"][m] for x in runs if x["scenario"] == name
                              and x["impl"] == side and x["round"] >= 0]) for side in SIDES}
        pairs = [p for p in (
            _ratio(_one(runs, name, "plugin", r, m), _one(runs, name, "vllm", r, m), lower)
            for r in range(rounds)) if p is not None]
        hl, hl_lo, hl_hi = hodges_lehmann_ci(pairs) if pairs else (None, None, None)
        rows[m] = {"plugin": med["plugin"], "vllm": med["vllm"], **ab.ratio_stats(pairs),
                   "ratio_min": min(pairs) if pairs else None,
                   "ratio_max": max(pairs) if pairs else None,
                   "hl_ratio": hl, "hl_ci95_lo": hl_lo, "hl_ci95_hi": hl_hi,
                   "hl_verdict": verdict(hl_lo, hl_hi)}
    return rows


def run(*, rounds: int = 30, warmup: int = 2, scenarios: Mapping[str, Scenario] = SCENARIOS,
        out_dir: str | os.PathLike[str] | None = None, health_timeout: float = 1200.0,
        seed: int = 0, settle_s: float = 1.5, progress: TextIO | None = sys.stderr
        ) -> dict[str, Any]:
    """Serve both layers, run ``warmup`` + ``rounds`` alternating rounds per scenario;
    returns the result."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds >= 1 and warmup >= 0 expected, got {rounds!r}, {warmup!r}")
    rng = random.Random(seed)
    say = ab.sayer("e2e-layers", progress)
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    with ab.served_layers("e2e-layers", out_dir=out_dir, health_timeout=health_timeout,
                          progress=progress) as (serve, out, servers):
        ids = ab.ordinary_token_ids(serve.model_path)
        for name, sc in scenarios.items():
            say(f"{name}: {warmup} warm-up + {rounds} rounds of {sc.concurrency} x "
                f"({sc.prompt_len} prompt + {sc.output_len} output tokens) per layer")
            for r in range(-warmup, rounds):
                prompts = [[rng.choice(ids) for _ in range(sc.prompt_len)]
                           for _ in range(sc.concurrency)]
                for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                    url, pid = servers[side].base_url, servers[side].proc.pid
                    time.sleep(settle_s)
                    measure_block(url, serve.served_model_name, [prompts[0][:1]], 1, pid)
                    metrics = measure_block(url, serve.served_model_name, prompts,
                                            sc.output_len, pid)
                    runs.append({"scenario": name, "impl": side, "round": r,
                                 "metrics": metrics})
                if r >= 0 and (r + 1) % 10 == 0:
                    say(f"{name}: {r + 1}/{rounds} rounds")
    (out / "runs.json").write_text(json.dumps(runs))
    return {"schema": SCHEMA, "rounds": rounds, "warmup": warmup, "seed": seed,
            "settle_s": settle_s,
            "scenarios": {k: asdict(v) for k, v in scenarios.items()},
            "summary": {name: summarize(runs, name, rounds) for name in scenarios},
            "runs": runs, "out_dir": str(out), "wall_s": time.monotonic() - t0,
            "load_avg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _median(xs: Sequence[Any]) -> float | None:
    vals = [x for x in xs if isinstance(x, int | float) and not isinstance(x, bool)]
    return statistics.median(vals) if vals else None


def _one(runs: Sequence[Mapping[str, Any]], name: str, impl: str, r: int, m: str) -> Any:
    return next((x["metrics"][m] for x in runs
                 if x["scenario"] == name and x["impl"] == impl and x["round"] == r), None)


def format_result(res: Mapping[str, Any]) -> str:
    lines = [(f"plugin layer vs vLLM layer, {res['rounds']} alternating rounds per scenario "
              f"(after {res['warmup']} warm-up); ratio >= 1: plugin at least as good: the "
              "median of the per-round pairs with its 95% CI, their Hodges-Lehmann estimate "
              "(HL) with its signed-rank 95% CI, min..max; a verdict names a layer only when "
              "its CI excludes 1"),
             (f"{'scenario':<9}{'metric':<19}{'plugin':>9}{'vllm':>9}{'median':>7}"
              f"{'median CI':>15}  {'verdict':<8}{'HL':>6}{'HL CI':>15}  {'HL verd.':<8}"
              f"{'min..max':>12}")]

    def f(v: Any, w: int = 3) -> str:
        return "n/a" if v is None else f"{v:.{w}f}"

    for name, rows in res["summary"].items():
        for m, row in rows.items():
            lines.append(f"{name:<9}{m:<19}{f(row['plugin'], 2):>9}{f(row['vllm'], 2):>9}"
                         f"{f(row['ratio_median']):>7}"
                         f"{f(row['ratio_ci95_lo']):>8}..{f(row['ratio_ci95_hi']):<5}"
                         f"  {row['verdict']:<8}{f(row['hl_ratio']):>6}"
                         f"{f(row['hl_ci95_lo']):>8}..{f(row['hl_ci95_hi']):<5}"
                         f"  {row['hl_verdict']:<8}"
                         f"{f(row['ratio_min'], 2):>6}..{f(row['ratio_max'], 2)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = ab.parser(__doc__)
    p.add_argument("--rounds", type=ab.positive, default=30,
                   help="rounds per scenario (default 30)")
    p.add_argument("--warmup", type=int, default=2,
                   help="unrecorded rounds per scenario first (default 2)")
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                   help="run only these scenarios (repeatable; default all)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--settle", type=float, default=1.5,
                   help="seconds of quiet before each block (default 1.5)")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error("--warmup must be non-negative")
    chosen = {k: SCENARIOS[k] for k in (args.scenario or SCENARIOS)}
    return ab.conclude("e2e-layers", lambda: run(
        rounds=args.rounds, warmup=args.warmup, scenarios=chosen, seed=args.seed,
        settle_s=args.settle), format_result, args.json)


if __name__ == "__main__":
    sys.exit(main())
