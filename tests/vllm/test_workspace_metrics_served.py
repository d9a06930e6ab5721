# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workspace's figures on ``vllm serve``'s own ``/metrics`` (the session's
``tiny_server``, no server of its own): scraped before and after a little load,
the worker's series are there, labelled per rank (``engine``, ``rank``) and
family / kind with nothing per request, the reserved bytes are the ones the
worker logged at load, and model steps and leases move under load while
allocations in leased families and fence waits stay 0 (CPU, ``shared``). vLLM's
own series are still served beside them."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LOAD_LINE = re.compile(r"workspace \(CPU\): policy (\w+), ([\d.]+) MiB reserved")


def scrape(base_url: str) -> tuple[Series, str]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    series = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in text_string_to_metric_families(text) for s in fam.samples}
    return series, text


def ws(series: Series, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {lab: v for (n, lab), v in series.items() if n == f"vllm_dsv4_workspace_{name}"}


@pytest.mark.vllm
@pytest.mark.slow
def test_metrics_show_the_workspace_moving_under_load(tiny_server):
    if tiny_server.attn_impl != "plugin":
        pytest.skip("vLLM's own layer has no workspace")
    before, text = scrape(tiny_server.base_url)
    assert "vllm:num_requests_running" in text  # vLLM's own series are untouched
    rank = (("engine", "0"), ("model_name", tiny_server.model), ("rank", "0"))
    steps0 = ws(before, "model_steps_total")
    assert list(steps0) == [rank], steps0  # one rank, one series: nothing per request
    for prompt in ("Metrics for the workspace", "DeepSeek-V4 under load, scraped"):
        tiny_server.complete(prompt, 8)
    deadline = time.monotonic() + 30
    while True:  # published after each step's last layer; the response may come first
        after, text = scrape(tiny_server.base_url)
        if ws(after, "model_steps_total")[rank] >= steps0[rank] + 16 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    steps = ws(after, "model_steps_total")[rank] - steps0[rank]
    leases = ws(after, "leases_total")[rank] - ws(before, "leases_total")[rank]
    assert steps >= 16, (steps, text)  # 2 requests x 8 tokens, at least one step each
    assert leases >= steps, (leases, steps)  # every step leases in every layer
    assert ws(after, "leased_family_allocations_total")[rank] == 0
    assert ws(after, "fence_waits_total")[rank] == 0  # CPU: one stream
    assert ws(after, "fallbacks_total")[rank] == 0
    assert ws(after, "peak_leased_bytes")[rank] > 0
    reserved = ws(after, "reserved_bytes")
    assert {dict(lab)["family"] for lab in reserved} >= {"q", "indexer_q", "topk"}
    assert all(dict(lab)["rank"] == "0" for lab in reserved)
    # The worker's load line: the same bytes (MiB, one decimal).
    m = LOAD_LINE.search(tiny_server.log_text())
    assert m is not None
    assert abs(sum(reserved.values()) / (1 << 20) - float(m[2])) < 0.06, (reserved, m[0])
    info = ws(after, "info")
    assert [dict(lab)["policy"] for lab in info] == [m[1]]
    kinds = {dict(lab)["kind"]: v for lab, v in ws(after, "layers").items()}
    assert kinds and all(v > 0 for v in kinds.values()), kinds
    # Prometheus text format: counters typed as such, with HELP.
    assert "# TYPE vllm_dsv4_workspace_leases_total counter" in text
    assert "# HELP vllm_dsv4_workspace_reserved_bytes " in text
