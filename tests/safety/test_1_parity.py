# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Safety item 1: token parity with the non-reuse baseline.

The tiny DeepSeek-V4 (configs/tiny-dsv4, ``--load-format dummy`` with its seeded
weights, fp8 KV cache, eager) served by the plugin's layer in a real vLLM engine, once
per workspace policy: ``off`` (every buffer a fresh allocation: the baseline),
``shared`` (the layers take the same slots in turn) and ``private`` (one set of
buffers per layer). Prompts of
1, 17, 130, 520, 1100 and 2100 tokens (beyond the 128-token window, C128 entries
visible, and beyond 4 x index_topk = 2048, where the lightning indexer's real top-k
runs), one request at a time, 16 greedy tokens, top-20 logprobs.

Claim: ``shared`` and ``private`` give the same generated tokens and the same top-20
logprobs as ``off``, **bitwise** (the same float values, not within a tolerance).

Extra modes (the CUDA graph harness of tools/cuda_graph/) join through
``conftest.EXTRA_PARITY_VARIANTS`` and are held to the same bitwise bar.
"""

from __future__ import annotations

import math
from typing import Any

from tests.support.safety import EXTRA_PARITY_VARIANTS, PARITY_LENGTHS, PARITY_TOKENS, TOP_LOGPROBS

BASELINE = "off"


def bitwise_problems(ref: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    """Every difference: a token id, a top-k id set, or any logprob value (``!=``)."""
    problems = []
    for i, (a, b) in enumerate(zip(ref, new, strict=True)):
        if a["token_ids"] != b["token_ids"]:
            k = next(j for j, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"]))
                     if x != y)
            problems.append(f"prompt {i}: tokens differ from step {k}")
            continue
        for k, (sa, sb) in enumerate(zip(a["top"], b["top"], strict=True)):
            if sa != sb:  # same ids and the very same float per id
                problems.append(f"prompt {i} step {k}: top-{len(sa)} logprobs differ")
                break
    return problems


def test_shared_and_private_are_bitwise_the_baseline(engine_runs, figures):
    ref = engine_runs[BASELINE]["runs"]["parity@1"]
    assert [len(o["token_ids"]) for o in ref] == [PARITY_TOKENS] * len(PARITY_LENGTHS)
    # informative outputs (seeded fan-in weights), all finite
    assert all(math.isfinite(v) for o in ref for s in o["top"] for v in s.values())
    assert max(ref[0]["top"][0].values()) > -5.0
    compared = [n for n in ("shared", "private", *EXTRA_PARITY_VARIANTS) if n in engine_runs]
    results = {}
    for name in compared:
        results[name] = bitwise_problems(ref, engine_runs[name]["runs"]["parity@1"])
    # The workspace really served: no allocation by the manager under shared/private,
    # one per view under off.
    for name in {"shared", "private"} & set(compared):
        (st,) = engine_runs[name]["stats"]
        assert st["policy"] == name and st["leases_total"] > 0 and st["allocations_total"] == 0
    (off,) = engine_runs["off"]["stats"]
    assert off["policy"] == "off" and off["allocations_total"] > 0

    tokens = sum(len(o["token_ids"]) for o in ref)
    logprobs = sum(len(s) for o in ref for s in o["top"])
    equal = [n for n in compared if not results[n]]
    figure = (f"{len(ref)} prompts of {min(PARITY_LENGTHS)}..{max(PARITY_LENGTHS)} tokens x "
              f"{PARITY_TOKENS} greedy tokens ({tokens} tokens, {logprobs} top-{TOP_LOGPROBS} "
              f"logprobs): bitwise equal to off: {', '.join(equal) or 'none'}"
              + "".join(f"; {n} DIFFERS ({results[n][0]})" for n in compared if results[n]))
    figures.record(1, figure, {"lengths": list(PARITY_LENGTHS), "tokens": tokens,
                               "logprobs": logprobs,
                               "problems": {n: results[n] for n in compared}})
    assert not any(results.values()), results
