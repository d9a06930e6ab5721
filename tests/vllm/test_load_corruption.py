# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load and corruption: concurrent traffic must not change any request's output.

The failure this guards against is vLLM PR #49236's (reverted in #52836): a
workspace shared across layers/streams let one request's producer overwrite
memory another was still reading, which showed up only under concurrent mixed
prefill and decode traffic as garbled output.

Against the tiny model served by real vLLM with the plugin's attention layer,
as ``shared`` with debug poisoning (``VLLM_DSV4_WORKSPACE`` at server start), and, with
``DSV4_FULL_LOAD=1``, as plain ``shared`` (the session's ``tiny_server`` is reused when it
has that setup; the debug run is the same execution plus poisoning, so the plain one
repeats it), as ``private`` (one set of buffers per layer, nothing shared; every run's
safety parity, tests/safety/test_1_parity.py, holds it bitwise to ``off``) and as
``shared`` with the test-only fence switch off (``VLLM_DSV4_TEST_UNSAFE_NO_FENCES=1``):

1. 64 completions at concurrency 16, prompts of 1..600 tokens (token ids, so
   lengths are exact; log-uniform, see make_requests), 8..16 new tokens each,
   greedy, ``ignore_eos``. New prompts arrive while others decode, so
   scheduler steps mix full prefills with decodes. (Chunked prefill itself is
   forced off by vLLM 0.32's CPU platform for MLA models on CPUs without AMX,
   this machine included; V1 still schedules whole prefills next to running
   decodes in one step.)
