# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA layer's own code, executed on CPU tensors over simulated streams.

What runs is real: the plugin's overrides (``dsv4_step``, ``_alloc_attn_out``,
the indexer's ``_q_rope_quant``, the C128 compressor's
``_compress_norm_rope_store``, the decorated ``_sparse_indexer_and_attn``,
``_forward_decode``) and vLLM 0.33's own ``forward_mqa`` between them, with
the plugin's workspace manager and its lease code.

What is a **test double** (said here, and in each class below):

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
* The stream choreography of vLLM 0.33's forward (the driver below): the
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

import random
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _cuda_guard import require_vllm_cuda

require_vllm_cuda()

from vllm.forward_context import override_forward_context  # noqa: E402

from vllm_dsv4_backend.layer import cuda  # noqa: E402
from vllm_dsv4_backend.layer.plan import Dims, build_workspace_config  # noqa: E402
from vllm_dsv4_backend.ops import indexer as indexer_ops  # noqa: E402
from vllm_dsv4_backend.testing.schedule import WIDE_PLAN  # noqa: E402
from vllm_dsv4_backend.workspace import SimStreamBackend  # noqa: E402

# The layers are built as the CUDA-graph harness builds them (without __init__).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "cuda_graph"))
try:
    from model import bare_module  # noqa: E402
finally:
    sys.path.pop(0)

T = 4               # decode tokens per micro-batch (one per request)
MNBT = 8            # max_num_batched_tokens
HP, N_LOCAL = 64, 16
D = 512
K = 16              # index_topk (small, so the test is quick)
BLOCK = 64          # compressed-cache block size in tokens (C4: 16 entries per block)
LAYERS = (("model.layers.0.attn", 1), ("model.layers.1.attn", 4),
          ("model.layers.2.attn", 128), ("model.layers.3.attn", 4),
          ("model.layers.4.attn", 128), ("model.layers.5.attn", 4))
NUM_UBATCHES = 2
STEPS = 2


class Checks:
    """Producer/consumer bookkeeping of the doubles (see the module doc)."""

    def __init__(self, backend: SimStreamBackend) -> None:
        self.backend = backend
        self.expected: dict[tuple[int, int], torch.Tensor] = {}
        self.tags: list[str] = []
        self.counts: list[int] = []

    @staticmethod
    def key(t: torch.Tensor) -> tuple[int, int]:
        return (t.data_ptr(), t.numel() * t.element_size())

    def produce(self, outs: list[torch.Tensor], refs: list[torch.Tensor],
                run: Callable[[], None]) -> None:
        for o, r in zip(outs, refs):
            self.expected[self.key(o)] = r
        self.backend.launch(self.backend.current_stream(), run)

    def ref_of(self, t: torch.Tensor) -> torch.Tensor:
        return self.expected[self.key(t)]

    def consume(self, views: list[torch.Tensor | None], tag: str) -> None:
        pairs = [(v, self.expected[self.key(v)]) for v in views
                 if v is not None and self.key(v) in self.expected]
        i = len(self.counts)
        self.counts += [0, 0]
        self.tags += [f"{tag} (start)", f"{tag} (end)"]

        def check(j: int) -> None:
            for v, r in pairs:
                if not torch.equal(v.reshape(-1).view(torch.uint8),
                                   r.reshape(-1).view(torch.uint8)):
                    self.counts[j] += 1

        cur = self.backend.current_stream()
        self.backend.launch(cur, lambda: check(i))
        self.backend.launch(cur, lambda: check(i + 1))

    def reset(self) -> None:
        self.counts = [0] * len(self.counts)

    def mismatches(self) -> list[tuple[str, int]]:
        return [(t, c) for t, c in zip(self.tags, self.counts) if c]


