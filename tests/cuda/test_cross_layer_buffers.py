# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's cross-layer buffers and DeepSeek-V4.1, with vLLM 0.33's / 0.34's real classes
on CPU.

* ``topk_indices_buffer``: the model-wide buffer vLLM's DeepSeek-V4 model allocates once
  and hands to every layer (the C4 indexer writes it, the attention reads it; IndexCache,
  vllm#51209, would carry it from one layer to the next). Through the plugin's CUDA layer
  in vLLM's forward order on simulated streams (``tests.support.layer_streams``), both
  micro-batches, every layer kind, both indexer dtypes: no lease, and no byte of the
  workspace's storage, ever overlaps it; every layer and indexer still holds vLLM's own
  tensor (same object, same address) afterwards, and the C4 indexer wrote into it.
* ``DeepseekV41ForCausalLM`` on ``FLASHMLA_SPARSE_DSV4``: the plugin's architecture check
  stands aside with one WARNING line saying why (a startup error only under
  ``VLLM_DSV4_ATTN_IMPL=plugin``), and with the plugin registered on a simulated CUDA
  platform vLLM's V4.1 selector still returns V4.1's own layer class.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from tests.support.cuda_guard import require_vllm_cuda

require_vllm_cuda()

import vllm.models.deepseek_v4.nvidia.model as nvm  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from tests.support.layer_streams import Model  # noqa: E402
from vllm_dsv4_backend import plugin  # noqa: E402
from vllm_dsv4_backend.layer import cuda  # noqa: E402
from vllm_dsv4_backend.vllm_compat import guards  # noqa: E402
from vllm_dsv4_backend.workspace.manager import Lease  # noqa: E402


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.fixture
def ubatch_ids(monkeypatch: pytest.MonkeyPatch) -> list[Model]:
    import vllm.v1.worker.ubatching as ubatching

    holder: list[Model] = []
    monkeypatch.setattr(ubatching, "dbo_current_ubatch_id",
                        lambda: holder[0].ubatch if holder else 0)
    return holder


@pytest.mark.parametrize("policy", ["shared", "private"])
@pytest.mark.parametrize("indexer_dtype", ["fp8", "mxfp4"])
def test_no_lease_overlaps_and_nothing_replaces_topk_indices_buffer(
        ubatch_ids, monkeypatch, indexer_dtype, policy) -> None:
    monkeypatch.delenv("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", raising=False)
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE", policy)
    views: list[tuple[str, str, str, tuple[int, int]]] = []
    getitem = Lease.__getitem__

    def spy(self: Lease, name: str) -> torch.Tensor:
        t = getitem(self, name)
        views.append((self.layer_name, self.family, name, _span(t)))
        return t

    monkeypatch.setattr(Lease, "__getitem__", spy)
    model = Model(indexer_dtype, seed=3)
    ubatch_ids.append(model)
    buf = model.topk_buf
    buf_span = _span(buf)
    storage = model.ws.storage
    assert storage is not None
    assert not _overlaps(_span(storage), buf_span)  # the reservation never covers it
    model.build()
    assert model.execute(range(4)) == []
    assert views, "no lease was taken"
    families = {f for _, f, _, _ in views}
    assert {"q", "indexer_q", "topk"} <= families  # topk: the C4 decode global ids
    bad = [v for v in views if _overlaps(v[3], buf_span)]
    assert bad == [], f"leases overlapping vLLM's topk_indices_buffer: {bad[:4]}"
    # vLLM's buffer is still every layer's and every indexer op's, at the same address.
    assert _span(model.topk_buf) == buf_span
    for layer in model.layers:
        assert layer.topk_indices_buffer is buf, layer.prefix
        if layer.indexer is not None:
            assert layer.indexer.indexer_op.buf is buf
    # ... and it is what the C4 indexer wrote (the layers read vLLM's buffer).
    assert (buf != -1).any()


def test_the_detector_sees_an_overlap() -> None:
    # Negative control of the check above: a view into the buffer is caught.
    buf = torch.full((8, 16), -1, dtype=torch.int32)
    assert _overlaps(_span(buf[2:3]), _span(buf))
    assert not _overlaps(_span(torch.empty(4, dtype=torch.int32)), _span(buf))


def _v41_config(backend: AttentionBackendEnum) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        attention_config=types.SimpleNamespace(backend=backend),
        model_config=types.SimpleNamespace(architectures=["DeepseekV41ForCausalLM"],
                                           model="deepseek-ai/DeepSeek-V4.1"),
        parallel_config=types.SimpleNamespace(prefill_context_parallel_size=1),
        lora_config=None,
    )


def test_v41_gets_vllms_own_path_with_one_line(monkeypatch, caplog) -> None:
    monkeypatch.setattr(guards, "_v41_logged", [])
    monkeypatch.delenv("VLLM_DSV4_ATTN_IMPL", raising=False)
    cfg = _v41_config(AttentionBackendEnum.FLASHMLA_SPARSE_DSV4)
    with caplog.at_level(logging.INFO, logger="vllm_dsv4_backend"):
        guards.check_architecture(cfg)
        guards.check_architecture(cfg)  # a second engine build: no second line
    lines = [r for r in caplog.records if "DeepSeek-V4.1" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.WARNING
    msg = lines[0].getMessage()
    assert "stands aside" in msg and "vLLM's own DeepSeek-V4.1 layer serves" in msg
    assert "DeepseekV41ForCausalLM" in msg
    # Asked for explicitly: a startup error naming V4.1.
    monkeypatch.setenv("VLLM_DSV4_ATTN_IMPL", "plugin")
    with pytest.raises(ValueError, match="DeepSeek-V4.1"):
        guards.check_architecture(cfg)
    # Another architecture is still refused.
    cfg.model_config.architectures = ["LlamaForCausalLM"]
    monkeypatch.delenv("VLLM_DSV4_ATTN_IMPL")
    with pytest.raises(ValueError, match="serves only DeepSeek-V4"):
        guards.check_architecture(cfg)


def test_v41_selector_keeps_its_own_layer_with_the_plugin_installed(simulated_cuda) -> None:
    import vllm.models.deepseek_v41.nvidia.model as v41

    plugin.register()
    assert nvm.DeepseekV4FlashMLAAttention is cuda.DSV4FlashMLAAttention  # V4: the plugin's
    own = v41.DeepseekV4FlashMLAAttention
    assert own.__module__ == "vllm.models.deepseek_v41.nvidia.flashmla"
    for backend in (AttentionBackendEnum.FLASHMLA_SPARSE_DSV4,
                    AttentionBackendEnum.FLASHMLA_SPARSE_DSV41):
        got = v41._select_dsv4_attn_cls(_v41_config(backend))
        assert got is own, (backend, got)
        assert not issubclass(got, cuda.DSV4FlashMLAAttention)
