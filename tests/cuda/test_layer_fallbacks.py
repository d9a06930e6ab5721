# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA layer's fallbacks to vLLM's own allocation are counted.

Where the workspace cannot serve a buffer (a shape, dtype or cache layout
the reservation does not cover), the layer lets vLLM's code allocate it:
the attention output (``q``), the indexer q (``indexer_q``), the C128
compressor scratch (``compressor``) and the C4 decode global top-k
(``topk``). Each such call is counted through
``WorkspaceManager.count_fallback(layer_name, family)`` into the live
counters (``fallbacks_total``, on the served log line). Dummy and profile
runs lease nothing by design and are not counted.

The layers, the workspace and the test doubles of vLLM's CUDA kernels are
``test_layer_streams.py``'s (CPU tensors over simulated streams), from
tests.support.layer_streams.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cuda_guard import require_vllm_cuda

require_vllm_cuda()

import vllm.v1.worker.ubatching as ubatching  # noqa: E402

from tests.support.layer_streams import MNBT, Model, T  # noqa: E402


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> Model:
    """A model of the stream tests (C1, C4 and C128 layers, both micro-batches),
    its workspace's ``count_fallback`` recorded (the real method runs too)."""
    monkeypatch.delenv("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", raising=False)
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE", "shared")
    m = Model("fp8", seed=11)
    monkeypatch.setattr(ubatching, "dbo_current_ubatch_id", lambda: m.ubatch)
    # Fails (AttributeError) until WorkspaceManager has count_fallback.
    real = m.ws.count_fallback
    m.fallback_calls = []

    def spy(layer_name: str, family: str) -> None:
        m.fallback_calls.append((layer_name, family))
        real(layer_name, family)

    monkeypatch.setattr(m.ws, "count_fallback", spy)
    m.ws.model_step()  # the live counters count from the first model step
    return m


def _fallbacks(m: Model) -> int:
    return m.ws.live_stats()["fallbacks_total"]


def test_served_steps_count_no_fallback(model: Model) -> None:
    for layer in model.layers:
        for u in (0, 1):
            model.run_layer(layer, u, step=0)
    assert model.fallback_calls == []
    assert _fallbacks(model) == 0


def test_topk_width_the_workspace_was_not_sized_for_is_counted(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A C4 decode whose top-k width is not the reserved ``index_topk``:
    ``_forward_decode`` lets vLLM's ``compute_global_topk_indices_and_lens``
    allocate both outputs, and counts it (family ``topk``)."""
    import vllm.models.deepseek_v4.common.ops as vllm_ops

    layer = next(la for la in model.layers if la.compress_ratio == 4)
    width = model.ws.config.params["index_topk"] + 1
    layer.topk_indices_buffer = torch.zeros(MNBT, width, dtype=torch.int32)
    allocated: list[tuple[torch.Tensor, torch.Tensor]] = []

    def vllm_wrapper(local, token_to_req_indices, block_table, block_size, is_valid):
        # Stands for vLLM's wrapper: it allocates its outputs per call.
        out = (torch.zeros(local.shape, dtype=torch.int32),
               torch.full((local.shape[0],), local.shape[-1], dtype=torch.int32))
        allocated.append(out)
        return out

    monkeypatch.setattr(vllm_ops, "compute_global_topk_indices_and_lens", vllm_wrapper)
    model.run_layer(layer, 0, step=0)
    assert len(allocated) == 1
    assert model.fallback_calls == [(layer.prefix, "topk")]
    assert _fallbacks(model) == 1
    summary = model.ws.live_summary("CUDA")
    assert "fallbacks to the layer's own allocation" in summary and "(1 total)" in summary


def test_attention_output_fallback_is_counted_and_dummy_runs_are_not(model: Model) -> None:
    """``_alloc_attn_out`` in a served step with a dtype the workspace was not
    sized for (family ``q``); outside a step (dummy/profile run) nothing."""
    layer = model.layers[0]
    hs = torch.zeros(T, 32, dtype=torch.float32)
    layer._alloc_attn_out(T, hs)  # no step open: a dummy run
    assert model.fallback_calls == []
    with model.sim.use(model.sim.stream("default")), layer.dsv4_region(T):
        out = layer._alloc_attn_out(T, hs)
        served = layer._alloc_attn_out(T, hs.to(torch.bfloat16))
    assert out.dtype == torch.float32  # vLLM's allocation
    assert served.untyped_storage().data_ptr() == model.ws.storage.untyped_storage().data_ptr()
    assert model.fallback_calls == [(layer.prefix, "q")]
    assert _fallbacks(model) == 1
