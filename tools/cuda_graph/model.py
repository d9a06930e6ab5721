# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The harness's model: DeepSeek-V4 attention layers (by default seven,
compress ratios 1, 4, 128, 4, 128, 4, 1; ``ratios`` names others, e.g.
DeepSeek-V4-Flash's 43) of one class, the plugin's
``DSV4FlashMLAAttention`` or vLLM's ``DeepseekV4FlashMLAAttention`` (from
the stub: vLLM's verbatim bodies), built without ``__init__``
(``bare_module``), their caches and per-micro-batch metadata (static tensors
updated in place each step, as CUDA graphs need), and the allocation meter.

``streams``: the layers get three aux streams and their events
(``torch.cuda.Stream`` / ``Event``: real ones on a GPU, ``simcuda``'s under
emulation), and the plugin's workspace a ``GraphSafeCudaStreamBackend``.
``layers``: the indices of ``ratios`` this model holds (a pipeline stage
holds some; its workspace registers only those). ``batches``: the batch
shapes the model can run (:class:`Batch`: decode requests + one prefill
chunk per micro-batch), each with its own static metadata, as vLLM's
graphs of each capture size keep theirs; :meth:`Model.select` picks one.
``indexer``: the indexer cache dtype, ``fp8`` or ``mxfp4`` (the index q
path: vLLM's MXFP4 kernels and wrapper, the workspace's MXFP4 views; the
indexer K cache stays the harness's float rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import threading
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


@dataclasses.dataclass(frozen=True)
class Batch:
    """One micro-batch's shape: ``decodes`` decode requests (one token each)
    and one prefill chunk of ``prefill`` tokens (0: a decode-only batch)."""

    decodes: int
    prefill: int

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill


BATCH = Batch(DECODES, PREFILL)
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


@contextlib.contextmanager
def measuring(meter: Meter) -> Iterator[None]:
    """The stand-in kernels' own allocations are counted apart (``Meter.kernel``)."""
    from vllm import _harness_standins as S

    S._MEASURE[:] = [meter.kernel]
    try:
        yield
    finally:
        S._MEASURE.clear()


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
                 aux_streams: bool, mrv1: bool = False, sim: bool = False,
                 layers: tuple[int, ...] | None = None,
                 ratios: tuple[int, ...] = RATIOS, batches: tuple[Batch, ...] = (BATCH,),
                 indexer: str = "fp8") -> None:
        import vllm
        from vllm.models.deepseek_v4 import attention as vattn
        from vllm.models.deepseek_v4 import compressor as vcomp
        from vllm.models.deepseek_v4.nvidia import flashmla as vfm

        if indexer not in ("fp8", "mxfp4"):
            raise ValueError(f"indexer: expected fp8 or mxfp4, got {indexer!r}")
        if any(b.tokens > MNBT for b in batches):
            raise ValueError(f"batches: at most {MNBT} tokens per micro-batch")
        self.impl, self.device = impl, device
        self.ratios, self.batches, self.indexer = tuple(ratios), tuple(batches), indexer
        self.version = vllm.__version__
        g = torch.Generator().manual_seed(seed)
        self.g = g
        dev = device

        def rnd(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

        streams = dev.type == "cuda" or sim
        self.sim = sim
        self.aux = ([torch.cuda.Stream(dev) for _ in range(3)]
                    if aux_streams and streams else None)

        def events(n: int) -> list[Any]:
            return [torch.cuda.Event() if streams else None for _ in range(n)]

        self.topk_buf = torch.full((MNBT, TOPK), -1, dtype=torch.int32, device=dev)
        self.cos_sin = rnd(MAXPOS, 64)
        rope = types.SimpleNamespace(cos_sin_cache=self.cos_sin)
        # Per micro-batch: the most decode requests any batch has, and one prefill.
        self.max_decodes = max(b.decodes for b in self.batches)
        reqs = NUM_UBATCHES * (self.max_decodes + 1)
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
        for i, ratio in enumerate(self.ratios):
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
                    softmax_scale=INDEX_DIM**-0.5, use_fp4_kv=indexer == "mxfp4",
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
        if layers is not None:  # a pipeline stage: built alike, only these kept
            self.layers = [self.layers[i] for i in layers]
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
        from vllm import _harness_recording as R

        from vllm_dsv4_backend.layer import cuda as plugin_cuda
        from vllm_dsv4_backend.layer.plan import Dims, build_workspace_config

        os.environ["VLLM_DSV4_WORKSPACE"] = policy
        # Serving's builder and the CUDA layer's own lease plan.
        dims = Dims(num_local_heads=HEADS, padded_q_heads=self.layers[0].padded_heads,
                    head_dim=HEAD_DIM, index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM,
                    index_topk=TOPK)
        cfg = build_workspace_config(dims, max_num_batched_tokens=MNBT,
                                     indexer_kv_dtype=self.indexer, platform="cuda",
                                     num_ubatches=NUM_UBATCHES)
        streams = (plugin_cuda.GraphSafeCudaStreamBackend(
            torch.device("cuda") if self.sim else self.device)
            if self.device.type == "cuda" or self.sim else None)
        self.ws = plugin_cuda.make_workspace(cfg, device=self.device, streams=streams)
        for layer in self.layers:
            # The adapter serving runs (VllmCudaKernels), calling the stub's
            # recording stand-ins of vLLM's kernel objects.
            layer._dsv4_attach(self.ws)
        self.ws.reserve()
        if self.ws.storage is not None:
            R.WORKSPACE_STORAGES.add(self.ws.storage.untyped_storage().data_ptr())

    # --- metadata (static tensors, updated per step) ---------------------------------

    def _build_metadata(self) -> None:
        rng = random.Random(1234)
        per_req = {
            "swa": -(-MAXPOS // SWA_BLOCK), "state": -(-MAXPOS // STATE_BLOCK),
            "c4": -(-(MAXPOS // 4 + 1) // C_BLOCK), "c128": -(-(MAXPOS // 128 + 1) // C_BLOCK),
            "idx": -(-(MAXPOS // 4 + 1) // I_BLOCK),
        }
        self.tables: list[dict[str, torch.Tensor]] = []
        self.start_pos: list[list[int]] = []
        nr = self.max_decodes + 1  # the prefill request is the last row
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
        self._static = {b: self._batch_metadata(b) for b in self.batches}
        self.select(self.batches[0])

    def select(self, batch: Batch) -> None:
        """Run ``batch``'s shape from now on: its static metadata, inputs and
        positions become ``md`` / ``hidden`` / ``positions``."""
        self.batch = batch
        self.ntok = batch.tokens
        self.md, self.hidden, self.positions, self._parts = self._static[batch]

    def _batch_metadata(self, batch: Batch) -> tuple[list[dict[str, Any]], list[torch.Tensor],
                                                     list[torch.Tensor], list[Any]]:
        dev = self.device
        nd, npf = batch.decodes, batch.prefill
        ntok = batch.tokens
        md_list: list[dict[str, Any]] = []
        parts: list[Any] = []  # per micro-batch: the metadata objects, by kind
        hidden: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []

        def z(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=dev)

        for u in range(NUM_UBATCHES):
            tb = {k: v.to(dev) for k, v in self.tables[u].items()}
            t2r = z(ntok)
            swa = types.SimpleNamespace(
                num_decodes=nd, num_prefills=int(npf > 0), num_decode_tokens=nd,
                num_prefill_tokens=npf, is_valid_token=z(ntok, dtype=torch.bool),
                token_to_req_indices=t2r, slot_mapping=z(ntok, dtype=torch.int64),
                block_size=SWA_BLOCK, block_table=tb["swa"],
                decode_swa_indices=z(nd, 1, WINDOW), decode_swa_lens=z(nd),
                prefill_swa_indices=z(npf, WINDOW), prefill_swa_lens=z(npf),
                tile_sched_swaonly=object(), tile_sched_c4a=object(),
                tile_sched_c128a=object())
            state = types.SimpleNamespace(
                block_table=tb["state"], slot_mapping=z(ntok, dtype=torch.int64),
                block_size=STATE_BLOCK, token_to_req_indices=t2r, num_decode_tokens=nd,
                c128_boundary=None)
            c4 = types.SimpleNamespace(block_size=C_BLOCK * 4, block_table=tb["c4"],
                                       slot_mapping=z(ntok, dtype=torch.int64))
            c128 = types.SimpleNamespace(
                block_size=C_BLOCK * 128, block_table=tb["c128"],
                slot_mapping=z(ntok, dtype=torch.int64),
                c128a_global_decode_topk_indices=z(nd, 1, K128),
                c128a_decode_topk_lens=z(nd), c128a_prefill_topk_indices=z(npf, K128),
                c128a_prefill_topk_lens=z(npf))
            idx = types.SimpleNamespace(
                max_seq_len=MAXPOS, max_compressed=MAXPOS // 4, num_decode_tokens=nd,
                num_prefill_tokens=npf, slot_mapping=z(ntok, dtype=torch.int64),
                block_size=I_BLOCK, block_table=tb["idx"], token_to_req_indices=t2r,
                positions=z(ntok, dtype=torch.int64))
            parts.append(types.SimpleNamespace(swa=swa, state=state, c4=c4, c128=c128,
                                               idx=idx))
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
            md_list.append(md)
            hidden.append(z(ntok, HIDDEN, dtype=torch.bfloat16))
            positions.append(z(ntok, dtype=torch.int64))
        return md_list, hidden, positions, parts

    def load_step(self, step: int) -> None:
        """Copy step ``step``'s inputs and metadata into the static tensors
        (the selected batch; each request has advanced ``step`` times)."""
        b = self.batch
        for u in range(NUM_UBATCHES):
            self.load_ubatch(u, [step] * b.decodes + [step * b.prefill], seed=1000 * step + u)

    def load_ubatch(self, u: int, done: list[int], seed: int) -> None:
        """Micro-batch ``u`` of the selected batch: decode request ``r`` at
        position ``start + done[r]``, the prefill chunk from ``start + done[-1]``;
        the hidden states drawn from ``seed``."""
        b = self.batch
        g = torch.Generator().manual_seed(seed)
        nd, npf = b.decodes, b.prefill
        pr = self.max_decodes  # the prefill request's row
        pos = [self.start_pos[u][r] + done[r] for r in range(nd)]
        pos += [self.start_pos[u][pr] + done[-1] + j for j in range(npf)]
        if max(pos, default=0) >= MAXPOS:
            raise ValueError(f"a request reached position {max(pos)} (MAXPOS {MAXPOS})")
        t2r = list(range(nd)) + [pr] * npf
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

        h = self._parts[u]
        swa, state, c4, idx, c128 = h.swa, h.state, h.c4, h.idx, h.c128
        dec = list(zip(t2r[:nd], pos[:nd]))
        pre = list(zip(t2r[nd:], pos[nd:]))
        put(self.positions[u], pos)
        put(self.hidden[u], torch.randn(self.ntok, HIDDEN, generator=g).tolist())
        put(swa.is_valid_token, [True] * self.ntok)
        put(swa.token_to_req_indices, t2r)
        put(swa.slot_mapping, [slot("swa", SWA_BLOCK, r, p) for r, p in zip(t2r, pos)])
        put(swa.decode_swa_indices, [window(r, p) for r, p in dec])
        put(swa.decode_swa_lens, [WINDOW] * nd)
        put(swa.prefill_swa_indices, [window(r, p) for r, p in pre])
        put(swa.prefill_swa_lens, [WINDOW] * npf)
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
            return self.layer_in_thread(layer, u, x, meter)

    def layer_in_thread(self, layer: Any, u: int, x: torch.Tensor,
                        meter: Meter | None) -> torch.Tensor:
        """One layer and the residual add, in the current forward context (inside
        micro-batch ``u``'s ``UBatchContext`` thread: the context's)."""
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

