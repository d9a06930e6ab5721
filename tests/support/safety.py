# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the safety tests share: the items, the engine settings, the prompts and the
variants of the shared engine run (see tests/safety/conftest.py)."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.vllm_helpers import TINY_ENGINE

MODEL = ROOT / "configs" / "tiny-dsv4"

ITEMS: dict[str, tuple[int, str]] = {
    "test_1_parity": (1, "token parity with the non-reuse baseline"),
    "test_2_stress": (2, "no contamination under concurrent stress"),
    "test_3_events": (3, "event evidence: no slot overwritten early"),
    "test_4_memory": (4, "peak memory not scaling with layers"),
    "test_5_cost": (5, "sync cost vs allocations saved"),
}

# Parity prompt lengths: 1 token, short, > the 128-token window (C128 visible), and
# beyond 4 x index_topk = 2048 (the lightning indexer's real top-k).
PARITY_LENGTHS = (1, 17, 130, 520, 1100, 2100)
PARITY_TOKENS = 16
TOP_LOGPROBS = 20
STRESS_CONCURRENCY = (16, 32)
# Long prefills that land among running decodes (the default run keeps the first).
STRESS_LONG = (700, 2100)

# {name: {"env": {...}, "engine": {...LLM kwargs}}}: more modes compared bitwise with
# ``off`` on the parity prompts (hook for tools/cuda_graph/, e.g. enforce_eager=False).
EXTRA_PARITY_VARIANTS: dict[str, dict[str, Any]] = {}

# The tests' tiny engine (whole prompts in one step), plus room for the stress
# concurrency, vLLM's sampling defaults and no prefix cache.
ENGINE = {
    **TINY_ENGINE,
    "max_num_seqs": 64,
    "generation_config": "vllm",
    "enable_prefix_caching": False,
}


def full_mode(config: pytest.Config) -> bool:
    return bool(config.getoption("--safety-full", default=False)) or \
        os.environ.get("DSV4_SAFETY_FULL", "0") not in ("", "0")


def _random_prompt(rng: random.Random, n: int) -> list[int]:
    # Token ids straight to the engine (no re-tokenization); the lowest ids are the
    # tiny tokenizer's special tokens (as tests/vllm/test_parity.py).
    vocab = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    return [rng.randrange(16, vocab) for _ in range(n)]


def engine_spec(full: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(plugin worker spec, vLLM-layer worker spec)."""
    from vllm_dsv4_backend.bench import solo_identity as SI

    rng = random.Random(292)
    parity = [_random_prompt(rng, n) for n in PARITY_LENGTHS]
    n_stress, tokens = (96, 16) if full else (40, 8)
    stress = SI.make_prompts(MODEL, n_stress, seed=292)
    for k, n in enumerate(STRESS_LONG if full else STRESS_LONG[:1]):
        stress.insert(5 + 11 * k, _random_prompt(rng, n))
    sets = {"parity": {"prompts": parity, "max_tokens": PARITY_TOKENS},
            "stress": {"prompts": stress, "max_tokens": tokens}}
    plugin = {"VLLM_DSV4_ATTN_IMPL": "plugin"}
    stress_runs = [["stress", 1]] + [["stress", c] for c in STRESS_CONCURRENCY]
    # Item 5 times the parity steps (solo); the full run adds concurrent steps.
    timed_runs = [["parity", 1]] + ([["stress", 16]] if full else [])
    variants: dict[str, Any] = {
        "off": {"env": {**plugin, "VLLM_DSV4_WORKSPACE": "off"},
                "runs": timed_runs, "time_workspace": True},
        "shared": {"env": {**plugin, "VLLM_DSV4_WORKSPACE": "shared"},
                   "runs": timed_runs, "time_workspace": True},
    }
    variants["private"] = {"env": {**plugin, "VLLM_DSV4_WORKSPACE": "private"},
                           "runs": [["parity", 1]]}
    variants |= {
        "shared_debug": {"env": {**plugin, "VLLM_DSV4_WORKSPACE": "shared",
                                 "VLLM_DSV4_WORKSPACE_DEBUG": "1"},
                         "runs": stress_runs},
    }
    for name, v in EXTRA_PARITY_VARIANTS.items():
        variants[name] = {"env": {**plugin, **v.get("env", {})}, "engine": v.get("engine", {}),
                          "runs": [["parity", 1]]}
    base = {"model": str(MODEL), "engine": ENGINE, "logprobs": TOP_LOGPROBS,
            "prompt_sets": sets}
    vllm_spec = {**base, "env": {"VLLM_DSV4_ATTN_IMPL": "vllm"},
                 "variants": {"vllm": {"runs": stress_runs}}}
    return {**base, "env": plugin, "variants": variants}, vllm_spec
