# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Greedy parity of the plugin's layer with vLLM's own DeepSeek-V4 CPU layer.

The plugin's CPU layer is vLLM's layer plus the workspace: the same ``_C`` ops in
the same order (vLLM's real C++ kernels on AVX512-BF16 machines, the plugin's
registered torch fallbacks elsewhere), so on any machine the two must agree
**exactly**: the same tokens and every top-5 logprob within 1e-6. Prompts cover
prefill longer than the 128-token window, C128 visibility (>128 tokens) and one
prompt beyond 4 x index_topk tokens, so the lightning indexer's real top-k runs.

Variants with stated tolerances against it: ``VLLM_DSV4_KERNEL=torch`` (the
plugin's torch sparse MLA instead of vLLM's kernel: bf16-ulp differences that
compound through a random model full of near-ties, so only the first step,
where both see the same context, is compared) and the MXFP4 indexer cache. A
negative control (layer 0's sink shifted) must fail both comparisons.
"""

import json
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.support import served as S  # noqa: E402
from tests.support.vllm_helpers import TINY_ENGINE, run_workers_at_once  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs" / "tiny-dsv4"
NUM_TOKENS = 32
# Same kernels, same order: any difference is a bug, not rounding.
EXACT_ATOL = 1e-6
# First-step tolerances (same context, different arithmetic). Measured on an
# AVX512-BF16/AMX machine: torch-forced sparse MLA vs vLLM's C++ kernel moves the
# top-1 logprob by up to 0.10 (the C++ kernel rounds more: golden README), the
# MXFP4 indexer by 0.015 on the 2198-token prompt; on an AVX512-BF16 CPU without
# AMX (AMD Zen 4) the MXFP4 indexer by 0.062 (its 4-bit logits pick a different
# top-k at the boundary, and which entries sit there depends on the CPU's GEMM
# rounding). The sink-shifted control moves it by more than either bound.
TORCH_STEP0_ATOL = 0.15
MXFP4_STEP0_ATOL = 0.10
# Top logprobs per step.
TOP_LOGPROBS = 5


def _prompts(vocab: int, index_topk: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    lengths = [20, 300, 4 * index_topk + 150]
    # Skip the lowest ids (special tokens in the tiny tokenizer).
    return [[rng.randrange(16, vocab) for _ in range(n)] for n in lengths]


def exact_problems(ref: dict, new: dict, atol: float = EXACT_ATOL) -> list[str]:
    """Differences between two runs that must be identical: any token, any of the
    top logprobs (same ids, values within ``atol``)."""
    problems = []
    for i, (a, b) in enumerate(zip(ref["outputs"], new["outputs"])):
        if a["tokens"] != b["tokens"]:
            k = next(j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
            problems.append(f"prompt {i}: tokens differ from step {k}")
            continue
        for k, (sa, sb) in enumerate(zip(a["logprobs"], b["logprobs"])):
            if set(sa) != set(sb):
                problems.append(f"prompt {i} step {k}: top-{len(sa)} ids differ")
                break
            worst = max(abs(sa[t] - sb[t]) for t in sa)
            if not worst <= atol:
                problems.append(f"prompt {i} step {k}: logprob differs by {worst:.3g} > {atol}")
                break
    return problems


def step0_problems(ref: dict, new: dict, atol: float) -> list[str]:
    """First-step comparison (both runs see the prompt only): each run's pick is in
    the other's top logprobs and the top-1 logprob moved by at most ``atol``."""
    problems = []
    for i, (a, b) in enumerate(zip(ref["outputs"], new["outputs"])):
        sa, sb = a["logprobs"][0], b["logprobs"][0]
        x, y = str(a["tokens"][0]), str(b["tokens"][0])
        if y not in sa or x not in sb:
            problems.append(f"prompt {i}: first picks {x} vs {y} not in each other's top-k")
            continue
        drift = max(abs(sa[x] - sb[x]), abs(sa[y] - sb[y]))
        if not drift <= atol:
            problems.append(f"prompt {i}: first-step logprob moved by {drift:.4f} > {atol}")
    return problems


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    cfg = json.loads((MODEL / "config.json").read_text())
    plugin = {"VLLM_DSV4_ATTN_IMPL": "plugin"}
    spec = {
        "model": str(MODEL),
        "prompts": _prompts(cfg["vocab_size"], cfg["index_topk"]),
        "max_tokens": NUM_TOKENS,
        "logprobs": TOP_LOGPROBS,
        # Exact comparison needs the same batches in both runs (see parity_worker).
        "one_at_a_time": True,
        "engine": TINY_ENGINE,
        "variants": {
            "vllm": {"VLLM_DSV4_ATTN_IMPL": "vllm"},
            "plugin": plugin,
            "plugin_torch_mla": {**plugin, "VLLM_DSV4_KERNEL": "torch"},
            "plugin_sink_perturbed": {**plugin, "VLLM_DSV4_TEST_PERTURB_SINK": "3.0"},
            # The flag users know; vLLM itself refuses MXFP4 off Blackwell.
            "plugin_mxfp4_indexer": {
                "env": plugin,
                "engine": {"attention_config": {"use_fp4_indexer_cache": True}},
            },
            "plugin_kv_auto": {"env": plugin, "engine": {"kv_cache_dtype": "auto"}},
        },
    }
    d = tmp_path_factory.mktemp("parity")
    # Two workers at once, each on its own half of the CPUs (vLLM binds each engine's
    # threads there; one thread per engine on 2 CPUs, as a lone engine's automatic
    # binding gives it): the variants of each exact comparison share a worker.
    groups = [("vllm", "plugin", "plugin_kv_auto"),
              ("plugin_sink_perturbed", "plugin_mxfp4_indexer", "plugin_torch_mla")]
    bind = S.bind_list(2)
    binds: list[str | None] = bind.split("|") if bind else [None]
    if bind is None:
        groups = [tuple(v for g in groups for v in g)]
    envs = {}
    for i, bind in enumerate(binds):
        # A 2k-token prefill on a loaded 2-core box can exceed vLLM's 300 s step limit.
        env = {**os.environ, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1500"}
        if bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        envs[f"worker{i}"] = env
    parts = {f"worker{i}": {**spec, "variants": {v: spec["variants"][v] for v in group}}
             for i, group in enumerate(groups)}
    reports = run_workers_at_once(Path(__file__).with_name("parity_worker.py"), parts, d,
                                  envs, timeout=1800)
    runs = {k: v for r in reports.values() for k, v in r.items()}
    assert set(runs) == set(spec["variants"])
    return runs


def test_plugin_matches_vllm_cpu_attention(parity_runs):
    problems = exact_problems(parity_runs["vllm"], parity_runs["plugin"])
    assert not problems, problems
    # The outputs are informative (seeded fan-in weights), not the uniform
    # logits of vLLM's default dummy weights.
    first = parity_runs["vllm"]["outputs"][0]["logprobs"][0]
    assert max(first.values()) > -5.0
    assert all(len(o["tokens"]) == NUM_TOKENS for o in parity_runs["plugin"]["outputs"])


def test_negative_control_is_detected(parity_runs):
    perturbed = parity_runs["plugin_sink_perturbed"]
    assert exact_problems(parity_runs["vllm"], perturbed)
    assert step0_problems(parity_runs["vllm"], perturbed, TORCH_STEP0_ATOL)


def test_torch_sparse_mla_variant(parity_runs):
    problems = step0_problems(parity_runs["vllm"], parity_runs["plugin_torch_mla"],
                              TORCH_STEP0_ATOL)
    assert not problems, problems


def test_kv_cache_dtype_auto_is_the_fp8_ds_mla_cache(parity_runs):
    # auto resolves to the same 584 B fp8_ds_mla layout: identical results.
    assert not exact_problems(parity_runs["plugin"], parity_runs["plugin_kv_auto"])


def test_mxfp4_indexer_cache(parity_runs):
    fp8, fp4 = parity_runs["plugin"], parity_runs["plugin_mxfp4_indexer"]
    # Prompts with at most 4 x index_topk tokens select every compressed entry
    # whatever the indexer scores, so the indexer cache dtype cannot matter.
    short = {"outputs": fp8["outputs"][:2]}
    assert not exact_problems(short, {"outputs": fp4["outputs"][:2]})
    # Beyond that the MXFP4 logits pick the top-k: close to FP8's at the first
    # step, informative and finite throughout.
    assert not step0_problems(fp8, fp4, MXFP4_STEP0_ATOL)
    steps = fp4["outputs"][2]["logprobs"]
    assert len(steps) == NUM_TOKENS
    assert all(math.isfinite(v) for s in steps for v in s.values())