class TorchKernels:
    """Test double of :class:`cuda.VllmCudaKernels` (the plugin's torch ops)."""

    def __init__(self, checks: Checks, tag: Callable[[], str]) -> None:
        self.c = checks
        self.tag = tag

    def indexer_q_fp8(self, *, positions, q, cos_sin_cache, weights, weights_softmax_scale,
                      weights_head_scale, q_fp8, weights_out) -> None:
        self._indexer_q("fp8", (q_fp8, None, weights_out), positions, q, cos_sin_cache,
                        weights, weights_softmax_scale, weights_head_scale)

    def indexer_q_mxfp4(self, *, positions, q, cos_sin_cache, weights, weights_softmax_scale,
                        weights_head_scale, q_packed, q_scale, weights_out) -> None:
        self._indexer_q("mxfp4", (q_packed, q_scale, weights_out), positions, q,
                        cos_sin_cache, weights, weights_softmax_scale, weights_head_scale)

    def _indexer_q(self, dtype, outs, positions, q, cos_sin, weights, s, h) -> None:
        def op(out):
            indexer_ops.indexer_q_rope_quant(q, positions, cos_sin, weights, softmax_scale=s,
                                             head_scale=h, dtype=dtype, out=out)

        refs = tuple(None if o is None else torch.empty_like(o) for o in outs)
        op(refs)
        live = [o for o in outs if o is not None]
        self.c.produce(live, [r for r in refs if r is not None], lambda: op(outs))

    def global_topk_indices_and_lens(self, global_topk_indices, topk_lens, topk_indices,
                                     token_to_req_indices, block_table, block_size,
                                     is_valid_token) -> None:
        self.c.consume([topk_indices], f"{self.tag()} topk.local")
        ref_local = self.c.ref_of(topk_indices)
        ref_g, ref_l = torch.empty_like(global_topk_indices), torch.empty_like(topk_lens)
        indexer_ops.local_to_global(ref_local, token_to_req_indices, block_table, block_size,
                                    out_indices=ref_g, out_lens=ref_l,
                                    is_valid_token=is_valid_token)
        self.c.produce(
            [global_topk_indices, topk_lens], [ref_g, ref_l],
            lambda: indexer_ops.local_to_global(
                topk_indices, token_to_req_indices, block_table, block_size,
                out_indices=global_topk_indices, out_lens=topk_lens,
                is_valid_token=is_valid_token))

    def c128_state_block_size(self) -> int:
        return 8

    def c128_compress(self, *, state_cache, num_actual, token_to_req_indices, positions,
                      slot_mapping, block_table, head_dim, compressed_kv) -> None:
        # Deterministic stand-in for the CuTe DSL block-8 compress.
        def value() -> torch.Tensor:
            rows = state_cache.reshape(-1)[: num_actual * head_dim].view(num_actual, head_dim)
            return rows.float() + positions[:num_actual, None].float()

        ref = value()
        self.c.produce([compressed_kv], [ref], lambda: compressed_kv.copy_(value()))

    def c128_store(self, *, compressed_kv, **_: Any) -> None:
        self.c.consume([compressed_kv], f"{self.tag()} compressor.scratch")

    def flash_mla_with_kvcache(self, *, q, out, extra_indices_in_kvcache, extra_topk_length,
                               indices, topk_length, **_: Any) -> tuple[torch.Tensor, None]:
        self.c.consume([extra_indices_in_kvcache, extra_topk_length],
                       f"{self.tag()} flashmla(topk.global, topk.lens)")
        ref = q.clone()
        self.c.produce([out], [ref], lambda: out.copy_(q))
        return out, None


class IndexerOp:
    """Test double of vLLM's ``SparseAttnIndexer`` (DeepGEMM logits + top-k):
    reads the indexer q lease on the default stream and writes the model's
    top-k buffer with valid causal local ids."""

    def __init__(self, checks: Checks, buf: torch.Tensor, tag: Callable[[], str],
                 positions: Callable[[], torch.Tensor]) -> None:
        self.c, self.buf, self.tag, self.positions = checks, buf, tag, positions
        self.calls = 0

    def __call__(self, hidden_states, q_quant, k, weights) -> torch.Tensor:
        q, scale = q_quant if isinstance(q_quant, tuple) else (q_quant, None)
        self.c.consume([q, scale, weights], f"{self.tag()} indexer_q")
        self.calls += 1
        salt = self.calls
        pos = self.positions()
        n = pos.shape[0]
        out = self.buf[:n]

        def value() -> torch.Tensor:
            visible = torch.div(pos + 1, 4, rounding_mode="floor").to(torch.int32)
            ar = torch.arange(K, dtype=torch.int32)
            ids = (ar[None, :] + salt) % visible.clamp(min=1)[:, None]
            return torch.where(ar[None, :] < visible[:, None], ids, -1).to(torch.int32)

        self.c.produce([out], [value()], lambda: out.copy_(value()))
        return self.buf


