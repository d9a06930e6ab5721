# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA layer over simulated streams (CPU tensors): the test doubles of vLLM 0.33's
CUDA kernels (:class:`TorchKernels`, :class:`IndexerOp`), their producer/consumer
bookkeeping (:class:`Checks`) and the choreography driver (:class:`Model`).

tests/cuda/test_layer_streams.py's docstring says what is real and what is a double;
tests/cuda/test_layer_fallbacks.py and test_cuda_kernels.py use them too. Imports vLLM
0.33 / 0.34 names: import it after ``tests.support.cuda_guard.require_vllm_cuda()``. The
layers are built as the CUDA-graph harness builds them (``tools/cuda_graph/model.py``'s
``bare_module``, without ``__init__``).
"""

from __future__ import annotations

import random
import types
from collections.abc import Callable
from typing import Any

import torch
from vllm.forward_context import override_forward_context

from tools.cuda_graph.model import bare_module
from vllm_dsv4_backend.layer import cuda
from vllm_dsv4_backend.layer.plan import Dims, build_workspace_config
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.workspace import SimStreamBackend

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

    def __init__(self, indexer_dtype: str, seed: int, plan: Any = None) -> None:
        """``plan``: the lease plan the workspace reserves (default ``None``: the
        CUDA layer's own, ``layer.plan.LEASE_PLAN["cuda"]``, what serving
        reserves, so a family the layer starts to lease needs no change here)."""
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


