# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor parallel 2 on vLLM's CPU build: the tiny model under TP 2 vs TP 1.

Four servers of the same serve config answer the same 16 requests one at a
time (prompts of 1..600 tokens from the load test's set, so window-only, C4
top-k and C128 paths all run; 8..16 greedy tokens): the session's
``tiny_server`` (TP 1, the plugin's layer), and TP 2 with the plugin's layer,
with vLLM's own, and with the seed's full command line (expert parallel, see
``SEED_FLAGS``). Under TP 2 each rank holds 4 of the 8 query heads (its
attention-sink slice; padded heads at -inf), half of every expert's
intermediate dimension (no expert parallelism) and half of each
column/row-parallel weight. The seeded dummy weights are generated
whole and sharded by vLLM's own weight loaders (``dummy_init.init_model_``),
so every TP size serves the same model.

1. TP 2, plugin vs vLLM's layer: same partitioning, same all-reduce, same
   kernels in the same order, so the TP 1 parity test's rule: identical tokens,
   top-1 logprobs within 1e-6. This is what checks the plugin's per-rank heads,
   sinks and padding.
2. TP 2 vs TP 1 (plugin): TP 2 rounds differently (each rank's partial sums
   are bf16 before the all-reduce; MoE experts sum across ranks) and the
   random tiny model has many near-ties (top-1 near -3.6 over 512 tokens), so
   exact equality of every greedy token is not a property vLLM's CPU path
   has. The rule is the load test's (``compare_outputs``): same tokens, or a
   first divergence at a near-tie, with top-1 logprobs close before it; the
   near-tie margin is TP's own (``TP_TIE_MARGIN``, from the teacher-forced
   bound). Measured (16 requests): 4-5 identical, the rest part at near-ties
   (gaps <= 0.48 on AMX and AVX2 machines, one 1.016 on an AMD EPYC), drift
   before divergence <= 0.48.
3. Teacher-forced, the check that both TP sizes serve the same model: every
   prompt plus TP 1's continuation is scored by both (``prompt_logprobs``),
   and the per-position differences must be rounding-sized (measured p50
   0.022, p99 0.44; bounds below); a different model moves most positions by
   ~1 nat.

CPU binding: vLLM binds one OpenMP thread group per rank and its automatic
binding wants one NUMA node per rank, so the test pins the ranks to halves of
this process's CPUs (``VLLM_CPU_OMP_THREADS_BIND=0|1`` on 2 CPUs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("aiohttp")

from test_load_corruption import (  # noqa: E402  (tests/vllm is on sys.path)
    SERVE_CONFIG,
    Target,
    _run_all,
    compare_outputs,
    make_requests,
)

from vllm_dsv4_backend import runner as R  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = Path(os.environ.get("DSV4_SCRATCH", ROOT / ".scratch"))
HEALTH_TIMEOUT = float(os.environ.get("DSV4_TEST_HEALTH_TIMEOUT", 600))
N_REQUESTS = 16
PARITY_ATOL = 1e-6  # the same kernels in the same order: identical (as tests/vllm/test_parity.py)
MAX_TIES = N_REQUESTS * 3 // 4  # measured 11 of 16
# Teacher-forced TP 1 vs TP 2 |logprob| differences over 1874 positions, measured: p50
# 0.022, p90 0.14, p99 0.44, max 1.05. The median is rounding-sized; the tail is probably
# rounding flipping near-ties upstream (MoE top-6 routing over 64 experts), not measured
# separately. A different model moves the median itself to ~1 nat.
FORCED_P50 = 0.05
FORCED_P99 = 0.75
# Greedy TP 1 vs TP 2: a divergence is a near-tie if each pick is within this margin of the
# other's in both runs. Each run's logprobs sit within the teacher-forced bound of the other's,
# so the gap between two picks can open by twice that: 2 x FORCED_P99, still below the
# ~2.6 nats a foreign hidden state costs (test_load_corruption). Measured: gaps <= 0.48 on an
# AVX512-BF16/AMX Xeon and the AVX2 path; one of 1.016 on an AMD EPYC without AMX (2026-12-02,
# teacher-forced max 0.75 there), past the load test's 1.0.
TP_TIE_MARGIN = 2 * FORCED_P99


