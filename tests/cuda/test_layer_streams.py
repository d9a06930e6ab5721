# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA layer's own code, executed on CPU tensors over simulated streams.

What runs is real: the plugin's overrides (``dsv4_step``, ``_alloc_attn_out``,
the indexer's ``_q_rope_quant``, the C128 compressor's
``_compress_norm_rope_store``, the decorated ``_sparse_indexer_and_attn``,
``_forward_decode``) and vLLM 0.33's own ``forward_mqa`` between them, with
the plugin's workspace manager and its lease code.

What is a **test double** (said here, and in each class of tests.support.layer_streams):

* vLLM's CUDA kernel objects (``VllmCudaKernels``) are replaced by the
  plugin's torch ops where it has one (indexer q RoPE + FP8/MXFP4 quant:
  ``ops.indexer.indexer_q_rope_quant``; local -> global top-k:
  ``ops.indexer.local_to_global``) and by small deterministic torch
  functions otherwise (the C128 compress/store pair, FlashMLA, the indexer
  op's top-k and the output projection). Every double is enqueued on the
  simulated stream current at the call, and every consumer checks, when it
  runs, that the bytes it reads are the ones its own layer's producer wrote
  (the expected values are computed at enqueue time from the constant
  inputs).
* The stream choreography of vLLM 0.33's forward (the driver, ``Model``): the
  indexer's q-quant on **aux0**, the C128 compressor on **aux0**
  (``maybe_execute_in_parallel``), everything else on the **default** stream
  (shared by DBO's two micro-batches), with the *join* (default waits for aux0's done event:
  a data dependency) and without the *fork* (aux waits for the default
  stream's start event) on purpose, as in ``workspace/schedule.py``: reuse
  across layers, families and micro-batches must be made safe by the
  workspace's fences alone (#52836). aux1 (MLA compressor of C4 layers)
  and aux2 (indexer compressor) allocate nothing from the workspace; they
  are streams of the simulation all the same.
* ``SimStreamBackend`` stands for CUDA: the queued work runs in many random
  orders that respect only per-stream order and the recorded event waits.

With fences: no consumer ever reads a wrong version. With the test-only
no-fence switch (``VLLM_DSV4_TEST_UNSAFE_NO_FENCES=1``): corruption is
detected.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.support.cuda_guard import require_vllm_cuda
from tests.support.families import families

require_vllm_cuda()

from vllm.forward_context import override_forward_context  # noqa: E402

# The doubles, the bookkeeping and the driver (shared with test_layer_fallbacks.py).
from tests.support.layer_streams import (  # noqa: E402
    LAYERS,
    NUM_UBATCHES,
    STEPS,
    Model,
    T,
)


@pytest.fixture
def ubatch_ids(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``dbo_current_ubatch_id()`` answering the simulated micro-batch."""
    import vllm.v1.worker.ubatching as ubatching

    holder: list[Model] = []
    monkeypatch.setattr(ubatching, "dbo_current_ubatch_id",
                        lambda: holder[0].ubatch if holder else 0)
    return holder  # type: ignore[return-value]


SEEDS = range(40)


@pytest.mark.parametrize("indexer_dtype", ["fp8", "mxfp4"])
def test_fences_keep_every_consumer_on_its_version(ubatch_ids, monkeypatch, indexer_dtype):
    monkeypatch.delenv("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", raising=False)
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE", "shared")
    model = Model(indexer_dtype, seed=1)
    ubatch_ids.append(model)
    model.build()
    stats = model.ws.stats()
    # Every family of every layer kind was leased, and nothing stayed leased.
    per_family = stats["reserved_bytes_per_family"]
    assert all(per_family[f] > 0 for f in families("cuda"))
    leases_per_step = NUM_UBATCHES * (6 + 3 * 2 + 2)  # q.out; C4 indexer_q + topk; C128
    assert stats["leases_total"] == STEPS * leases_per_step
    assert stats["leased_bytes_now"] == 0
    assert stats["allocations_total"] == 0
    assert stats["fence_waits_total"] > 0
    # shared: one slot per family and micro-batch (a small ring, not per layer).
    assert stats["num_slots"] == 4 * NUM_UBATCHES
    # The overrides really ran: the indexer op saw every C4 layer and step.
    c4 = [layer for layer in model.layers if layer.compress_ratio == 4]
    assert all(layer.indexer.indexer_op.calls == STEPS * NUM_UBATCHES for layer in c4)
    assert model.execute(SEEDS) == []


@pytest.mark.parametrize("indexer_dtype", ["fp8", "mxfp4"])
def test_no_fence_switch_lets_corruption_through(ubatch_ids, monkeypatch, indexer_dtype):
    monkeypatch.setenv("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", "1")
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE", "shared")
    model = Model(indexer_dtype, seed=1)
    ubatch_ids.append(model)
    model.build()
    assert model.ws.stats()["fences_enabled"] is False
    bad = model.execute(SEEDS)
    assert bad, "without fences some order must let a producer overwrite a live lease"
    tags = {t for _, mm in bad for t, _ in mm}
    # The cross-stream hand-over: aux0's indexer q, read on the default stream.
    assert any("indexer_q" in t for t in tags), tags


def test_private_policy_needs_no_cross_layer_fences(ubatch_ids, monkeypatch):
    monkeypatch.delenv("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", raising=False)
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE", "private")
    model = Model("fp8", seed=2)
    ubatch_ids.append(model)
    model.build()
    assert model.execute(range(10)) == []


def test_dummy_run_reserves_and_writes_nothing(ubatch_ids, monkeypatch):
    """The plugin's forward() on a profile/dummy run (attn_metadata None):
    vLLM's code, no lease, no byte of the workspace written; on a real step
    the same forward leases and hands everything back."""
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention

    model = Model("fp8", seed=3)
    ubatch_ids.append(model)
    layer = model.layers[1]

    def vllm_forward(self, positions, hidden_states, llama_4_scaling=None):
        # Stands for vLLM's forward: it allocates through the hook and fills it.
        out = self._alloc_attn_out(hidden_states.shape[0], hidden_states)
        out.fill_(1.0)
        return out

    monkeypatch.setattr(DeepseekV4Attention, "forward", vllm_forward)
    storage = model.ws.storage
    storage.fill_(0x5A)
    before = model.ws.stats()["leases_total"]
    hs = torch.zeros(T, 32, dtype=torch.bfloat16)
    with override_forward_context(types.SimpleNamespace(attn_metadata=None)):
        out = layer.forward(model.positions[0], hs)
    assert model.ws.stats()["leases_total"] == before
    assert bool((storage == 0x5A).all())
    assert out.untyped_storage().data_ptr() != storage.untyped_storage().data_ptr()

    with override_forward_context(types.SimpleNamespace(attn_metadata=model.metadata[0])):
        out = layer.forward(model.positions[0], hs)
    stats = model.ws.stats()
    assert stats["leases_total"] == before + 1
    assert stats["leased_bytes_now"] == 0
    assert out.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()


@pytest.mark.parametrize("indexer_dtype", ["fp8", "mxfp4"])
def test_leases_are_the_lease_plan(ubatch_ids, monkeypatch, indexer_dtype):
    """``layer.plan.LEASE_PLAN["cuda"]`` is what the layer's code leases:
    every planned (kind, family, view) the dtype has is used and nothing else,
    and the workspace built with the plan (the builder's own, as serving
    builds it) reserves exactly those views (no ``topk.local``, no C4
    compressor scratch)."""
    from vllm_dsv4_backend.layer import core
    from vllm_dsv4_backend.layer.plan import LEASE_PLAN
    from vllm_dsv4_backend.workspace.manager import Lease

    monkeypatch.delenv("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", raising=False)
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE", "shared")
    kinds = {prefix: core.layer_kind(ratio) for prefix, ratio in LAYERS}
    taken: set[tuple[str, str, str]] = set()
    getitem = Lease.__getitem__

    def spy(self: Lease, name: str) -> torch.Tensor:
        taken.add((kinds[self.layer_name], self.family, name))
        return getitem(self, name)

    monkeypatch.setattr(Lease, "__getitem__", spy)
    plan = LEASE_PLAN["cuda"][indexer_dtype]
    model = Model(indexer_dtype, seed=5, plan=None)  # the platform's own plan
    ubatch_ids.append(model)
    model.build()
    assert model.execute(range(10)) == []
    cfg = model.ws.config
    assert cfg.params["plan"] == "cuda"
    planned = {(k, f, v) for k, fams in plan.items() for f, views in fams.items()
               for v in views if v in {s.name for s in cfg.family_buffers(f)}}
    assert taken == planned, (taken - planned, planned - taken)
    reserved = {(f, s.name) for f in cfg.family_names for s in cfg.family_buffers(f)
                if any(f in cfg.layer_families(r) for _, r in LAYERS)}
    assert reserved == {(f, v) for _, f, v in planned}
    assert ("topk", "local") not in reserved
    assert cfg.layer_families(4) == ("q", "indexer_q", "topk")
