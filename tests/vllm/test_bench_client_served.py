# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``bench.e2e_layers``' client against the real ``vllm serve`` of the tiny model: the
streamed completions' token counts, TTFT/TPOT and the server session's CPU time come out
of vLLM's real streaming format (the rounds' orchestration is tested without a server in
tests/core/test_e2e_layers.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vllm_dsv4_backend.bench import e2e_layers as E
from vllm_dsv4_backend.bench.ab import E2EError, ordinary_token_ids

ROOT = Path(__file__).resolve().parents[2]


def test_measure_block_on_the_served_model(tiny_server) -> None:
    ids = ordinary_token_ids(ROOT / "configs" / "tiny-dsv4")
    prompts = [ids[100:108], ids[200:216], ids[300:302]]
    m = E.measure_block(tiny_server.base_url, tiny_server.model, prompts, 5, tiny_server.pid)
    assert m["output_tokens"] == 15  # ignore_eos: every request makes all 5 tokens
    # The figures exist and are finite; their size is the machine's.
    for key in ("mean_ttft_ms", "mean_tpot_ms"):
        assert math.isfinite(m[key]) and m[key] > 0, key
    assert m["output_throughput"] == pytest.approx(15 / m["wall_s"])
    # The server's process tree worked for those tokens (engine core and worker at least).
    assert m["cpu_ms_per_token"] > 0


def test_measure_block_names_a_refused_request(tiny_server) -> None:
    with pytest.raises(E2EError, match="HTTP 4"):
        E.measure_block(tiny_server.base_url, "no-such-model", [[1, 2, 3]], 2, tiny_server.pid)