2. The same 64 requests again, one at a time, on the same server.
3. Every request must succeed both times with the same token ids, except
   where the two runs part at a numerical near-tie (TIE_MARGIN: vLLM's own
   DeepSeek-V4 CPU path is not batch invariant; measured in tests.support.served), with the
   same top-1 logprobs within DRIFT_ATOL before that. Corruption (another
   request's data in the attention) picks tokens the other run ranks far
   below its choice, or moves logprobs far more; test_compare_outputs_rules
   checks the verdict logic itself.
4. The worker's workspace counters: leases, no allocations, and zero fence
   waits. On CPU there is one stream, so the fences never have anything to
   order and the no-fence run is, by construction, the same execution: the
   switch is undetectable here and this test shows it (equal outputs, 0
   waits in both). Fences are shown necessary by the simulated-stream test
   (tests/core/test_stream_schedule.py: every variant detected without them)
   and on CUDA by tests/gpu/test_workspace_cuda.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")
pytest.importorskip("aiohttp")

from tests.support.served import (  # noqa: E402
    HEALTH_TIMEOUT,
    MAX_PROMPT,
    N_REQUESTS,
    SCRATCH,
    SERVE_CONFIG,
    Target,
    compare_outputs,
    make_requests,
    run_all,
)
from tests.support.vllm_helpers import local_serve_config  # noqa: E402
from vllm_dsv4_backend import run as R  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The requests, the server targets and the verdict rule (tests.support.served, shared with
# the tensor-parallel and parallel-layout tests); the tolerances are measured there.
CONCURRENCY = 16
MAX_TIES = N_REQUESTS * 3 // 8  # ties beyond this are not rounding any more
# The workspace manager belongs to the plugin's layer.
IMPL = "plugin"

# On CPU the no-fence server is, by construction, the shared one's execution (one
# stream: no fence ever waits, see _check_workspace_counters), and the plain shared one
# is the debug one's execution without the poisoning, so both repeat a run;
# DSV4_FULL_LOAD=1 (read only here) runs them too. The switch's wiring is checked without a
# server (tests/core/test_settings.py, test_stream_schedule.py), fences across streams by
# the simulated schedules and tests/gpu.
FULL_LOAD = os.environ.get("DSV4_FULL_LOAD", "") not in ("", "0")


def _full_load_only(name: str, why: str):
    return pytest.param(name, marks=pytest.mark.skipif(
        not FULL_LOAD, reason=f"{why}; DSV4_FULL_LOAD=1 runs it"))


@pytest.fixture(scope="module",
                params=[_full_load_only("shared", "shared-debug's execution without the "
                                        "poisoning"),
                        _full_load_only("private", "nothing shared; bitwise off in "
                                        "tests/safety/test_1_parity.py"),
                        _full_load_only("shared-nofence", "on CPU the same execution as "
                                        "shared (one stream, no fence waits)"),
                        "shared-debug"])
def served(request, tmp_path_factory) -> Iterator[Target]:
    """One server per workspace policy (pytest finishes one param before the next).

    ``shared-nofence`` (``DSV4_FULL_LOAD=1`` only) is ``shared`` with the test-only switch
    that skips the workspace's
    cross-stream fences (``VLLM_DSV4_TEST_UNSAFE_NO_FENCES=1``). ``shared-debug`` runs with
    ``VLLM_DSV4_WORKSPACE_DEBUG=1``: every released region is poisoned with NaN and
    overlapping leases raise, so a consumer that read a released buffer would show up as
    NaN logprobs or a failed request (issue: the mixed traffic passes unchanged).

    Runs the plugin's attention layer (where the workspace lives). Reuses the session's
    ``tiny_server``
    (tests/vllm/conftest.py) when it already has that layer and policy.
    """
    serve = local_serve_config(SERVE_CONFIG)
    policy, _, variant = request.param.partition("-")
    # conftest's session server: the caller's ATTN_IMPL (default "plugin") and
    # workspace policy (default "shared"); reuse it when that is what we test
    session = (
        os.environ.get("VLLM_DSV4_ATTN_IMPL", "plugin"),
        os.environ.get("VLLM_DSV4_WORKSPACE", "shared"),
    )
    no_fences = os.environ.get("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", "0") not in ("", "0")
    if "DSV4_TEST_SERVE_CONFIG" not in os.environ and session == (IMPL, policy) \
            and not variant and not no_fences:
        tiny = request.getfixturevalue("tiny_server")
        if tiny.attn_impl == IMPL:
            yield Target(tiny.base_url, tiny.model, tiny.log_path, IMPL, policy,
                         tiny.marker_dir)
            return
    run_dir = tmp_path_factory.mktemp(f"load_{request.param}")
    env = R.cpu_env(SCRATCH, {
        **os.environ, "VLLM_DSV4_ATTN_IMPL": IMPL, "VLLM_DSV4_WORKSPACE": policy,
        "VLLM_DSV4_MARKER_DIR": str(run_dir / "markers"),
        "VLLM_DSV4_TEST_UNSAFE_NO_FENCES": "1" if variant == "nofence" else "0",
        "VLLM_DSV4_WORKSPACE_DEBUG": "1" if variant == "debug" else "0",
    })  # fmt: skip
    log = run_dir / "server.log"
    with R.make_server(serve, log_path=log, env=env) as srv:
        srv.wait_healthy(timeout=HEALTH_TIMEOUT)
        yield Target(srv.base_url, serve.served_model_name, log, IMPL, request.param,
                     run_dir / "markers")


def test_concurrent_outputs_equal_solo_outputs(served: Target) -> None:
    srv, policy = served, f"{served.impl}/{served.policy}"
    reqs = make_requests(R.load_serve_config(SERVE_CONFIG).model_path)

    before = _workspace_counters(srv, required=False)
    conc = asyncio.run(run_all(srv.base_url, srv.model, reqs, CONCURRENCY))
    solo = asyncio.run(run_all(srv.base_url, srv.model, reqs, 1))
    after = _workspace_counters(srv, required=True)

    # the raw outputs next to the server log, for diagnosing a failure
    dump = srv.log.parent / f"load-{served.impl}-{served.policy}.json"
    dump.write_text(json.dumps({"requests": reqs, "concurrent": conc, "solo": solo}))
    failed = [(i, r["error"]) for i, r in enumerate(conc + solo) if "error" in r]
    assert not failed, f"[{policy}] requests failed: {failed[:5]} (log: {srv.log})"
    assert srv.healthy()

    verdicts: dict[str, list[str]] = {"same": [], "tie": [], "bad": []}
    for i, (req, c, s) in enumerate(zip(reqs, conc, solo)):
        for out in (c, s):
            assert out["token_ids"] is not None and len(out["token_ids"]) == req["max_tokens"]
            assert out["finish_reason"] == "length"
        kind, why = compare_outputs(c, s)
        verdicts[kind].append(f"#{i} (prompt {len(req['prompt'])}): {why}")
    summary = {k: len(v) for k, v in verdicts.items()}
    print(f"[{policy}] {summary}; ties: {verdicts['tie']}")
    assert not verdicts["bad"], (
        f"[{policy}] corrupted outputs {summary}: {verdicts['bad'][:8]} (outputs: {dump})"
    )
    assert len(verdicts["tie"]) <= MAX_TIES, (
        f"[{policy}] {len(verdicts['tie'])} near-tie divergences (> {MAX_TIES}): {verdicts['tie']}"
    )
    _check_workspace_counters(srv, before, after, sum(r["max_tokens"] for r in reqs))


def _workspace_counters(srv: Target, required: bool) -> dict | None:
    """The worker's workspace counters (``VLLM_DSV4_MARKER_DIR``, rewritten by the plugin's
    layer after every forward); None before the first forward unless ``required``."""
    assert srv.marker_dir is not None, "the load servers always get a marker dir"
    files = sorted((srv.marker_dir / "layers").glob("workspace-*.json"))
    if not files and not required:
        return None
    assert len(files) == 1, f"expected one worker's counters under {srv.marker_dir}: {files}"
    return json.loads(files[0].read_text())


def _check_workspace_counters(srv: Target, before: dict | None, after: dict,
                              new_tokens: int) -> None:
    """What the load did to the workspace: the policy ran and leased for every step, the
    manager allocated nothing after load (``allocations_total`` counts the tensors the
    manager itself creates after ``reserve()``; only ``off`` does), and no lease waited on a
    fence. The last is what makes the no-fence run indistinguishable on CPU: one stream, so
    every lease is already ordered after its previous user by program order (the fence code
    sees the same stream key and returns before recording any event). That fences matter
    across streams is shown by tests/core/test_stream_schedule.py (simulated streams, every
    variant corrupt without them) and tests/gpu/test_workspace_cuda.py (CUDA)."""
    before = before or {"leases_total": 0, "fence_waits_total": 0, "allocations_total": 0}
    delta = {k: after[k] - before[k]
             for k in ("leases_total", "fence_waits_total", "allocations_total")}
    print(f"[{srv.impl}/{srv.policy}] workspace counters during the load: {delta}; {after}")
    assert after["policy"] == srv.policy.partition("-")[0]
    assert after["fences_enabled"] == (not srv.policy.endswith("-nofence"))
    # alone, every generated token is one forward of each layer, each leasing its q/out
    assert delta["leases_total"] >= new_tokens * after["num_layers"]
    assert delta["allocations_total"] == 0
    assert delta["fence_waits_total"] == 0


def _out(ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> dict:
    return {"token_ids": ids, "logprobs": lps, "top": tops}


def test_compare_outputs_rules() -> None:
    """The verdict logic on hand-made outputs (no server): it must flag corruption."""
    top = [{1: -3.6, 2: -3.7, 3: -4.5}, {4: -3.5, 5: -3.55}]
    same = _out([1, 4], [-3.6, -3.5], top)
    assert compare_outputs(same, same)[0] == "same"
    # near-tie: 2 vs 1 within 0.1 in both runs
    other = _out([2, 4], [-3.62, -3.5], [{2: -3.62, 1: -3.65, 3: -4.4}, {4: -3.5}])
    assert compare_outputs(same, other)[0] == "tie"
    # a token the other run ranks far below its pick: corruption, not rounding
    far = _out([3, 4], [-3.0, -3.5], [{3: -3.0, 1: -4.5}, {4: -3.5}])
    kind, why = compare_outputs(same, far)
    assert kind == "bad" and "gap" in why
    # a token missing from the other run's top-N
    alien = _out([9, 4], [-3.0, -3.5], [{9: -3.0, 1: -3.1}, {4: -3.5}])
    assert compare_outputs(same, alien)[0] == "bad"
    alien = _out([2, 4], [-3.0, -3.5], [{2: -3.0, 9: -3.1}, {4: -3.5}])  # lacks 1
    assert compare_outputs(same, alien)[0] == "bad"
    # same tokens but the logprobs moved a lot: corruption
    drift = _out([1, 4], [-3.6, -2.4], top)
    kind, why = compare_outputs(same, drift)
    assert kind == "bad" and "drift" in why


def test_request_set_is_what_the_doc_says() -> None:
    """The load really spans 1..600-token prompts and 8..16 new tokens, deterministically."""
    model_dir = local_serve_config(SERVE_CONFIG).model_path
    reqs = make_requests(model_dir)
    lens = [len(r["prompt"]) for r in reqs]
    assert len(reqs) == N_REQUESTS and min(lens) == 1 and max(lens) == MAX_PROMPT
    assert sum(n > 128 for n in lens) >= 8 and sum(n > 300 for n in lens) >= 4
    assert {r["max_tokens"] for r in reqs} == set(range(8, 17))
    assert reqs == make_requests(model_dir)
