# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""bench.solo_identity without a server: the verdict rules, the prompt set and the
table (the CLI reaching the module: tests/core/test_bench_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_dsv4_backend.bench import solo_identity as SI

ROOT = Path(__file__).resolve().parents[2]


def _out(ids, lps, tops):
    return {"token_ids": ids, "logprobs": lps, "top": tops}


def test_classify_same_tie_far():
    top = [{1: -3.6, 2: -3.7}, {4: -3.5, 5: -3.55}]
    solo = _out([1, 4], [-3.6, -3.5], top)
    assert SI.classify(solo, solo, 1.0)[:2] == ("same", 0.0)
    # parts at a near-tie: 2 vs 1, within 0.1 nats in both runs
    tie = _out([2, 4], [-3.62, -3.5], [{2: -3.62, 1: -3.65}, {4: -3.5}])
    kind, drift, why = SI.classify(tie, solo, 1.0)
    assert kind == "tie" and "step 0" in why
    # a pick outside the other run's top-20: far, whatever the margin
    far = _out([9, 4], [-3.6, -3.5], [{9: -3.6, 1: -5.0}, {4: -3.5}])
    assert SI.classify(far, solo, 100.0)[0] == "far"
    # in each other's top but beyond the margin: far; drift before the split is reported
    gap = _out([1, 5], [-3.9, -3.4], [{1: -3.9}, {5: -3.4, 4: -6.0}])
    kind, drift, _ = SI.classify(gap, solo, 1.0)
    assert kind == "far" and drift == pytest.approx(0.3)


def test_prompts_are_deterministic_and_span_the_lengths():
    model = ROOT / "configs" / "tiny-dsv4"
    a = SI.make_prompts(model, 24)
    assert a == SI.make_prompts(model, 24)
    assert len(a) == 24 and min(map(len, a)) == 1 and max(map(len, a)) == 250


def test_summarize_and_format():
    solo = [_out([1, 4], [-3.6, -3.5], [{1: -3.6, 2: -3.7}, {4: -3.5}])] * 2
    far = _out([9, 4], [-3.6, -3.5], [{9: -3.6}, {4: -3.5}])
    summary = SI.summarize(solo, [[solo[0], far], [solo[0], {"error": "HTTP 500"}]],
                           [[5], [6, 7]], 1.0)
    assert {k: summary[k] for k in ("same", "tie", "far", "error", "outputs")} == {
        "same": 2, "tie": 0, "far": 1, "error": 1, "outputs": 4}
    assert summary["far_cases"] == [
        ("run 0 prompt 1 (2 tokens): step 0: 9 vs 1 outside each other's top-20, drift before "
        "0.0000")]
    text = SI.format_result({"prompts": 2, "runs": 2, "concurrency": 16, "tokens": 2,
                             "summary": {"plugin": summary, "vllm": summary}})
    assert "plugin    2/4      0     1      1" in text and "far: run 0 prompt 1" in text