class Model:
    """The layers of one model (built without a VllmConfig), its workspace
    (``cuda.make_workspace``: policy and the no-fence switch from envs) and
    the choreography driver."""

    def __init__(self, indexer_dtype: str, seed: int, plan: Any = WIDE_PLAN) -> None:
        """``plan``: the lease plan the workspace reserves (default: every
        family of every kind, the q family as the attention output); ``None``:
        the CUDA layer's own (``layer.plan.LEASE_PLAN["cuda"]``, what serving
        reserves)."""
        g = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        # DBO's micro-batches share the compute (default) stream and the model's
        # aux streams (vLLM's own top-k buffer relies on that FIFO order too).
        names = ["default", "aux0", "aux1", "aux2"]
        self.sim = SimStreamBackend(names)
        self.checks = Checks(self.sim)
        self.current_tag = ""
        self.ubatch = 0
        dims = Dims(num_local_heads=N_LOCAL, padded_q_heads=HP, head_dim=D, index_topk=K)
        cfg = build_workspace_config(dims, max_num_batched_tokens=MNBT,
                                     indexer_kv_dtype=indexer_dtype, platform="cuda", plan=plan,
                                     num_ubatches=NUM_UBATCHES)
        self.ws = cuda.make_workspace(cfg, device="cpu", streams=self.sim)
        self.topk_buf = torch.full((MNBT, K), -1, dtype=torch.int32)
        self.kernels = TorchKernels(self.checks, lambda: self.current_tag)
        self.positions = [torch.randint(40, 200, (T,), generator=g) for _ in range(NUM_UBATCHES)]
        self.cos_sin = torch.randn(256, 64, generator=g)
        self.gen = g
        self.layers = [self._layer(p, r, indexer_dtype) for p, r in LAYERS]
        self.ws.reserve()
        self.metadata = [self._metadata(u) for u in range(NUM_UBATCHES)]

    def _layer(self, prefix: str, ratio: int, dtype: str) -> cuda.DSV4FlashMLAAttention:
        layer = bare_module(
            cuda.DSV4FlashMLAAttention, prefix=prefix, compress_ratio=ratio,
            n_local_heads=N_LOCAL, padded_heads=HP, head_dim=D, window_size=8,
            scale=D**-0.5, max_num_batched_tokens=MNBT, topk_indices_buffer=self.topk_buf,
            swa_cache_layer=types.SimpleNamespace(prefix=f"{prefix}.swa_cache",
                                                  kv_cache=torch.zeros(4, 16, 584,
                                                                       dtype=torch.uint8)),
            attn_sink=torch.zeros(HP),
        )
        layer.kv_cache = torch.zeros(8, 16, 584, dtype=torch.uint8)
        layer.indexer = None
        layer.compressor = None
        if ratio == 4:
            layer.indexer = bare_module(
                cuda.DSV4CudaIndexer, use_fp4_kv=dtype == "mxfp4", softmax_scale=128**-0.5,
                n_head=64, head_dim=128)
            layer.indexer.indexer_op = IndexerOp(
                self.checks, self.topk_buf, lambda: self.current_tag,
                lambda: self.positions[self.ubatch])
        if ratio == 128:
            k_cache = types.SimpleNamespace(kv_cache=torch.zeros(4, 1, 584, dtype=torch.uint8))
            layer.compressor = bare_module(
                cuda.DeepseekCompressor, compress_ratio=128, head_dim=D, rope_head_dim=64,
                rms_norm_eps=1e-6, k_cache_prefix=prefix,
                _static_forward_context={prefix: k_cache})
            layer.compressor.norm = types.SimpleNamespace(weight=torch.ones(D))
        layer._dsv4_attach(self.ws, kernels=self.kernels)
        return layer

    def _metadata(self, u: int) -> dict[str, Any]:
        g = self.gen
        md: dict[str, Any] = {}
        block_table = torch.randperm(64, generator=g)[: T * 4].view(T, 4).to(torch.int32)
        for prefix, _ in LAYERS:
            md[f"{prefix}.swa_cache"] = types.SimpleNamespace(
                num_decodes=T, num_prefills=0, num_decode_tokens=T,
                is_valid_token=torch.ones(T, dtype=torch.bool),
                token_to_req_indices=torch.arange(T, dtype=torch.int32),
                decode_swa_indices=torch.zeros(T, 1, 8, dtype=torch.int32),
                decode_swa_lens=torch.full((T,), 8, dtype=torch.int32),
                tile_sched_swaonly=object(), tile_sched_c4a=object(), tile_sched_c128a=object(),
            )
            md[prefix] = types.SimpleNamespace(
                block_size=BLOCK, block_table=block_table,
                slot_mapping=torch.arange(T, dtype=torch.int64),
                c128a_global_decode_topk_indices=torch.zeros(T, 1, 128, dtype=torch.int32),
                c128a_decode_topk_lens=torch.ones(T, dtype=torch.int32),
            )
        return md

    def run_layer(self, layer: cuda.DSV4FlashMLAAttention, u: int, step: int) -> None:
        """One layer, one micro-batch: vLLM 0.33's forward order and streams."""
        g = self.gen
        sim = self.sim
        home, aux0 = sim.stream("default"), sim.stream("aux0")
        self.ubatch = u
        self.current_tag = f"step {step} ubatch {u} {layer.prefix}"
        positions = self.positions[u]
        hs = torch.randn(T, 32, generator=g).to(torch.bfloat16)
        q = torch.randn(T, HP, D, generator=g).to(torch.bfloat16)  # the fused insert's q
        ctx = types.SimpleNamespace(attn_metadata=self.metadata[u])
        with override_forward_context(ctx), sim.use(home), layer.dsv4_region(T):
            out = layer._alloc_attn_out(T, hs)
            assert self.ws.storage is not None
            index_q = index_scale = index_w = None
            if layer.indexer is not None:
                with sim.use(aux0):  # execute_in_parallel: the indexer on aux0
                    q_quant, index_w = layer.indexer._q_rope_quant(
                        positions, torch.randn(T, 64, 128, generator=g).to(torch.bfloat16),
                        types.SimpleNamespace(cos_sin_cache=self.cos_sin),
                        torch.randn(T, 64, generator=g))
                self._join(aux0, home)
                index_q, index_scale = q_quant if isinstance(q_quant, tuple) else (q_quant,
                                                                                    None)
            if layer.compress_ratio == 128:
                with sim.use(aux0):  # maybe_execute_in_parallel: the compressor on aux0
                    layer.compressor._compress_norm_rope_store(
                        types.SimpleNamespace(
                            slot_mapping=torch.arange(T, dtype=torch.int64), block_size=8,
                            token_to_req_indices=torch.arange(T, dtype=torch.int32),
                            block_table=torch.zeros(T, 4, dtype=torch.int32)),
                        torch.randn(T, 2, 2 * D, generator=g),
                        D, positions, types.SimpleNamespace(cos_sin_cache=self.cos_sin),
                        self.metadata[u], {})
                self._join(aux0, home)
            layer._sparse_indexer_and_attn(hs, index_q, index_scale, index_w, q, q[:, 0],
                                           positions, out)
            self.checks.consume([out], f"{self.current_tag} o_proj(q.out)")

    def _join(self, aux: Any, home: Any) -> None:
        ev = self.sim.new_event()
        self.sim.record(ev, aux)
        self.sim.wait(home, ev)

    def build(self) -> None:
        for step in range(STEPS):
            for layer in self.layers:
                order = list(range(NUM_UBATCHES))
                self.rng.shuffle(order)
                for u in order:
                    self.run_layer(layer, u, step)

    def execute(self, seeds: range) -> list[tuple[int, list[tuple[str, int]]]]:
        bad = []
        for s in seeds:
            self.checks.reset()
            self.sim.execute(random.Random(s))
            if self.checks.mismatches():
                bad.append((s, self.checks.mismatches()))
        return bad


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
    assert all(per_family[f] > 0 for f in ("q", "indexer_q", "topk", "compressor"))
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
