# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end under mixed traffic: how many outputs stay identical to the solo run,
with the plugin's layer and with vLLM's own layer, served side by side.

Two ``vllm serve`` of the tiny model (``configs/serve/tiny-dsv4-cpu.yaml``), one
with ``VLLM_DSV4_ATTN_IMPL=plugin`` and one with ``vllm``. The same
``--prompts`` prompts (1..250 words of the tokenizer's ordinary tokens, token
ids so the lengths are exact; greedy, ``--tokens`` new tokens, top-20
logprobs) go to each server alone, one at a time, then ``--runs`` times at
``--concurrency``, the two servers taking turns. Every concurrent output is
compared with the same server's solo output:

* ``same``: identical token ids;
* ``tie``: they part at a numerical near-tie (each pick within ``--tie-margin``
  nats of the other run's pick in both runs' top-20);
* ``far``: they part where one pick is outside the other run's top-20 or
  further than the margin: a discrete flip upstream (the attention layer is
  batch invariant, tests/core/test_batch_invariance.py, so in this random tiny
  model that is MoE routing or a GEMM's batch-shape dependent rounding).

Before the first divergence it also reports the largest top-1 logprob drift.
Attention that is batch invariant gives 0 drift only if the rest of the
model is too; vLLM's CPU GEMMs and MoE are not, so the bar is the comparison
with vLLM's own layer in the same run, not identity.

``python -m vllm_dsv4_backend.bench.solo_identity [--runs 2] [--json out.json]``.
vLLM runs only in subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from vllm_dsv4_backend.bench import ab
from vllm_dsv4_backend.bench.ab import SIDES

SCHEMA = "vllm-dsv4-solo-identity/1"
TOP_N = 20  # logprobs per step (vLLM's default max_logprobs)


def make_prompts(model_dir: Path, n: int, seed: int = 0, max_words: int = 250) -> list[list[int]]:
    """``n`` prompts of 1..``max_words`` ordinary tokens (no added/special ones)."""
    ids = ab.ordinary_token_ids(model_dir)
    rng = random.Random(seed)
    lengths = [1, max_words] + [rng.randint(1, max_words) for _ in range(max(0, n - 2))]
    return [[rng.choice(ids) for _ in range(k)] for k in lengths[:n]]


async def complete(session: Any, url: str, model: str, prompt: list[int], tokens: int
                   ) -> dict[str, Any]:
    """``tokens`` greedy tokens (``ignore_eos``) after ``prompt`` with each step's top-N
    logprobs (:data:`TOP_N`): ``token_ids``, ``logprobs`` (the picks'), ``top`` (token id
    -> logprob per step) and ``finish_reason``; ``{"error": ...}`` on an HTTP error.
    The served tests (``tests/support/served.py``) send theirs through it too."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": TOP_N, "return_token_ids": True,
            "return_tokens_as_token_ids": True}  # top-N keyed "token_id:<id>", not text
    async with session.post(f"{url}/v1/completions", json=body) as r:
        text = await r.text()
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {text[:300]}"}
    choice = json.loads(text)["choices"][0]
    lp = choice["logprobs"]
    return {"token_ids": choice.get("token_ids"), "logprobs": lp["token_logprobs"],
            "top": [{int(k.split(":")[1]): v for k, v in step.items()}
                    for step in lp["top_logprobs"]],
            "finish_reason": choice["finish_reason"]}


async def _run_all(url: str, model: str, prompts: Sequence[list[int]], tokens: int,
                   concurrency: int) -> list[dict[str, Any]]:
    sem = asyncio.Semaphore(concurrency)
    async with ab.client_session() as session:
        async def one(p: list[int]) -> dict[str, Any]:
            async with sem:
                return await complete(session, url, model, p, tokens)

        if concurrency == 1:
            return [await one(p) for p in prompts]
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def classify(conc: dict[str, Any], solo: dict[str, Any], tie_margin: float
             ) -> tuple[str, float, str]:
    """(``same`` | ``tie`` | ``far``, top-1 logprob drift before any divergence, why)."""
    a_ids, b_ids = conc["token_ids"], solo["token_ids"]
    k = next((i for i, (a, b) in enumerate(zip(a_ids, b_ids)) if a != b), None)
    upto = len(a_ids) if k is None else k
    drift = max((abs(x - y) for x, y in zip(conc["logprobs"][:upto], solo["logprobs"][:upto])),
                default=0.0)
    if k is None:
        return "same", drift, ""
    a, b = a_ids[k], b_ids[k]
    top_c, top_s = conc["top"][k], solo["top"][k]
    if b not in top_c or a not in top_s:
        return "far", drift, f"step {k}: {a} vs {b} outside each other's top-{TOP_N}"
    gap = max(top_c[a] - top_c[b], top_s[b] - top_s[a])
    kind = "tie" if gap <= tie_margin else "far"
    return kind, drift, f"step {k}: {a} vs {b}, gap {gap:.3f}"


def summarize(solo: Sequence[dict[str, Any]], concurrent: Sequence[Sequence[dict[str, Any]]],
              prompts: Sequence[list[int]], tie_margin: float) -> dict[str, Any]:
    """Counts of one server's concurrent outputs against its solo ones."""
    counts = {"same": 0, "tie": 0, "far": 0, "error": 0}
    drifts: list[float] = []
    far: list[str] = []
    for r, conc in enumerate(concurrent):
        for i, (c, s) in enumerate(zip(conc, solo)):
            if "error" in c or "error" in s:
                counts["error"] += 1
                continue
            kind, drift, why = classify(c, s, tie_margin)
            counts[kind] += 1
            drifts.append(drift)
            if kind == "far":
                far.append(f"run {r} prompt {i} ({len(prompts[i])} tokens): {why}, "
                           f"drift before {drift:.4f}")
    return {**counts, "outputs": sum(len(c) for c in concurrent),
            "max_drift": max(drifts, default=None), "far_cases": far}


def run(*, prompts: int = 24, tokens: int = 16, concurrency: int = 16, runs: int = 2,
        tie_margin: float = 1.0, health_timeout: float = 1200.0,
        progress: TextIO | None = sys.stderr) -> dict[str, Any]:
    say = ab.sayer("solo-identity", progress)
    t0 = time.monotonic()
    outputs: dict[str, dict[str, Any]] = {side: {"solo": None, "concurrent": []}
                                          for side in SIDES}
    with ab.served_layers("solo-identity", health_timeout=health_timeout,
                          progress=progress) as (serve, out, servers):
        reqs = make_prompts(serve.model_path, prompts)
        for side in SIDES:
            say(f"{side}: {len(reqs)} prompts one at a time")
            outputs[side]["solo"] = asyncio.run(_run_all(
                servers[side].base_url, serve.served_model_name, reqs, tokens, 1))
        for r in range(runs):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                say(f"{side}: concurrent run {r + 1}/{runs} (concurrency {concurrency})")
                outputs[side]["concurrent"].append(asyncio.run(_run_all(
                    servers[side].base_url, serve.served_model_name, reqs, tokens,
                    concurrency)))
    (out / "outputs.json").write_text(json.dumps({"prompts": reqs, "outputs": outputs}))

    summary = {side: summarize(outputs[side]["solo"], outputs[side]["concurrent"], reqs,
                               tie_margin) for side in SIDES}
    return {"schema": SCHEMA, "prompts": len(reqs), "tokens": tokens,
            "concurrency": concurrency, "runs": runs, "tie_margin": tie_margin,
            "summary": summary, "out_dir": str(out), "wall_s": time.monotonic() - t0}


def format_result(res: dict[str, Any]) -> str:
    lines = [(f"{res['prompts']} prompts x {res['runs']} runs at concurrency "
              f"{res['concurrency']} vs each server's solo run ({res['tokens']} greedy tokens)"),
             f"{'layer':<8}{'same':>6}{'tie':>6}{'far':>6}{'error':>7}{'max drift':>11}"]
    for impl, s in res["summary"].items():
        drift = "n/a" if s["max_drift"] is None else f"{s['max_drift']:.4f}"
        lines.append(f"{impl:<8}{s['same']:>3}/{s['outputs']:<2}{s['tie']:>6}{s['far']:>6}"
                     f"{s['error']:>7}{drift:>11}")
        lines.extend(f"    far: {w}" for w in s["far_cases"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = ab.parser(__doc__)
    p.add_argument("--prompts", type=ab.positive, default=24)
    p.add_argument("--tokens", type=ab.positive, default=16)
    p.add_argument("--concurrency", type=ab.positive, default=16)
    p.add_argument("--runs", type=ab.positive, default=2,
                   help="concurrent runs per layer (default 2)")
    p.add_argument("--tie-margin", type=float, default=1.0)
    args = p.parse_args(argv)
    return ab.conclude("solo-identity", lambda: run(
        prompts=args.prompts, tokens=args.tokens, concurrency=args.concurrency,
        runs=args.runs, tie_margin=args.tie_margin), format_result, args.json)


if __name__ == "__main__":
    sys.exit(main())
