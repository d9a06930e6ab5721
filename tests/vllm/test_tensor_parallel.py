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
import json
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")
pytest.importorskip("aiohttp")

from tests.support import served as S  # noqa: E402
from vllm_dsv4_backend import run as R  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

N_REQUESTS = 16
PARITY_ATOL = 1e-6  # the same kernels in the same order: identical (as tests/vllm/test_parity.py)
MAX_TIES = N_REQUESTS * 3 // 4  # measured 11 of 16
# The TP 1 vs TP 2 bounds (teacher-forced FORCED_P50 / FORCED_P99, greedy TP_TIE_MARGIN) are
# tests.support.served's (S), with their measurements: the parallel layouts use them too.


# TP 2 servers: the plugin's layer, vLLM's own, and the seed's full command line (expert
# parallel, the MXFP4 indexer flag users know, the seed's all2all backend and tokenizer
# mode). The test prompts (<= 600 tokens) select every compressed entry, so the indexer
# cache dtype cannot change their outputs: EP vs TP 2 is expert placement alone.
SEED_FLAGS = [
    "--enable-expert-parallel", "--attention-config", '{"use_fp4_indexer_cache":true}',
    "--all2all-backend", "allgather_reducescatter", "--tokenizer-mode", "deepseek_v4",
]
VARIANTS: dict[str, list[str]] = {"plugin": [], "vllm": [], "plugin_ep": SEED_FLAGS}


@pytest.fixture(scope="module")
def tp2_servers(tmp_path_factory) -> Iterator[dict[str, S.Target]]:
    """TP 2 servers of the serve config: the plugin's layer and vLLM's own, started together
    (their imports overlap) and stopped at the end of the module."""
    bind = S.bind_list(2)
    if bind is None:
        pytest.skip("tensor parallel 2 on the CPU build needs 2 CPUs (one per rank)")
    launches = {
        name: S.Launch("vllm" if name == "vllm" else "plugin", "tp2",
                       args=["--tensor-parallel-size", "2", *extra],
                       env={"VLLM_CPU_OMP_THREADS_BIND": bind})
        for name, extra in VARIANTS.items()}
    with S.serve_together(tmp_path_factory.mktemp("tp2"), launches) as servers:
        yield servers


@pytest.fixture(scope="module")
def outputs(tiny_server, tp2_servers) -> dict[str, list[dict]]:
    """The same requests, one at a time, on TP 1 (plugin) and both TP 2 servers."""
    if tiny_server.attn_impl != "plugin":
        pytest.skip("the session server runs vLLM's layer (VLLM_DSV4_ATTN_IMPL); this test "
                    "compares the plugin's")
    reqs = S.make_requests(R.load_serve_config(S.SERVE_CONFIG).model_path)[:N_REQUESTS]
    out = {"requests": reqs,
           "tp1": asyncio.run(S.run_all(tiny_server.base_url, tiny_server.model, reqs, 1))}
    for impl, t in tp2_servers.items():
        out[f"tp2_{impl}"] = asyncio.run(S.run_all(t.base_url, t.model, reqs, 1))
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
    out["forced_tp1"] = [S.prompt_logprobs(tiny_server.base_url, tiny_server.model, ids)
                         for ids in forced]
    t2 = tp2_servers["plugin"]
    out["forced_tp2"] = [S.prompt_logprobs(t2.base_url, t2.model, ids) for ids in forced]
    dump.write_text(json.dumps(out))
    return out


def test_tp2_plugin_layer_equals_vllm_layer(outputs) -> None:
    """Same partitioning, same all-reduce: the plugin's per-rank attention (4 of 8 heads,
    the rank's sink slice, padding) must give vLLM's own layer's outputs."""
    v = S.verdicts_by_kind(outputs["tp2_plugin"], outputs["tp2_vllm"], outputs["requests"],
                           tie_margin=0.0, drift_atol=PARITY_ATOL)
    print(f"TP 2, plugin vs vLLM layer: { {k: len(x) for k, x in v.items()} }; {v}")
    assert not v["bad"] and not v["tie"], f"plugin vs vLLM layer under TP 2: {v}"


def test_seed_command_line_serves_with_expert_parallel(outputs, tp2_servers) -> None:
    """vLLM 0.32's CPU experts ignore expert_map, so TP 2 + EP segfaulted on the first
    request (cpu_fused_moe read past the rank's local experts). With the plugin's
    moe_expert_map patch every request completes (checked by the fixture), in the worker the
    patch is applied, and the outputs are TP 2's up to the reduction order of the experts
    (the same near-tie rule as TP 2 vs TP 1)."""
    marker_dir = tp2_servers["plugin_ep"].marker_dir
    assert marker_dir is not None
    markers = [json.loads(p.read_text()) for p in marker_dir.glob("*.json")]
    applied = [a for m in markers for a in m.get("applied", [])]
    assert any("honours expert_map" in str(a) for a in applied), markers
    v = S.verdicts_by_kind(outputs["tp2_plugin"], outputs["tp2_plugin_ep"], outputs["requests"])
    summary = {k: len(x) for k, x in v.items()}
    print(f"TP 2 + EP vs TP 2 (plugin): {summary}; {v}")
    assert not v["bad"], f"TP 2 + EP differs from TP 2 beyond rounding {summary}: {v['bad']}"
    # No cap on the number of near-ties here: EP reorders the sum over the 6 routed experts
    # in every layer of every token, and how many of 16 greedy runs that flips depends on the
    # kernels' rounding (<= 12 on vLLM's C++ kernels and on a first AVX2-path run, 15 on
    # another). Each tie still passed the per-divergence rule: top-1 drift <= the bound
    # before it, both picks within the margin in both runs' top-N.


def test_tp2_greedy_equals_tp1(outputs) -> None:
    v = S.verdicts_by_kind(outputs["tp1"], outputs["tp2_plugin"], outputs["requests"],
                           tie_margin=S.TP_TIE_MARGIN)
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
    assert q[50] <= S.FORCED_P50 and q[99] <= S.FORCED_P99, q