# TP 2 servers: the plugin's layer, vLLM's own, and the seed's full command line (expert
# parallel, the MXFP4 indexer flag users know, the seed's all2all backend and tokenizer
# mode). The test prompts (<= 600 tokens) select every compressed entry, so the indexer
# cache dtype cannot change their outputs: EP vs TP 2 is expert placement alone.
SEED_FLAGS = [
    "--enable-expert-parallel", "--attention-config", '{"use_fp4_indexer_cache":true}',
    "--all2all-backend", "allgather_reducescatter", "--tokenizer-mode", "deepseek_v4",
]
VARIANTS: dict[str, list[str]] = {"plugin": [], "vllm": [], "plugin_ep": SEED_FLAGS}


def _bind_list(n: int) -> str | None:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < n:
        return None
    per = len(cpus) // n
    return "|".join(",".join(str(c) for c in cpus[i * per:(i + 1) * per]) for i in range(n))


@pytest.fixture(scope="module")
def tp2_servers(tmp_path_factory) -> Iterator[dict[str, Target]]:
    """TP 2 servers of the serve config: the plugin's layer and vLLM's own, started together
    (their imports overlap) and stopped at the end of the module."""
    bind = _bind_list(2)
    if bind is None:
        pytest.skip("tensor parallel 2 on the CPU build needs 2 CPUs (one per rank)")
    serve = R.load_serve_config(SERVE_CONFIG)
    root = tmp_path_factory.mktemp("tp2")
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, extra in VARIANTS.items():
            impl = "vllm" if name == "vllm" else "plugin"
            env = R.cpu_env(SCRATCH, {
                **os.environ, "VLLM_DSV4_ATTN_IMPL": impl, "VLLM_CPU_OMP_THREADS_BIND": bind,
                "VLLM_DSV4_MARKER_DIR": str(root / f"markers-{name}"),
            })  # fmt: skip
            srv = stack.enter_context(R.make_server(
                serve, log_path=root / f"server-{name}.log", env=env,
                extra_args=["--tensor-parallel-size", "2", *extra]))
            servers[name] = (srv, root / f"server-{name}.log")
        out = {}
        for impl, (srv, log) in servers.items():
            srv.wait_healthy(timeout=HEALTH_TIMEOUT)
            out[impl] = Target(srv.base_url, serve.served_model_name, log, impl, "tp2")
        yield out


@pytest.fixture(scope="module")
def outputs(tiny_server, tp2_servers) -> dict[str, list[dict]]:
    """The same requests, one at a time, on TP 1 (plugin) and both TP 2 servers."""
    if tiny_server.attn_impl != "plugin":
        pytest.skip("the session server runs vLLM's layer (VLLM_DSV4_ATTN_IMPL); this test "
                    "compares the plugin's")
    reqs = make_requests(R.load_serve_config(SERVE_CONFIG).model_path)[:N_REQUESTS]
    out = {"requests": reqs,
           "tp1": asyncio.run(_run_all(tiny_server.base_url, tiny_server.model, reqs, 1))}
    for impl, t in tp2_servers.items():
        out[f"tp2_{impl}"] = asyncio.run(_run_all(t.base_url, t.model, reqs, 1))
    dump = tp2_servers["plugin"].log.parent / "tp-outputs.json"
    dump.write_text(json.dumps(out))
    for k in ("tp1", *(f"tp2_{name}" for name in VARIANTS)):
        failed = [(i, r["error"]) for i, r in enumerate(out[k]) if "error" in r]
        assert not failed, f"{k}: requests failed: {failed[:4]} (logs: {dump.parent})"
        for req, r in zip(reqs, out[k]):
            assert len(r["token_ids"]) == req["max_tokens"]
    for impl, t in tp2_servers.items():
        assert "TP rank 1/2" in t.log.read_text(errors="replace"), f"{impl}: no second rank"
    # Teacher forcing: each prompt + TP 1's continuation, scored by both TP sizes.
    forced = [r["prompt"] + o["token_ids"] for r, o in zip(reqs, out["tp1"])]
    out["forced_tp1"] = [_prompt_logprobs(tiny_server.base_url, tiny_server.model, ids)
                         for ids in forced]
    t2 = tp2_servers["plugin"]
    out["forced_tp2"] = [_prompt_logprobs(t2.base_url, t2.model, ids) for ids in forced]
    dump.write_text(json.dumps(out))
    return out


