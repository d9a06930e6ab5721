# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's unmodified CUDA layer driven by vLLM's own control flow.

Run with the generated stand-in ``vllm`` first on the path::

    PYTHONPATH=build/vllm_stub/0.34:. python tools/cuda_graph/harness.py --json out.json

It builds 7 layers (compress ratios 1, 4, 128, 4, 128, 4, 1) of the plugin's
``vllm_dsv4_backend.layer.cuda.DSV4FlashMLAAttention`` and of vLLM's
``DeepseekV4FlashMLAAttention`` (from the stub: vLLM's verbatim bodies, see
``build_stub.py``), wired as ``tests/cuda`` does (``bare_module`` attributes,
``_dsv4_attach(workspace, kernels_double)``), and runs several steps of
mixed decode + prefill with two micro-batches (DBO ubatch ids 0/1, switched
per layer) through vLLM's forward. Every mode's model output (the residual
stream after the last layer) is compared bit for bit with a serial
reference of the same class (one stream, workspace policy ``off``: fresh
allocations), and the plugin's output with vLLM's.

Modes: CPU ``eager`` (serial; aux streams None), ``private`` (policy),
``mrv1`` (0.33 only: ``_prepare_and_attn_eager``); CUDA (when available)
``cuda-eager`` (3 real aux streams, slow consumers), ``cuda-piecewise``
(vLLM's ``BreakableCUDAGraphCapture``: warm-up, capture per micro-batch with
real metadata as MRV2 does, then replays), ``cuda-piecewise-gemm0`` (the
same with ``VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD=0``: drives
``GraphSafeCudaStreamBackend``'s dropped fences), ``cuda-piecewise-mrv1``
(0.33: captured with ``attn_metadata=None`` as MRV1 does, replayed with
metadata through the wide eager break) and ``cuda-full``
(``torch.cuda.graph`` of the whole step, both micro-batches, forward-context
mode FULL, replays). Leases per step expected (review §1c, 2 micro-batches):
eager 30, piecewise 6 (the C4 top-k only), full 0 (``leases_as_expected``,
information). On CPU, a dispatch-mode lint of one FULL-mode forward must find
no host sync (the evidence that the FULL capture can work).

Negative controls (must be detected): (a) the workspace's no-fence switch
(``VLLM_DSV4_TEST_UNSAFE_NO_FENCES``) under the fork-free fan-out of
``vllm_dsv4_backend.testing.schedule`` with slow consumers (CPU: simulated
streams in random orders; CUDA: real streams, ``torch.cuda._sleep``): it
must corrupt, and the same program with fences must not. On the real vLLM
flow no fence is needed (vLLM's fork orders every hand-over, review §2d);
``cuda-eager-nofence`` reports that as information. (b) a wrong stand-in
(the indexer top-k shifted by one) must make the comparison fail.

Counts per step (inside the layers' forward): workspace leases (the plugin)
and allocations. CPU: a ``TorchDispatchMode`` count of fresh tensors
(``workspace.alloc_counter``: factory ops and out-of-place results; views,
in-place and ``out=`` are not counted), minus what the stand-in *kernels*
allocate internally (their temporaries are not the layer's); the stand-in
GEMM/norm outputs are counted (vLLM's real ops allocate them too). CUDA: the
same, plus the caching allocator's ``allocation.all.allocated`` delta.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

RATIOS = (1, 4, 128, 4, 128, 4, 1)
HIDDEN, Q_LORA, HEADS, HEAD_DIM = 64, 32, 16, 512
INDEX_HEADS, INDEX_DIM, TOPK, WINDOW = 8, 128, 16, 8
SWA_BLOCK, C_BLOCK, I_BLOCK, STATE_BLOCK = 16, 16, 16, 8
MAXPOS = 256
MNBT = 16
K128 = 4  # C128 entries a token can see: (pos + 1) // 128 <= 2 here
DECODES, PREFILL = 3, 4  # per micro-batch: 3 decode requests + 1 prefill chunk
NUM_UBATCHES = 2
SLEEP_CYCLES = 200_000


def _stub() -> Any:
    import vllm

    if not getattr(vllm, "HARNESS_STUB", False):
        raise SystemExit(f"harness: `import vllm` found {vllm.__file__}, not the stub; put "
                         "build/vllm_stub/<ver> first on PYTHONPATH")
    if not torch.cuda.is_available():
        # A CPU-only torch raises here (a dummy base class); vLLM's bodies ask it
        # (DeepseekCompressor.forward, DeepseekV4Indexer.forward). Nothing captures.
        try:
            torch.cuda.is_current_stream_capturing()
        except RuntimeError:
            torch.cuda.is_current_stream_capturing = lambda: False
    return vllm


# --- allocation counting -------------------------------------------------------------


class Meter:
    """Counts allocations inside the layers, minus the stand-in kernels' own."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None
        self.fresh = 0
        self.allocator = 0
        self.kernel_fresh = 0
        self.kernel_allocator = 0
        self.by_op: Counter[str] = Counter()
        self._depth = 0

    @contextlib.contextmanager
    def layer(self) -> Iterator[None]:
        from vllm_dsv4_backend.workspace import count_allocations

        c = count_allocations(self.cuda)
        with c:
            yield
        self.fresh += c.count
        self.allocator += c.allocator_count or 0
        self.by_op.update(c.by_op)

    @contextlib.contextmanager
    def kernel(self) -> Iterator[None]:
        if self._depth:
            yield
            return
        from vllm_dsv4_backend.workspace import count_allocations

        self._depth += 1
        c = count_allocations(self.cuda)
        try:
            with c:
                yield
        finally:
            self._depth -= 1
        self.kernel_fresh += c.count
        self.kernel_allocator += c.allocator_count or 0
        self.by_op.subtract(c.by_op)

    def take(self) -> tuple[int, int | None]:
        fresh = self.fresh - self.kernel_fresh
        alloc = self.allocator - self.kernel_allocator if self.cuda is not None else None
        self.fresh = self.allocator = self.kernel_fresh = self.kernel_allocator = 0
        self.last_by_op = {k: v for k, v in sorted(self.by_op.items()) if v}
        self.by_op = Counter()
        return fresh, alloc


# --- the model ---------------------------------------------------------------------------


def bare_module(cls: type, **attrs: Any) -> Any:
    """An ``nn.Module`` of ``cls`` without its ``__init__`` (no VllmConfig),
    ``attrs`` set on it (also used by tests/cuda/test_layer_streams.py)."""
    import torch.nn as nn

    m = cls.__new__(cls)
    nn.Module.__init__(m)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


class Proj:
    """A linear layer (stand-in): ``x @ w`` in ``out_dtype``; ``(y, None)``
    when ``pair`` (vLLM's ReplicatedLinear returns the bias too)."""

    def __init__(self, w: torch.Tensor, out_dtype: torch.dtype, pair: bool = False) -> None:
        self.weight = w.t().to(torch.bfloat16)  # [out, in], as vLLM's linear layers
        self.out_dtype, self.pair = out_dtype, pair

    def __call__(self, x: torch.Tensor) -> Any:
        from vllm import _harness_standins as S

        y = S.matmul(x, self.weight.t(), self.out_dtype)
        return (y, None) if self.pair else y


class Model:
    """Layers of one class, their caches and the per-micro-batch metadata
    (static tensors updated in place each step, as CUDA graphs need)."""

    def __init__(self, impl: str, device: torch.device, seed: int, policy: str,
                 aux_streams: bool, mrv1: bool = False) -> None:
        import vllm
        from vllm.models.deepseek_v4 import attention as vattn
        from vllm.models.deepseek_v4 import compressor as vcomp
        from vllm.models.deepseek_v4.nvidia import flashmla as vfm

        self.impl, self.device = impl, device
        self.version = vllm.__version__
        g = torch.Generator().manual_seed(seed)
        self.g = g
        dev = device

        def rnd(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

        self.aux = ([torch.cuda.Stream(dev) for _ in range(3)]
                    if aux_streams and dev.type == "cuda" else None)

        def events(n: int) -> list[Any]:
            return [torch.cuda.Event() if dev.type == "cuda" else None for _ in range(n)]

        self.topk_buf = torch.full((MNBT, TOPK), -1, dtype=torch.int32, device=dev)
        self.cos_sin = rnd(MAXPOS, 64)
        rope = types.SimpleNamespace(cos_sin_cache=self.cos_sin)
        reqs = NUM_UBATCHES * (DECODES + 1)
        self.nreqs = reqs
        self.caches: list[torch.Tensor] = []

        def ds_cache(block: int, entries_per_req: int) -> torch.Tensor:
            nb = reqs * -(-entries_per_req // block) + 1  # + the trash block
            c = torch.zeros(nb, block, 584, dtype=torch.uint8, device=dev)
            from vllm import _harness_standins as S

            S.ds_store(c, torch.arange(nb * block, device=dev), rnd(nb * block, 512))
            self.caches.append(c)
            return c

        def f32_cache(block: int, rows_per_req: int, width: int) -> torch.Tensor:
            nb = reqs * -(-rows_per_req // block) + 1
            c = rnd(nb, block, width)
            self.caches.append(c)
            return c

        self.layers: list[Any] = []
        if impl == "plugin":
            from vllm_dsv4_backend.layer import cuda as plugin_cuda

            cls = plugin_cuda.DSV4FlashMLAAttention
        else:
            cls = vfm.DeepseekV4FlashMLAAttention
        hp = cls.get_padded_num_q_heads(HEADS)
        for i, ratio in enumerate(RATIOS):
            prefix = f"model.layers.{i}.attn"
            layer = bare_module(
                cls, prefix=prefix, compress_ratio=ratio, n_local_heads=HEADS, padded_heads=hp,
                head_dim=HEAD_DIM, rope_head_dim=64, nope_head_dim=HEAD_DIM - 64,
                q_lora_rank=Q_LORA, eps=1e-6, window_size=WINDOW, scale=HEAD_DIM**-0.5,
                max_num_batched_tokens=MNBT, max_model_len=MAXPOS, max_image_tokens=0,
                topk_indices_buffer=self.topk_buf, aux_stream_list=self.aux,
                ln_events=events(4), rotary_emb=rope, indexer_rotary_emb=rope,
                swa_cache_layer=types.SimpleNamespace(prefix=f"{prefix}.swa_cache",
                                                      kv_cache=ds_cache(SWA_BLOCK, MAXPOS)),
                attn_sink=rnd(hp, scale=0.5),
                w_qa_kv=rnd(HIDDEN, Q_LORA + HEAD_DIM, scale=HIDDEN**-0.5,
                            dtype=torch.bfloat16),
                w_q_b=rnd(Q_LORA, HEADS * HEAD_DIM, scale=Q_LORA**-0.5, dtype=torch.bfloat16),
                w_o=rnd(HEADS * HEAD_DIM, HIDDEN, scale=(HEADS * HEAD_DIM) ** -0.5,
                        dtype=torch.bfloat16),
                q_norm_weight=1 + rnd(Q_LORA, scale=0.1),
                kv_norm_weight=1 + rnd(HEAD_DIM, scale=0.1),
            )
            layer.kv_cache = (ds_cache(C_BLOCK, MAXPOS // ratio + 1) if ratio > 1
                              else torch.zeros(0, dtype=torch.uint8, device=dev))
            layer.indexer = None
            layer.compressor = None
            if ratio > 1:
                layer.compressor = self._compressor(
                    vcomp.DeepseekCompressor, f"{prefix}.compressor", ratio, HEAD_DIM,
                    prefix, {prefix: layer}, rnd, f32_cache)
            if ratio == 4:
                k_cache = types.SimpleNamespace(prefix=f"{prefix}.indexer.k_cache",
                                                kv_cache=f32_cache(I_BLOCK, MAXPOS // 4 + 1,
                                                                   INDEX_DIM))
                ix = bare_module(
                    vattn.DeepseekV4Indexer, prefix=f"{prefix}.indexer", compress_ratio=4,
                    topk_tokens=TOPK, n_head=INDEX_HEADS, head_dim=INDEX_DIM,
                    softmax_scale=INDEX_DIM**-0.5, use_fp4_kv=False,
                    topk_indices_buffer=self.topk_buf, k_cache=k_cache,
                    aux_stream=self.aux[2] if self.aux else None, ln_events=events(2),
                    w_q_b=rnd(Q_LORA, INDEX_HEADS * INDEX_DIM, scale=Q_LORA**-0.5,
                              dtype=torch.bfloat16),
                )
                ix.weights_proj = Proj(rnd(HIDDEN, INDEX_HEADS, scale=HIDDEN**-0.5),
                                       torch.bfloat16, pair=True)
                ix.compressor = self._compressor(
                    vcomp.DeepseekCompressor, f"{prefix}.indexer.compressor", 4, INDEX_DIM,
                    k_cache.prefix, {k_cache.prefix: k_cache}, rnd, f32_cache)
                from vllm import _harness_standins as S

                ix.indexer_op = S.IndexerOp(k_cache, self.topk_buf, TOPK, 4)
                layer.indexer = ix
            if hasattr(cls, "_prepare_and_attn_eager"):  # vLLM 0.33 (MRV1 / MRV2)
                layer._prepare_and_attn_fn = (layer._prepare_and_attn_eager if mrv1
                                              else layer._prepare_and_attn)
            elif mrv1:
                raise ValueError("mrv1: this vLLM has no _prepare_and_attn_eager")
            self.layers.append(layer)
        self.ws = None
        # MRV1 captures with attn_metadata None (a dummy run, review §1c).
        self.dummy_metadata = False
        if impl == "plugin":
            self._attach(policy)
        self._build_metadata()

    def _compressor(self, cls: type, prefix: str, ratio: int, head: int, k_prefix: str,
                    sfc: dict[str, Any], rnd: Callable[..., torch.Tensor],
                    f32_cache: Callable[..., torch.Tensor]) -> Any:
        coff = 2 if ratio == 4 else 1
        c = bare_module(
            cls, prefix=prefix, compress_ratio=ratio, head_dim=head, rope_head_dim=64,
            nope_head_dim=head - 64, rms_norm_eps=1e-6, overlap=ratio == 4, coff=coff,
            use_fp4_cache=False, _use_two_stage_fused_compressor=False,
            _quant_block=64 if head == 512 else 128,
            _token_stride=(head - 64) + 128 if head == 512 else head,
            _scale_dim=8 if head == 512 else 4, k_cache_prefix=k_prefix,
            max_num_batched_tokens=MNBT, _compress_scratch=None, _static_forward_context=sfc,
            state_cache=types.SimpleNamespace(
                prefix=f"{prefix}.state_cache",
                kv_cache=f32_cache(STATE_BLOCK, MAXPOS, 2 * coff * head)),
            ape=rnd(ratio, coff * head, scale=0.1),
        )
        c.norm = types.SimpleNamespace(weight=1 + rnd(head, scale=0.1))
        c.fused_wkv_wgate = Proj(rnd(HIDDEN, 2 * coff * head, scale=HIDDEN**-0.5),
                                 torch.float32)
        return c

    def _attach(self, policy: str) -> None:
        from vllm import _harness_standins as S

        from vllm_dsv4_backend.layer import cuda as plugin_cuda
        from vllm_dsv4_backend.workspace import WorkspaceConfig

        os.environ["VLLM_DSV4_WORKSPACE"] = policy
        cfg = WorkspaceConfig(
            max_num_batched_tokens=MNBT, num_local_heads=HEADS,
            padded_q_heads=self.layers[0].padded_heads, head_dim=HEAD_DIM,
            index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=TOPK,
            indexer_kv_dtype="fp8", num_ubatches=NUM_UBATCHES, include_attn_out=True,
            include_q=False)
        streams = (plugin_cuda.GraphSafeCudaStreamBackend(self.device)
                   if self.device.type == "cuda" else None)
        self.ws = plugin_cuda.make_workspace(cfg, device=self.device, streams=streams)
        for layer in self.layers:
            layer._dsv4_attach(self.ws, kernels=S.HarnessKernels())
        self.ws.reserve()

    # --- metadata (static tensors, updated per step) ---------------------------------

    def _build_metadata(self) -> None:
        dev = self.device
        rng = random.Random(1234)
        per_req = {
            "swa": -(-MAXPOS // SWA_BLOCK), "state": -(-MAXPOS // STATE_BLOCK),
            "c4": -(-(MAXPOS // 4 + 1) // C_BLOCK), "c128": -(-(MAXPOS // 128 + 1) // C_BLOCK),
            "idx": -(-(MAXPOS // 4 + 1) // I_BLOCK),
        }
        self.tables: list[dict[str, torch.Tensor]] = []
        self.start_pos: list[list[int]] = []
        nr = DECODES + 1
        for u in range(NUM_UBATCHES):
            t: dict[str, torch.Tensor] = {}
            for kind, nb in per_req.items():
                total = self.nreqs * nb
                perm = list(range(total))
                rng.shuffle(perm)
                rows = [perm[(u * nr + r) * nb:(u * nr + r + 1) * nb] for r in range(nr)]
                t[kind] = torch.tensor(rows, dtype=torch.int32)
            self.tables.append(t)
            self.start_pos.append([rng.randrange(120, 150) for _ in range(nr)])
        ntok = DECODES + PREFILL
        self.ntok = ntok
        self.md: list[dict[str, Any]] = []
        self.hidden: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []

        def z(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=dev)

        for u in range(NUM_UBATCHES):
            tb = {k: v.to(dev) for k, v in self.tables[u].items()}
            t2r = z(ntok)
            swa = types.SimpleNamespace(
                num_decodes=DECODES, num_prefills=1, num_decode_tokens=DECODES,
                num_prefill_tokens=PREFILL, is_valid_token=z(ntok, dtype=torch.bool),
                token_to_req_indices=t2r, slot_mapping=z(ntok, dtype=torch.int64),
                block_size=SWA_BLOCK, block_table=tb["swa"],
                decode_swa_indices=z(DECODES, 1, WINDOW), decode_swa_lens=z(DECODES),
                prefill_swa_indices=z(PREFILL, WINDOW), prefill_swa_lens=z(PREFILL),
                tile_sched_swaonly=object(), tile_sched_c4a=object(),
                tile_sched_c128a=object())
            state = types.SimpleNamespace(
                block_table=tb["state"], slot_mapping=z(ntok, dtype=torch.int64),
                block_size=STATE_BLOCK, token_to_req_indices=t2r, num_decode_tokens=DECODES,
                c128_boundary=None)
            c4 = types.SimpleNamespace(block_size=C_BLOCK * 4, block_table=tb["c4"],
                                       slot_mapping=z(ntok, dtype=torch.int64))
            c128 = types.SimpleNamespace(
                block_size=C_BLOCK * 128, block_table=tb["c128"],
                slot_mapping=z(ntok, dtype=torch.int64),
                c128a_global_decode_topk_indices=z(DECODES, 1, K128),
                c128a_decode_topk_lens=z(DECODES), c128a_prefill_topk_indices=z(PREFILL, K128),
                c128a_prefill_topk_lens=z(PREFILL))
            idx = types.SimpleNamespace(
                max_seq_len=MAXPOS, max_compressed=MAXPOS // 4, num_decode_tokens=DECODES,
                num_prefill_tokens=PREFILL, slot_mapping=z(ntok, dtype=torch.int64),
                block_size=I_BLOCK, block_table=tb["idx"], token_to_req_indices=t2r,
                positions=z(ntok, dtype=torch.int64))
            md: dict[str, Any] = {}
            for layer in self.layers:
                p = layer.prefix
                md[f"{p}.swa_cache"] = swa
                if layer.compress_ratio == 4:
                    md[p] = c4
                    md[f"{p}.compressor.state_cache"] = state
                    md[f"{p}.indexer.k_cache"] = idx
                    md[f"{p}.indexer.compressor.state_cache"] = state
                elif layer.compress_ratio == 128:
                    md[p] = c128
                    md[f"{p}.compressor.state_cache"] = state
            self.md.append(md)
            self.hidden.append(z(ntok, HIDDEN, dtype=torch.bfloat16))
            self.positions.append(z(ntok, dtype=torch.int64))

    def load_step(self, step: int) -> None:
        """Copy step ``step``'s inputs and metadata into the static tensors."""
        for u in range(NUM_UBATCHES):
            self._load_ubatch(u, step)

    def _load_ubatch(self, u: int, step: int) -> None:
        """Micro-batch ``u`` at ``step``: its decode requests advance by one
        token per step, its prefill request by a ``PREFILL``-token chunk."""
        g = torch.Generator().manual_seed(1000 * step + u)
        nr = DECODES + 1
        pos = [self.start_pos[u][r] + step for r in range(DECODES)]
        pos += [self.start_pos[u][nr - 1] + step * PREFILL + j for j in range(PREFILL)]
        t2r = list(range(DECODES)) + [nr - 1] * PREFILL
        tab = self.tables[u]
        dev = self.device

        def slot(kind: str, block: int, r: int, e: int) -> int:
            return int(tab[kind][r, e // block]) * block + e % block

        def emit(kind: str, block: int, ratio: int, r: int, p: int) -> int:
            return slot(kind, block, r, p // ratio) if (p + 1) % ratio == 0 else -1

        def window(r: int, p: int) -> list[int]:
            return [slot("swa", SWA_BLOCK, r, q) if q >= 0 else -1
                    for q in range(p - WINDOW + 1, p + 1)]

        def c128_list(r: int, p: int) -> tuple[list[int], int]:
            ids = [slot("c128", C_BLOCK, r, j) for j in range((p + 1) // 128)][:K128]
            return ids + [-1] * (K128 - len(ids)), len(ids)

        def put(dst: torch.Tensor, values: Any) -> None:
            dst.copy_(torch.tensor(values, dtype=dst.dtype).view(dst.shape).to(dev))

        md = self.md[u]
        swa = md[f"{self.layers[0].prefix}.swa_cache"]
        p4 = next(x.prefix for x in self.layers if x.compress_ratio == 4)
        p128 = next(x.prefix for x in self.layers if x.compress_ratio == 128)
        c4, state, idx = md[p4], md[f"{p4}.compressor.state_cache"], md[f"{p4}.indexer.k_cache"]
        c128 = md[p128]
        dec = list(zip(t2r[:DECODES], pos[:DECODES]))
        pre = list(zip(t2r[DECODES:], pos[DECODES:]))
        put(self.positions[u], pos)
        put(self.hidden[u], torch.randn(self.ntok, HIDDEN, generator=g).tolist())
        put(swa.is_valid_token, [True] * self.ntok)
        put(swa.token_to_req_indices, t2r)
        put(swa.slot_mapping, [slot("swa", SWA_BLOCK, r, p) for r, p in zip(t2r, pos)])
        put(swa.decode_swa_indices, [window(r, p) for r, p in dec])
        put(swa.decode_swa_lens, [WINDOW] * DECODES)
        put(swa.prefill_swa_indices, [window(r, p) for r, p in pre])
        put(swa.prefill_swa_lens, [WINDOW] * PREFILL)
        put(state.slot_mapping, [slot("state", STATE_BLOCK, r, p) for r, p in zip(t2r, pos)])
        put(c4.slot_mapping, [emit("c4", C_BLOCK, 4, r, p) for r, p in zip(t2r, pos)])
        put(idx.slot_mapping, [emit("idx", I_BLOCK, 4, r, p) for r, p in zip(t2r, pos)])
        put(idx.positions, pos)
        put(c128.slot_mapping, [emit("c128", C_BLOCK, 128, r, p) for r, p in zip(t2r, pos)])
        d128 = [c128_list(r, p) for r, p in dec]
        p128l = [c128_list(r, p) for r, p in pre]
        put(c128.c128a_global_decode_topk_indices, [x[0] for x in d128])
        put(c128.c128a_decode_topk_lens, [x[1] for x in d128])
        put(c128.c128a_prefill_topk_indices, [x[0] for x in p128l])
        put(c128.c128a_prefill_topk_lens, [x[1] for x in p128l])

    def snapshot(self) -> list[torch.Tensor]:
        return [c.clone() for c in self.caches]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for c, s in zip(self.caches, snap):
            c.copy_(s)

    # --- forward ---------------------------------------------------------------------

    def call_layer(self, layer: Any, u: int, x: torch.Tensor, mode: Any,
                   meter: Meter | None) -> torch.Tensor:
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker import ubatching

        ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()] = u
        md = None if self.dummy_metadata else self.md[u]
        with set_forward_context(md, mode):
            if meter is not None:
                with meter.layer():
                    y = layer(self.positions[u], x)
            else:
                y = layer(self.positions[u], x)
        return (x.float() + y.float()).to(torch.bfloat16)

    def forward_step(self, mode: Any, meter: Meter | None = None) -> list[torch.Tensor]:
        """Both micro-batches through every layer, alternating per layer (DBO)."""
        xs = list(self.hidden)
        for layer in self.layers:
            for u in range(NUM_UBATCHES):
                xs[u] = self.call_layer(layer, u, xs[u], mode, meter)
        return xs

    def forward_ubatch(self, u: int, mode: Any, meter: Meter | None = None) -> torch.Tensor:
        x = self.hidden[u]
        for layer in self.layers:
            x = self.call_layer(layer, u, x, mode, meter)
        return x


# --- modes ---------------------------------------------------------------------------------


def _leases(model: Model) -> int:
    return int(model.ws.stats()["leases_total"]) if model.ws is not None else 0


def _fences(model: Model) -> dict[str, Any]:
    if model.ws is None:
        return {}
    st = model.ws.stats()
    out = {"fence_waits_total": st.get("fence_waits_total")}
    dropped = getattr(model.ws.backend, "dropped", None)
    if dropped is not None:
        out["fences_dropped"] = dropped
    return out


@contextlib.contextmanager
def _measuring(meter: Meter) -> Iterator[None]:
    from vllm import _harness_standins as S

    S._MEASURE[:] = [meter.kernel]
    try:
        yield
    finally:
        S._MEASURE.clear()


def _run_steps(model: Model, steps: int, meter: Meter,
               step_fn: Callable[[], list[torch.Tensor]], by_op: bool = False
               ) -> dict[str, Any]:
    """Every step: load its inputs, run ``step_fn`` (one forward or the replays;
    it returns the micro-batches' outputs), wait for the device, then record the
    outputs, the workspace leases and ``meter``'s allocations; with ``by_op``
    also step 0's allocations by op."""
    cuda = model.device.type == "cuda"
    outs, leases, allocs, allocator = [], [], [], []
    by_op0: dict[str, int] = {}
    for step in range(steps):
        model.load_step(step)
        l0 = _leases(model)
        xs = step_fn()
        if cuda:
            torch.cuda.synchronize()
        outs.append(torch.stack(xs).cpu())
        leases.append(_leases(model) - l0)
        f, a = meter.take()
        allocs.append(f)
        allocator.append(a)
        if step == 0:
            by_op0 = meter.last_by_op
    res: dict[str, Any] = {"outputs": outs, "leases_per_step": leases,
                           "allocations_per_step": allocs,
                           "allocator_requests_per_step": allocator if cuda else None}
    if by_op:
        res["allocations_by_op_step0"] = by_op0
    return res


def run_eager(model: Model, steps: int) -> dict[str, Any]:
    from vllm.config import CUDAGraphMode

    meter = Meter(model.device)
    with _measuring(meter):
        return _run_steps(model, steps, meter,
                          lambda: model.forward_step(CUDAGraphMode.NONE, meter), by_op=True)


def run_piecewise(model: Model, steps: int, capture_metadata: bool = True) -> dict[str, Any]:
    """Breakable PIECEWISE: warm-up, capture per micro-batch on a side stream,
    then replay every step. MRV2 captures with real metadata; MRV1
    (``capture_metadata=False``, vLLM 0.33) with ``attn_metadata=None``, the
    wide eager break ``_prepare_and_attn_eager`` then doing the work at replay."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker import ubatching

    snap = model.snapshot()
    model.load_step(0)
    model.forward_step(CUDAGraphMode.NONE)  # warm-up, as vLLM runs forward_fn(NONE) first
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(model.device)
    caps, static = [], []
    side.wait_stream(torch.cuda.current_stream(model.device))
    model.dummy_metadata = not capture_metadata
    try:
        with torch.cuda.stream(side):
            for u in range(NUM_UBATCHES):
                cap = BreakableCUDAGraphCapture(pool=pool)
                with cap:
                    static.append(model.forward_ubatch(u, CUDAGraphMode.PIECEWISE))
                caps.append(cap)
    finally:
        model.dummy_metadata = False
    torch.cuda.synchronize()
    model.restore(snap)
    torch.cuda.synchronize()
    meter = Meter(model.device)

    def replay() -> list[torch.Tensor]:
        for u in range(NUM_UBATCHES):
            ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()] = u
            with set_forward_context(model.md[u], CUDAGraphMode.PIECEWISE), meter.layer():
                caps[u].replay()
        return static

    with _measuring(meter):
        res = _run_steps(model, steps, meter, replay)
    return {**res, "graphs": [c.num_graphs for c in caps],
            "eager_breaks": [c.num_eager_breaks for c in caps]}


def run_full(model: Model, steps: int) -> dict[str, Any]:
    """MRV2 FULL: one torch.cuda.graph of the whole step (both micro-batches,
    forward-context mode FULL: the eager break runs inline and is captured)."""
    from vllm.config import CUDAGraphMode

    snap = model.snapshot()
    model.load_step(0)
    side = torch.cuda.Stream(model.device)
    side.wait_stream(torch.cuda.current_stream(model.device))
    with torch.cuda.stream(side):
        model.forward_step(CUDAGraphMode.NONE)  # warm-up on a side stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
        static = model.forward_step(CUDAGraphMode.FULL)
    torch.cuda.synchronize()
    model.restore(snap)
    torch.cuda.synchronize()
    meter = Meter(model.device)

    def replay() -> list[torch.Tensor]:
        with meter.layer():
            graph.replay()
        return static

    return _run_steps(model, steps, meter, replay)


# --- comparisons and controls ----------------------------------------------------------------


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, Any]:
    bad_steps = [i for i, (x, y) in enumerate(zip(a, b))
                 if not torch.equal(x.view(torch.int16), y.view(torch.int16))]
    worst = max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)),
                default=0.0)
    return {"bitwise_equal": not bad_steps and len(a) == len(b), "steps_differing": bad_steps,
            "max_abs_diff": worst}


@contextlib.contextmanager
def _env(**kv: str | None) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in kv}
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def control_no_fence_schedule(device: torch.device, seeds: int = 4) -> dict[str, Any]:
    """(a) The plugin's workspace factory (``layer.cuda.make_workspace``: the
    no-fence switch from envs; ``GraphSafeCudaStreamBackend`` on CUDA) under
    ``testing.schedule``'s fork-free DeepSeek-V4 fan-out, slow consumers."""
    from vllm_dsv4_backend.layer import cuda as plugin_cuda
    from vllm_dsv4_backend.testing.schedule import (
        STREAM_ROLES,
        StampKernels,
        enqueue_dsv4_step,
        make_stamp_source,
    )
    from vllm_dsv4_backend.workspace import SimStreamBackend, WorkspaceConfig

    cfg = WorkspaceConfig(max_num_batched_tokens=64, num_local_heads=HEADS, padded_q_heads=64,
                          head_dim=HEAD_DIM, index_n_heads=INDEX_HEADS,
                          index_head_dim=INDEX_DIM, index_topk=TOPK, indexer_kv_dtype="fp8",
                          num_ubatches=NUM_UBATCHES, include_attn_out=True, include_q=False)

    def run(fences: bool) -> int:
        with _env(VLLM_DSV4_TEST_UNSAFE_NO_FENCES=None if fences else "1",
                  VLLM_DSV4_WORKSPACE="shared"):
            if device.type == "cuda":
                be: Any = plugin_cuda.GraphSafeCudaStreamBackend(device)
                names = None
            else:
                names = [f"{r}{u}" for u in range(NUM_UBATCHES) for r in STREAM_ROLES]
                be = SimStreamBackend(names)
            ws = plugin_cuda.make_workspace(cfg, device=device, streams=be)
            for i, r in enumerate(RATIOS):
                ws.add_layer(f"model.layers.{i}.attn", r)
            ws.reserve()
            bad = 0
            for seed in range(seeds if device.type == "cpu" else 2):
                rng = random.Random(seed)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    streams = [{r: torch.cuda.Stream(device) for r in STREAM_ROLES}
                               for _ in range(NUM_UBATCHES)]
                    k = StampKernels(be, device=device, sleep_cycles=SLEEP_CYCLES)
                else:
                    assert names is not None
                    be.clear()
                    streams = [{r: be.stream(f"{r}{u}") for r in STREAM_ROLES}
                               for u in range(NUM_UBATCHES)]
                    k = StampKernels(be, device="cpu")
                stamps = make_stamp_source()
                for step, toks in enumerate(((5, 3), (64, 17), (1, 64))):
                    enqueue_dsv4_step(ws, k, streams, toks, variant="random", rng=rng,
                                      stamps=stamps, step=step)
                if device.type == "cpu":
                    be.execute(random.Random(1000 + seed))
                bad += len(k.mismatches())
            return bad

    fenced, unfenced = run(True), run(False)
    return {"what": "no-fence switch, fork-free fan-out (testing.schedule), slow consumers",
            "mismatches_with_fences": fenced, "mismatches_without_fences": unfenced,
            "detected": unfenced > 0 and fenced == 0}


# Ops that read device memory on the host (or copy host data in): illegal in a
# CUDA-graph capture. ``tolist()`` does not dispatch on CPU; none of the code
# under test calls it (grep).
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "item",
                           "lift_fresh", "_assert_async"})


def host_sync_lint(impl: str, seed: int) -> dict[str, int]:
    """One CPU step, forward-context mode FULL (the eager break inline, as in a
    FULL capture), under a dispatch mode that records host syncs: the CPU
    evidence that the whole forward (vLLM's bodies, the plugin's overrides,
    the stand-ins) can be captured."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.config import CUDAGraphMode

    found: Counter[str] = Counter()

    class Lint(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            name = func.overloadpacket.__name__
            if name in HOST_SYNC_OPS:
                found[name] += 1
            return func(*args, **(kwargs or {}))

    m = Model(impl, torch.device("cpu"), seed, policy="shared", aux_streams=False)
    m.load_step(0)
    with Lint():
        m.forward_step(CUDAGraphMode.FULL)
    return dict(found)


# --- driver -----------------------------------------------------------------------------

MODES_CPU = ("eager", "private", "mrv1")
# Plugin leases per step at run/replay time (2 micro-batches; review §1c).
EXPECTED_LEASES = {"eager": 30, "private": 30, "mrv1": 30, "cuda-eager": 30,
                   "cuda-piecewise": 6, "cuda-piecewise-gemm0": 6, "cuda-piecewise-mrv1": 6,
                   "cuda-full": 0}
MODES_CUDA = ("cuda-eager", "cuda-piecewise", "cuda-piecewise-gemm0", "cuda-piecewise-mrv1",
              "cuda-full")


def run_mode(mode: str, impl: str, where: torch.device, seed: int, steps: int
             ) -> dict[str, Any]:
    """One mode for one layer class: outputs, counts and fence statistics."""
    from vllm import _harness_standins as S
    from vllm import envs as venvs

    policy = "private" if mode == "private" else "shared"
    threshold = venvs.VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD
    S.SLOW["cycles"] = SLEEP_CYCLES if mode == "cuda-eager" else 0
    if mode == "cuda-piecewise-gemm0":
        # The input GEMMs stay on the default stream: a C128 compressor captured
        # on it finds its last user (aux0, earlier) outside the segment, the
        # fence GraphSafeCudaStreamBackend must drop (review §2c).
        venvs.VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD = 0
    try:
        m = Model(impl, where, seed, policy=policy, aux_streams=mode.startswith("cuda"),
                  mrv1=mode in ("mrv1", "cuda-piecewise-mrv1"))
        if mode in ("eager", "private", "mrv1", "cuda-eager"):
            res = run_eager(m, steps)
        elif mode in ("cuda-piecewise", "cuda-piecewise-gemm0"):
            res = run_piecewise(m, steps)
        elif mode == "cuda-piecewise-mrv1":
            res = run_piecewise(m, steps, capture_metadata=False)
        elif mode == "cuda-full":
            res = run_full(m, steps)
        else:
            raise ValueError(f"mode: unknown {mode!r}")
    finally:
        S.SLOW["cycles"] = 0
        venvs.VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD = threshold
    res.update(_fences(m))
    return res


def _write(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def run_all(modes: list[str] | None = None, steps: int = 3, device: str | None = None,
            seed: int = 0, log: Callable[[str], None] = print,
            json_path: str | None = None) -> dict[str, Any]:
    """Every mode, the comparisons and the controls; with ``json_path`` the
    report is rewritten after each mode (``complete`` false until the end), so
    a run killed by a timeout still leaves what it did."""
    vllm = _stub()
    from vllm import _harness_standins as S

    # One CPU thread by default: OpenMP threads sharing busy cores collapse, and the
    # tensors here are small (HARNESS_THREADS to change it).
    torch.set_num_threads(int(os.environ.get("HARNESS_THREADS", "1")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    version = vllm.__version__
    has_mrv1 = version.startswith("0.33.")
    cpu_modes = [m for m in MODES_CPU if m != "mrv1" or has_mrv1]
    cuda_modes = [m for m in MODES_CUDA if m != "cuda-piecewise-mrv1" or has_mrv1]
    if modes is None:
        modes = cpu_modes + (cuda_modes if dev.type == "cuda" else [])
    report: dict[str, Any] = {"vllm": version, "stub": os.path.dirname(vllm.__file__),
                              "torch": torch.__version__, "device": str(dev), "steps": steps,
                              "ratios": list(RATIOS), "ubatches": NUM_UBATCHES,
                              "tokens_per_ubatch": DECODES + PREFILL, "modes": {},
                              "controls": {}, "complete": False, "ok": False}
    t0 = time.time()
    refs: dict[tuple[str, str], list[torch.Tensor]] = {}

    def reference(impl: str, where: torch.device) -> list[torch.Tensor]:
        key = (impl, where.type)
        if key not in refs:
            m = Model(impl, where, seed, policy="off", aux_streams=False)
            refs[key] = run_eager(m, steps)["outputs"]
        return refs[key]

    ok = True
    for mode in modes:
        where = dev if mode.startswith("cuda") else torch.device("cpu")
        entry: dict[str, Any] = {}
        for impl in ("plugin", "vllm"):
            if mode == "private" and impl == "vllm":
                continue
            try:
                res = run_mode(mode, impl, where, seed, steps)
                cmp = _diff(res.pop("outputs"), reference(impl, where))
            except Exception as e:  # noqa: BLE001 - keep going: the other modes still tell
                import traceback

                res = {"error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()[-4000:]}
                cmp = {"bitwise_equal": False}
                log(f"[{mode:15s}] {impl:6s} ERROR {res['error']}")
            res.update(cmp)
            want = EXPECTED_LEASES.get(mode) if impl == "plugin" else 0
            if "leases_per_step" in res and want is not None:
                res["leases_as_expected"] = all(n == want for n in res["leases_per_step"])
            entry[impl] = res
            ok &= cmp["bitwise_equal"]
            if "error" not in res:
                log(f"[{mode:15s}] {impl:6s} bitwise={cmp['bitwise_equal']} "
                    f"leases/step={res['leases_per_step']} "
                    f"allocs/step={res['allocations_per_step']}"
                    + (f" allocator/step={res['allocator_requests_per_step']}"
                       if res.get("allocator_requests_per_step") is not None else "")
                    + (f" fences dropped={res['fences_dropped']}"
                       if "fences_dropped" in res else ""))
        report["modes"][mode] = entry
        if json_path:
            _write(json_path, report)
    # The plugin's layer and vLLM's compute the same bits (same stand-ins).
    for where in {torch.device("cpu")} | ({dev} if dev.type == "cuda" else set()):
        try:
            same = _diff(reference("plugin", where), reference("vllm", where))
        except Exception as e:  # noqa: BLE001 - reported as not equal
            same = {"bitwise_equal": False}
            report[f"plugin_equals_vllm_{where.type}_error"] = f"{type(e).__name__}: {e}"
        report[f"plugin_equals_vllm_{where.type}"] = same["bitwise_equal"]
        ok &= same["bitwise_equal"]
        log(f"plugin == vLLM ({where.type} reference): {same['bitwise_equal']}")

    for impl in ("plugin", "vllm"):
        syncs = host_sync_lint(impl, seed)
        report.setdefault("host_syncs_in_forward_cpu", {})[impl] = syncs
        ok &= not syncs
        log(f"[capture lint   ] {impl:6s} host syncs in one forward: {syncs or 'none'}")

    # (b) a wrong stand-in must be caught.
    S.FAULTS["topk_off_by_one"] = True
    try:
        m = Model("plugin", torch.device("cpu"), seed, policy="shared", aux_streams=False)
        wrong = _diff(run_eager(m, steps)["outputs"], reference("plugin", torch.device("cpu")))
    finally:
        S.FAULTS["topk_off_by_one"] = False
    report["controls"]["wrong_standin_topk_off_by_one"] = {
        "steps_differing": wrong["steps_differing"], "detected": not wrong["bitwise_equal"]}
    log(f"[control b] top-k off by one detected={not wrong['bitwise_equal']} "
        f"(steps differing {wrong['steps_differing']})")
    # (a) the no-fence switch.
    for where in [torch.device("cpu")] + ([dev] if dev.type == "cuda" else []):
        try:
            ctl = control_no_fence_schedule(where)
        except Exception as e:  # noqa: BLE001 - reported, counts as not detected
            ctl = {"error": f"{type(e).__name__}: {e}", "detected": False,
                   "mismatches_without_fences": None, "mismatches_with_fences": None}
        report["controls"][f"no_fence_schedule_{where.type}"] = ctl
        log(f"[control a/{where.type}] no-fence corrupt={ctl['mismatches_without_fences']} "
            f"fenced={ctl['mismatches_with_fences']} detected={ctl['detected']}"
            + (f" ERROR {ctl['error']}" if "error" in ctl else ""))
        if json_path:
            _write(json_path, report)
    if dev.type == "cuda" and "cuda-eager" in modes:
        note = "information only: vLLM's own fork/join orders every hand-over"
        try:
            with _env(VLLM_DSV4_TEST_UNSAFE_NO_FENCES="1"):
                S.SLOW["cycles"] = SLEEP_CYCLES
                try:
                    m = Model("plugin", dev, seed, policy="shared", aux_streams=True)
                    info = _diff(run_eager(m, steps)["outputs"], reference("plugin", dev))
                finally:
                    S.SLOW["cycles"] = 0
            report["controls"]["info_no_fence_on_vllm_flow_cuda"] = {
                "bitwise_equal": info["bitwise_equal"], "note": note}
            log(f"[info] no fences on vLLM's real flow (CUDA): equal={info['bitwise_equal']}")
        except Exception as e:  # noqa: BLE001 - information only
            report["controls"]["info_no_fence_on_vllm_flow_cuda"] = {
                "error": f"{type(e).__name__}: {e}", "note": note}
    for name, ctl in report["controls"].items():
        if "detected" in ctl:
            ok &= bool(ctl["detected"])
    report["ok"] = bool(ok)
    report["complete"] = True
    report["seconds"] = round(time.time() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CUDA-graph harness for the plugin's CUDA layer")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--modes", help="comma-separated (default: every mode this device runs)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",") if args.modes else None
    report = run_all(modes, steps=args.steps, device=args.device, json_path=args.json)
    if args.json:
        _write(args.json, report)
    print(f"harness: vLLM {report['vllm']} stub, {report['device']}: "
          f"{'OK' if report['ok'] else 'FAILED'} in {report['seconds']} s")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
