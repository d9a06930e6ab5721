# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Proof from inside the serving processes that the plugin's FLASHMLA_SPARSE_DSV4
layer really ran: each layer type writes a marker (pid, process, backend, kernel
path, workspace policy) the first time its eager region runs."""

import json
import os

import pytest

pytest.importorskip("vllm")


def test_plugin_layer_ran_in_the_worker(tiny_server):
    if tiny_server.attn_impl == "vllm":
        pytest.skip("server runs vLLM's own layer (VLLM_DSV4_ATTN_IMPL=vllm)")
    tiny_server.post("/v1/completions", {"model": tiny_server.model, "prompt": "x " * 300,
                                         "max_tokens": 2, "temperature": 0})
    layer_dir = tiny_server.marker_dir / "layers"
    records = [json.loads(p.read_text()) for p in layer_dir.glob("layer-*.json")]
    kinds = {r["layer_kind"] for r in records}
    assert kinds == {"swa", "c4", "c128"}, records
    for r in records:
        assert r["backend"] == "FLASHMLA_SPARSE_DSV4"
        assert r["layer_cls"] == "DSV4CPUAttention"
        assert r["pid"] != os.getpid() and r["pid"] != tiny_server.pid
        assert r["workspace_policy"] in ("shared", "private", "off")