def _prompt_logprobs(base_url: str, model: str, ids: list[int]) -> list[float]:
    """Log-probability of every token of ``ids`` given the ones before it (one prefill)."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                       "prompt_logprobs": 1}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        steps = json.loads(r.read())["choices"][0]["prompt_logprobs"]
    return [step[str(tok)]["logprob"] for step, tok in zip(steps[1:], ids[1:])]


def _verdicts(a: list[dict], b: list[dict], reqs: list[dict], **rule) -> dict[str, list[str]]:
    verdicts: dict[str, list[str]] = {"same": [], "tie": [], "bad": []}
    for i, (req, x, y) in enumerate(zip(reqs, a, b)):
        kind, why = compare_outputs(x, y, **rule)
        verdicts[kind].append(f"#{i} (prompt {len(req['prompt'])}): {why}")
    return verdicts


def test_tp2_plugin_layer_equals_vllm_layer(outputs) -> None:
    """Same partitioning, same all-reduce: the plugin's per-rank attention (4 of 8 heads,
    the rank's sink slice, padding) must give vLLM's own layer's outputs."""
    v = _verdicts(outputs["tp2_plugin"], outputs["tp2_vllm"], outputs["requests"],
                  tie_margin=0.0, drift_atol=PARITY_ATOL)
    print(f"TP 2, plugin vs vLLM layer: { {k: len(x) for k, x in v.items()} }; {v}")
    assert not v["bad"] and not v["tie"], f"plugin vs vLLM layer under TP 2: {v}"


def test_seed_command_line_serves_with_expert_parallel(outputs, tp2_servers) -> None:
    """vLLM 0.32's CPU experts ignore expert_map, so TP 2 + EP segfaulted on the first
    request (cpu_fused_moe read past the rank's local experts). With the plugin's
    moe_expert_map patch every request completes (checked by the fixture), in the worker the
    patch is applied, and the outputs are TP 2's up to the reduction order of the experts
    (the same near-tie rule as TP 2 vs TP 1)."""
    log = tp2_servers["plugin_ep"].log
    markers = [json.loads(p.read_text()) for p in (log.parent / "markers-plugin_ep").glob("*.json")]
    applied = [a for m in markers for a in m.get("applied", [])]
    assert any("honours expert_map" in str(a) for a in applied), markers
    v = _verdicts(outputs["tp2_plugin"], outputs["tp2_plugin_ep"], outputs["requests"])
    summary = {k: len(x) for k, x in v.items()}
    print(f"TP 2 + EP vs TP 2 (plugin): {summary}; {v}")
    assert not v["bad"], f"TP 2 + EP differs from TP 2 beyond rounding {summary}: {v['bad']}"
    # No cap on the number of near-ties here: EP reorders the sum over the 6 routed experts
    # in every layer of every token, and how many of 16 greedy runs that flips depends on the
    # kernels' rounding (<= 12 on vLLM's C++ kernels and on a first AVX2-path run, 15 on
    # another). Each tie still passed the per-divergence rule: top-1 drift <= the bound
    # before it, both picks within the margin in both runs' top-N.


def test_tp2_greedy_equals_tp1(outputs) -> None:
    v = _verdicts(outputs["tp1"], outputs["tp2_plugin"], outputs["requests"],
                  tie_margin=TP_TIE_MARGIN)
    summary = {k: len(x) for k, x in v.items()}
    print(f"TP 1 vs TP 2 (plugin): {summary}; {v}")
    assert not v["bad"], f"TP 2 differs from TP 1 beyond rounding {summary}: {v['bad']}"
    assert len(v["tie"]) <= MAX_TIES, f"too many near-tie divergences {summary}: {v['tie']}"


def test_tp2_scores_tp1_tokens_like_tp1(outputs) -> None:
    """Teacher-forced: the same token sequences scored under TP 1 and TP 2 (every prompt
    position plus TP 1's continuation). Same model, different rounding: small differences
    everywhere, no systematic shift. A different model (e.g. rank-dependent weights, the
    bug this guards against) moves them by ~1 nat at most positions."""
    diffs = sorted(abs(a - b) for x, y in zip(outputs["forced_tp1"], outputs["forced_tp2"])
                   for a, b in zip(x, y))
    assert len(diffs) > 1000
    q = {p: diffs[min(len(diffs) - 1, int(p / 100 * len(diffs)))] for p in (50, 90, 99)}
    print(f"TP 1 vs TP 2 teacher-forced |logprob diff| over {len(diffs)} positions: "
          f"p50 {q[50]:.4f}, p90 {q[90]:.4f}, p99 {q[99]:.4f}, max {diffs[-1]:.4f}")
    assert q[50] <= FORCED_P50 and q[99] <= FORCED_P99, q
