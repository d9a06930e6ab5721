# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Offline accuracy smoke: real lm_eval (``local-completions``) against the tiny
model served by real vLLM, through ``vllm-dsv4-run`` (its ``--base-url`` mode).

Two servers of the same model and seeded weights: the plugin's attention
(``VLLM_DSV4_ATTN_IMPL=plugin``) and vLLM's own DeepSeek-V4 CPU attention
(``VLLM_DSV4_ATTN_IMPL=vllm``). One of them is the session's ``tiny_server``
(tests/vllm/conftest.py, the plugin's by default); this module starts the
other once, overlapping its start with the session server's, and stops it.
Tasks: the two local JSONL tasks in ``configs/lm_eval/tasks``
(16 generate_until docs, 16 multiple_choice docs = 64 loglikelihood requests).

Checks: lm_eval completes and scores every sample on both servers; every
tiny-smoke gate (exact score equality, two-sided, tol 0) passes with the vLLM
run as the baseline; and, stronger than the aggregate, each doc's generation
is identical and each choice's loglikelihood agrees within LOGLIK_ATOL.

``DSV4_TEST_SERVE_CONFIG`` overrides the serve config (e.g. a throwaway model
while developing); the attention switch then only matters for DeepSeek-V4.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lm_eval")

from tests.support.vllm_helpers import local_serve_config  # noqa: E402
from vllm_dsv4_backend import run as R  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIG = Path(
    os.environ.get("DSV4_TEST_SERVE_CONFIG", ROOT / "configs/serve/tiny-dsv4-cpu.yaml")
)
EVAL_CONFIG = ROOT / "configs" / "lm_eval" / "tiny-smoke.yaml"
SCRATCH = Path(os.environ.get("DSV4_SCRATCH", ROOT / ".scratch"))
IMPLS = ("plugin", "vllm")
N_DOCS = {"dsv4_smoke_arith": 16, "dsv4_smoke_choice": 16}
# Sum of a continuation's token logprobs, plugin vs vLLM attention. Both read
# the same fp8 KV bytes; bf16 rounding and summation order differ.
LOGLIK_ATOL = 0.1
HEALTH_TIMEOUT = float(os.environ.get("DSV4_TEST_HEALTH_TIMEOUT", 600))


def predicted_session_impl() -> str | None:
    """The attention impl conftest's session ``tiny_server`` will have (its rule:
    the caller's VLLM_DSV4_ATTN_IMPL, default "plugin"), checked once it runs;
    None if it cannot stand in for SERVE_CONFIG (another config was chosen)."""
    if "DSV4_TEST_SERVE_CONFIG" in os.environ:
        return None
    return os.environ.get("VLLM_DSV4_ATTN_IMPL", "plugin")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Iterator[dict[str, Path]]:
    """lm_eval against both attention paths; returns impl -> run dir.

    The session server (tests/vllm/conftest.py) serves one impl; this module
    starts a server only for the other (overlapping the two starts) and stops
    it at the end of the module.
    """
    serve = local_serve_config(SERVE_CONFIG)
    base = tmp_path_factory.mktemp("lm_eval_smoke")
    predicted = predicted_session_impl()
    own: dict[str, R.ServerProcess] = {}

    def start(impl: str) -> None:
        env = R.cpu_env(SCRATCH, {**os.environ, "VLLM_DSV4_ATTN_IMPL": impl})
        own[impl] = R.make_server(serve, log_path=base / impl / "server.log", env=env).start()

    try:
        for impl in IMPLS:
            if impl != predicted:
                start(impl)
        urls = {}
        if predicted is not None:
            tiny = request.getfixturevalue("tiny_server")
            assert tiny.model == serve.served_model_name
            if tiny.attn_impl in IMPLS and tiny.attn_impl not in own:
                urls[tiny.attn_impl] = tiny.base_url
        for impl in IMPLS:  # whatever the session server did not cover
            if impl not in urls and impl not in own:
                start(impl)
        for impl, srv in own.items():
            srv.wait_healthy(timeout=HEALTH_TIMEOUT)
            urls[impl] = srv.base_url
        out = {}
        for impl, url in urls.items():
            out[impl] = base / impl
            rc = R.main(
                [
                    "serve-eval", str(SERVE_CONFIG), str(EVAL_CONFIG), "--no-gate",
                    "--base-url", url, "--out-dir", str(out[impl]), "--offline",
                    "--env", f"VLLM_DSV4_ATTN_IMPL={impl}",
                ]
            )  # fmt: skip
            assert rc == 0, f"lm_eval against the {impl} server failed; see {out[impl]}"
        yield out
    finally:
        for srv in own.values():
            srv.stop()


def _summary(run: Path) -> dict:
    return json.loads((run / "eval-summary.json").read_text())


def _samples(run: Path, task: str) -> list[dict]:
    files = sorted((run / "lm_eval").rglob(f"samples_{task}_*.jsonl"))
    assert files, f"no per-sample log for {task} under {run}"
    rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    # one row per (doc, filter); lm_eval writes numbers inside resps as strings
    return sorted(rows, key=lambda r: (r["filter"], r["doc_id"]))


def _logliks(row: dict) -> list[float]:
    """multiple_choice row -> one loglikelihood per choice (resps: [[[ll, greedy]], ...])."""
    return [float(choice[0][0]) for choice in row["resps"]]


@pytest.mark.parametrize("impl", IMPLS)
def test_harness_scores_every_sample(runs, impl: str) -> None:
    s = _summary(runs[impl])
    for task, n in N_DOCS.items():
        assert s["n-samples"][task] == {"original": n, "effective": n}
        table = s["results"][task]
        metrics = (
            ["exact_match,strict-match", "exact_match,flexible-extract"]
            if task == "dsv4_smoke_arith"
            else ["acc,none", "acc_norm,none"]
        )
        for m in metrics:
            assert isinstance(table[m], float) and 0.0 <= table[m] <= 1.0, (task, m, table)
        rows = _samples(runs[impl], task)
        # lm_eval logs one row per doc and filter; every doc must be scored
        by_doc: dict[int, list[dict]] = {}
        for r in rows:
            by_doc.setdefault(r["doc_id"], []).append(r)
        assert sorted(by_doc) == list(range(n))
        for doc_rows in by_doc.values():
            for r in doc_rows:
                key = "exact_match" if task == "dsv4_smoke_arith" else "acc"
                assert r[key] in (0.0, 1.0, 0, 1, True, False), r
                if task == "dsv4_smoke_arith":
                    assert isinstance(r["resps"][0][0], str)
                else:
                    lls = _logliks(r)  # one loglikelihood per choice
                    assert len(lls) == 4 and all(math.isfinite(x) and x < 0 for x in lls), r


def test_scores_equal_vllm_attention(runs) -> None:
    """The tiny-smoke gates: plugin scores == vLLM-attention scores, exactly."""
    ev = R.load_eval_config(EVAL_CONFIG)
    plugin, ref = _summary(runs["plugin"]), _summary(runs["vllm"])
    rows = R.gate_eval(ev.gates, plugin["results"], ref, "vllm attention run")
    table = R.format_gate_table(rows)
    assert rows and all(r.passed for r in rows), table
    # and through the CLI, as a user would check it
    rc = R.main(
        [
            "compare-eval", str(runs["plugin"] / "eval-summary.json"), str(EVAL_CONFIG),
            "--baseline", str(runs["vllm"] / "eval-summary.json"),
        ]
    )  # fmt: skip
    assert rc == 0


def test_per_sample_outputs_match_vllm_attention(runs) -> None:
    """Same generation for every doc; every choice's loglikelihood within LOGLIK_ATOL."""
    gen_p, gen_v = (_samples(runs[i], "dsv4_smoke_arith") for i in IMPLS)
    assert [(r["filter"], r["doc_id"]) for r in gen_p] == [
        (r["filter"], r["doc_id"]) for r in gen_v
    ]
    diffs = [
        (a["doc_id"], a["resps"][0][0], b["resps"][0][0])
        for a, b in zip(gen_p, gen_v)
        if a["filter"] == "strict-match" and a["resps"] != b["resps"]
    ]
    assert not diffs, f"generations differ (doc, plugin, vllm): {diffs[:4]}"
    mc_p, mc_v = (_samples(runs[i], "dsv4_smoke_choice") for i in IMPLS)
    worst = 0.0
    for a, b in zip(mc_p, mc_v):
        assert a["doc_id"] == b["doc_id"]
        for la, lb in zip(_logliks(a), _logliks(b)):
            worst = max(worst, abs(la - lb))
    assert worst <= LOGLIK_ATOL, f"loglikelihoods differ by up to {worst:.4f}"
