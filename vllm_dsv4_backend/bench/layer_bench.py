# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The attention eager region of N DeepSeek-V4 layers, per workspace policy (torch only).

A torch-only, vLLM-free model of one eager step per layer (the workspace policies' cost on a
machine without vLLM, e.g. a lent GPU); the served CPU layer now runs vLLM's ``_C`` ops, and
``bench.layer_ab`` times that real layer against vLLM's own. One step here:

1. lease ``q`` (views ``q`` and ``out``), ``ops.rope.qnorm_rope_kv_insert`` into ``q``
   (q RMSNorm + RoPE into the padded q rows, SWA cache insert of the new token);
2. C4 layers whose context has more compressed entries than ``index_topk``: lease
   ``indexer_q`` and run ``ops.indexer.indexer_q_rope_quant`` into it (the layer's
   ``DSV4Indexer``: short contexts skip it, vLLM's rule);
3. C4 layers: lease ``topk`` and run ``eager.select_topk_c4`` (indexer logits over the paged
   indexer K cache, causal top-k, local -> global slots), release ``indexer_q``;
   C128 layers: the precomputed "every visible entry" slot table (metadata, once per step);
4. ``eager.attend`` (sparse MLA over the SWA window + compressed entries, sink) into ``out``;
5. release ``topk`` and ``q``.

The ``eager`` functions are the ones the CPU layer uses for the MXFP4 indexer and the
``VLLM_DSV4_KERNEL=torch`` path. The workspace is a
:class:`~vllm_dsv4_backend.workspace.WorkspaceManager` per policy (``off`` / ``shared`` /
``private``), reserved once per run like at model load.

Per case (mode x batch x context x policy) the benchmark reports p50/p99 step latency,
allocations in the eager region (counted with the dispatch-mode counter of
:mod:`vllm_dsv4_backend.workspace.alloc_counter` on separate, untimed steps), workspace
bytes, peak memory and achieved bytes/s against the memory-bandwidth floor; see
``docs/benchmarks.md`` for every JSON key. Policies run round-robin step by step, so
machine noise hits them alike and ratios come from one run.

This module never imports vLLM; the optional peer (vLLM's C++ CPU kernel) is looked up
through ``torch.ops._C`` lazily (:mod:`vllm_dsv4_backend.ops.vllm_cpu`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import random
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from vllm_dsv4_backend import eager, ops
from vllm_dsv4_backend.bench.kernels import gemm_floor_fn
from vllm_dsv4_backend.bench.schema import PHASES, SCHEMA, summarize
from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.formats import indexer_cache as ic
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.ops import rope as rope_ops
from vllm_dsv4_backend.ops import slots as slot_ops
from vllm_dsv4_backend.ops import vllm_cpu
from vllm_dsv4_backend.workspace import POLICIES, WorkspaceConfig, WorkspaceManager
from vllm_dsv4_backend.workspace.alloc_counter import AllocationCounter
from vllm_dsv4_backend.workspace.sizing import DSV4_FLASH_HF_CONFIG

ENTRY_BYTES = fp8_ds_mla.BYTES_PER_TOKEN  # 584
HEAD_DIM = fp8_ds_mla.HEAD_DIM  # 512
ROPE_DIM = fp8_ds_mla.ROPE_DIM  # 64
SWA_BLOCK = 64  # vLLM's DeepseekV4SWACache block (matches the C4 page)
KERNEL_BLOCK = 256  # tokens per compressed-cache page: 256 / ratio entries per block
INDEXER_BLOCK = 64  # C4 indexer K cache entries per block (256 tokens / 4)
C128_ALIGN = 128  # vLLM rounds the C128 slot-table width to this
RMS_EPS = 1e-6

# The Flash middle layers alternate C4 / C128 (layers 2..41 of [0,0] + [4,128]*20 + [4]).
FLASH_MIDDLE = (4, 128)

PEER_OP = "flash_mla_with_kvcache_cpu"
# Decode tokens/s per layer of torch.ops._C.flash_mla_with_kvcache_cpu, DeepSeek-V4-Flash C4
# shapes (64 heads, window 128 + top-k 512), on the project's 2-core AVX512-BF16 reference
# machine, as quoted in the issue. Used as the reference when the peer cannot run here.
QUOTED_PEER_TOK_S: dict[int, float] = {1: 3045.0, 8: 4121.0, 32: 5315.0}
QUOTED_PEER_ENTRIES = 128 + 512


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to run. Shapes default to DeepSeek-V4-Flash.

    Attributes:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``... (``None``: CUDA if available).
        layers: one vLLM compress ratio per benchmarked layer (0 = SWA only, 4 = C4,
            128 = C128).
        batches: decode batch sizes (one token per request).
        contexts: context lengths (decode: position ``context - 1``; prefill: the chunk ends
            at ``context``).
        prefill_tokens: prefill chunk sizes (one request); ``()`` = no prefill cases.
        policies: workspace policies, run side by side.
        indexer_kv_dtype: ``"fp8"`` (132 B entries) or ``"mxfp4"`` (68 B).
        tp: tensor parallelism: ``num_heads / tp`` local heads, padded for FlashMLA.
        num_heads, window, index_topk: model shapes (Flash: 64, 128, 512).
        steps: timed steps per case and policy; ``None`` = as many as fit ``target_s``.
        target_s: wall-time budget per case and policy when ``steps`` is None.
        min_steps, max_steps: bounds of the automatic step count.
        warmup: untimed rounds before timing (every policy).
        count_steps: untimed steps with the allocation counter, per case and policy.
        peer: also time the attention alone against vLLM's C++ CPU kernel (CPU decode).
        max_num_batched_tokens: workspace rows; ``None`` = the largest step of the run.
        seed: RNG seed of the synthetic inputs.
        time_budget_s: start no new case after this many seconds (the rest are listed in
            ``meta.skipped_cases``); ``None`` = no limit.
        probe_bytes: size of the copy-bandwidth probe (``None``: 1 GiB CUDA, 128 MiB CPU).
    """

    device: str | None = None
    layers: tuple[int, ...] = FLASH_MIDDLE * 2
    batches: tuple[int, ...] = (1, 8, 32)
    contexts: tuple[int, ...] = (1024, 8192)
    prefill_tokens: tuple[int, ...] = ()
    policies: tuple[str, ...] = ("off", "shared", "private")
    indexer_kv_dtype: str = "fp8"
    tp: int = 1
    num_heads: int = 64
    window: int = 128
    index_topk: int = 512
    steps: int | None = None
    target_s: float = 1.5
    min_steps: int = 5
    max_steps: int = 50
    warmup: int = 1
    count_steps: int = 1
    peer: bool = True
    max_num_batched_tokens: int | None = None
    seed: int = 0
    time_budget_s: float | None = None
    probe_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "batches", "contexts", "prefill_tokens", "policies"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.layers:
            raise ValueError("layers: expected at least one compress ratio, got ()")
        for r in self.layers:
            if r not in (0, 1, 4, 128):
                raise ValueError(f"layers: expected compress ratios in (0, 1, 4, 128), got {r!r}")
        for name in ("batches", "contexts", "prefill_tokens"):
            for v in getattr(self, name):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{name}: expected positive ints, got {v!r}")
        if not self.policies or any(p not in POLICIES for p in self.policies):
            raise ValueError(f"policies: expected a non-empty subset of {POLICIES}, "
                             f"got {self.policies!r}")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies: expected no duplicates, got {self.policies!r}")
        if self.indexer_kv_dtype not in ("fp8", "mxfp4"):
            raise ValueError(f"indexer_kv_dtype: expected 'fp8' or 'mxfp4', got "
                             f"{self.indexer_kv_dtype!r}")
        if self.num_heads % self.tp:
            raise ValueError(f"tp: expected a divisor of num_heads={self.num_heads}, "
                             f"got {self.tp}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps: expected a positive int or None, got {self.steps!r}")
        if not self.batches and not self.prefill_tokens:
            raise ValueError("batches / prefill_tokens: nothing to run (both empty)")

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp

    @property
    def padded_heads(self) -> int:
        # FlashMLA's sparse FP8 decode kernel runs 64 or 128 q heads (vLLM pads the same).
        return 64 if self.local_heads <= 64 else 128

    def cases(self) -> list[tuple[str, int, int, int]]:
        """``(mode, batch, tokens, context)`` of every case, decode first."""
        out = [("decode", b, b, c) for c in self.contexts for b in self.batches]
        for t in self.prefill_tokens:
            for c in self.contexts:
                if c >= t:
                    out.append(("prefill", 1, t, c))
        return out


def default_config(**overrides: Any) -> BenchConfig:
    """The default run: decode, batch 1/8/32, contexts 1k/8k, 4 Flash layers, 3 policies."""
    return BenchConfig(**overrides)


def full_config(**overrides: Any) -> BenchConfig:
    """The issue's whole sweep: batch 1/8/32/64, contexts 1k/8k/32k, prefill 1k/4k."""
    kw: dict[str, Any] = dict(batches=(1, 8, 32, 64), contexts=(1024, 8192, 32768),
                              prefill_tokens=(1024, 4096))
    kw.update(overrides)
    return BenchConfig(**kw)


def tiny_config(**overrides: Any) -> BenchConfig:
    """Seconds on a CPU: 2 layers (C4 + C128), small contexts, top-k 32 so that the indexer
    logits path runs (context 256 -> 64 compressed entries > 32), a short prefill."""
    kw: dict[str, Any] = dict(
        device="cpu", layers=FLASH_MIDDLE, batches=(1, 2), contexts=(256,),
        prefill_tokens=(8,), window=16, index_topk=32, steps=2, warmup=1, peer=True,
        probe_bytes=16 << 20,
    )
    kw.update(overrides)
    return BenchConfig(**kw)


PRESETS: dict[str, Callable[..., BenchConfig]] = {
    "default": default_config, "full": full_config, "tiny": tiny_config,
}


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but torch.cuda.is_available() is False")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_threads(threads: str | int | None) -> int:
    """``auto``: torch's default, lowered to the cores the 1-minute load leaves idle (at least
    1): OpenMP's barrier spinning collapses when its threads share cores with other work
    (measured here: 2 threads on a loaded 2-core box run the attention 10-70x slower than 1)."""
    if threads is None or threads == "auto":
        n = torch.get_num_threads()
        if hasattr(os, "getloadavg"):
            idle = (os.cpu_count() or n) - os.getloadavg()[0]
            n = max(1, min(n, int(math.floor(idle + 0.5))))
        return n
    n = int(threads)
    if n < 1:
        raise ValueError(f"threads: expected 'auto' or a positive int, got {threads!r}")
    return n


# ---------------------------------------------------------------------------------------------
# measuring helpers
# ---------------------------------------------------------------------------------------------
class _TrackingCounter(AllocationCounter):
    """``AllocationCounter`` that also tracks the bytes of the tensors it counted while they
    live (a finalizer on each storage), so ``peak_live_bytes`` is the region's transient peak
    on any device."""

    def __init__(self, cuda_device: torch.device | None = None) -> None:
        super().__init__(cuda_device)
        self.live_bytes = 0
        self.peak_live_bytes = 0

    def _add(self, op: str, t: torch.Tensor) -> None:
        super()._add(op, t)
        storage = t.untyped_storage()
        n = storage.nbytes()
        self.live_bytes += n
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, n)

    def _free(self, n: int) -> None:
        self.live_bytes -= n


class _StepProbe:
    """Per-step instrumentation: phase clock and, on counted steps, allocation counters
    around each kernel call (the rest of the step is the eager-region glue)."""

    def __init__(self, device: torch.device, count: bool) -> None:
        self.device = device
        self.count = count
        self.kernel_allocs = 0
        self.kernel_bytes = 0
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []

    def _now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @contextlib.contextmanager
    def kernel(self, phase: str) -> Iterator[None]:
        start = self._now()
        if self.count:
            with _TrackingCounter() as c:
                yield
            self.kernel_allocs += c.count
            self.kernel_bytes += c.nbytes
        else:
            yield
        self.marks.append((phase, (start, self._now())))

    def phase_seconds(self) -> dict[str, float]:
        out = dict.fromkeys(PHASES, 0.0)
        for phase, (a, b) in self.marks:
            out[phase] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device memory bandwidth in GB/s from a large ``copy_`` (read + write bytes / time),
    the best of a few repetitions: the practical ceiling the floor is measured against."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def _percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100])."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# ---------------------------------------------------------------------------------------------
# synthetic inputs
# ---------------------------------------------------------------------------------------------
def _cos_sin_cache(max_pos: int, device: torch.device) -> torch.Tensor:
    """``[max_pos, 64]`` float32 ``[cos_0..cos_31, sin_0..sin_31]`` (vLLM's layout)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM))
    ang = torch.arange(max_pos, dtype=torch.float64).unsqueeze(1) * inv.unsqueeze(0)
    return torch.cat([ang.cos(), ang.sin()], dim=1).to(torch.float32).to(device)


def _shuffled_table(rows: int, cols: int, gen: torch.Generator,
                    device: torch.device) -> tuple[torch.Tensor, int]:
    """``[rows, cols]`` int32 block table over ``rows * cols`` shuffled physical blocks
    (+1 spare block so that id 0 is not special)."""
    n = rows * cols
    perm = torch.randperm(n + 1, generator=gen)[:n] if n else torch.zeros(0, dtype=torch.long)
    return perm.view(rows, cols).to(torch.int32).to(device), n + 1


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal samples drawn on the generator's device (no host -> device copy of caches)."""
    x = torch.randn(*shape, generator=gen, device=gen.device)
    return (x * scale if scale != 1.0 else x).to(dtype)


def _fill_main(cache: torch.Tensor, slots: torch.Tensor, gen: torch.Generator,
               chunk: int = 1 << 16) -> None:
    """Random bf16 rows quantized into ``slots`` through ``fp8_ds_mla.quantize_and_insert``."""
    for i in range(0, slots.numel(), chunk):
        s = slots[i : i + chunk]
        kv = _randn(gen, s.numel(), HEAD_DIM, scale=1 / 3, dtype=torch.bfloat16)
        fp8_ds_mla.quantize_and_insert(kv, cache, s)


def _fill_indexer(cache: torch.Tensor, slots: torch.Tensor, dtype: str, gen: torch.Generator,
                  chunk: int = 1 << 16) -> None:
    for i in range(0, slots.numel(), chunk):
        s = slots[i : i + chunk]
        k = _randn(gen, s.numel(), ic.HEAD_DIM, dtype=torch.bfloat16)
        ic.quantize_and_insert(k, cache, s, dtype)


def _table_slots(table: torch.Tensor, entries: int, block: int) -> torch.Tensor:
    """Global slots of local entries ``0..entries-1`` of every row of ``table``."""
    j = torch.arange(entries, device=table.device)
    blk = table.long()[:, j // block]
    return (blk * block + (j % block)).reshape(-1)


@dataclasses.dataclass
class _Layer:
    """One layer's inputs and caches (shapes in :func:`build_case`)."""

    name: str
    ratio: int
    q_raw: torch.Tensor  # [T, H, 512] bf16
    kv: torch.Tensor  # [T, 512] bf16
    swa_cache: torch.Tensor  # [nb, 64, 584] uint8 (padded stride)
    attn_sink: torch.Tensor  # [Hp] fp32, pad heads -inf
    comp_cache: torch.Tensor | None = None  # [nb, 256/ratio, 584] uint8
    comp_table: torch.Tensor | None = None  # [R, max_blocks] int32
    entries_per_block: int = 0
    c128_indices: torch.Tensor | None = None  # [T, W128] int32
    c128_lens: torch.Tensor | None = None  # [T] int32
    idx_cache: torch.Tensor | None = None  # [nb, 64, 132 | 68] uint8
    idx_table: torch.Tensor | None = None  # [R, max_blocks] int32
    idx_q_raw: torch.Tensor | None = None  # [T, 64, 128] bf16
    idx_weights: torch.Tensor | None = None  # [T, 64] fp32


@dataclasses.dataclass
class Case:
    """A built case: step-wide metadata plus per-layer caches (everything on ``device``)."""

    mode: str
    batch: int
    tokens: int
    context: int
    device: torch.device
    positions: torch.Tensor  # [T] int64
    token_to_req: torch.Tensor  # [T] int32
    swa_slot_mapping: torch.Tensor  # [T] int64
    window_indices: torch.Tensor  # [T, W] int32
    window_lens: torch.Tensor  # [T] int32
    cos_sin: torch.Tensor  # [max_pos, 64] fp32
    topk_arange: torch.Tensor  # [K] int32
    minus_one: torch.Tensor  # int32 scalar
    layers: list[_Layer]
    run_indexer: bool
    max_compressed: int

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.mode, self.batch, self.tokens, self.context)


def build_case(cfg: BenchConfig, mode: str, batch: int, tokens: int, context: int,
               device: torch.device, seed: int) -> Case:
    """Synthetic inputs of one case: random caches filled through the formats'
    ``quantize_and_insert``, block tables over shuffled physical blocks.

    Decode: ``batch`` requests, one token each at position ``context - 1``. Prefill: one
    request, ``tokens`` tokens at positions ``context - tokens .. context - 1``.
    SWA caches hold only the blocks the window (and the chunk) touch, as vLLM's window cache
    does; compressed caches hold ``context // ratio`` entries per request.
    """
    gen = torch.Generator().manual_seed(seed)  # host: permutations
    dgen = torch.Generator(device=device).manual_seed(seed)  # device: tensor contents
    reqs = batch if mode == "decode" else 1
    t = tokens
    if mode == "decode":
        positions = torch.full((t,), context - 1, dtype=torch.int64)
        token_to_req = torch.arange(t, dtype=torch.int32)
    else:
        positions = torch.arange(context - t, context, dtype=torch.int64)
        token_to_req = torch.zeros(t, dtype=torch.int32)
    positions, token_to_req = positions.to(device), token_to_req.to(device)
    w = cfg.window
    h, hp = cfg.local_heads, cfg.padded_heads

    # SWA block table: columns for every logical block, physical blocks only where the
    # window of some token lies (vLLM frees the rest; -1 = not mapped).
    cols = -(-context // SWA_BLOCK)
    first_pos = max(0, context - t - w + 1)
    first_col = first_pos // SWA_BLOCK
    live = cols - first_col
    live_table, swa_blocks = _shuffled_table(reqs, live, gen, torch.device("cpu"))
    swa_table = torch.full((reqs, cols), -1, dtype=torch.int32)
    swa_table[:, first_col:] = live_table
    swa_table = swa_table.to(device)
    pos_cpu = positions.cpu()
    req_cpu = token_to_req.cpu().long()
    swa_slot_mapping = (
        swa_table.cpu().long()[req_cpu, pos_cpu // SWA_BLOCK] * SWA_BLOCK + pos_cpu % SWA_BLOCK
    ).to(device)
    window_indices = torch.empty(t, w, dtype=torch.int32, device=device)
    window_lens = torch.empty(t, dtype=torch.int32, device=device)
    slot_ops.window_slots(
        window_indices, window_lens, positions=positions, token_to_req=token_to_req,
        block_table=swa_table, block_size=SWA_BLOCK,
        arange=torch.arange(w, dtype=torch.int32, device=device),
    )
    # The window the attention reads must hold real entries (the step's own insert writes
    # the newest token; every earlier window position is filled here).
    swa_fill = window_indices[window_indices >= 0].long().unique()

    cos_sin = _cos_sin_cache(context, device)
    layers: list[_Layer] = []
    run_indexer = any(r == 4 for r in cfg.layers) and context // 4 > cfg.index_topk
    for i, ratio in enumerate(cfg.layers):
        swa = fp8_ds_mla.allocate_cache(swa_blocks, SWA_BLOCK, device)
        _fill_main(swa, swa_fill, dgen)
        sink = _randn(dgen, hp)
        sink[h:] = -math.inf
        layer = _Layer(
            name=f"layers.{i}.attn", ratio=ratio,
            q_raw=_randn(dgen, t, h, HEAD_DIM, dtype=torch.bfloat16),
            kv=_randn(dgen, t, HEAD_DIM, scale=1 / 3, dtype=torch.bfloat16),
            swa_cache=swa, attn_sink=sink,
        )
        if ratio > 1:
            epb = KERNEL_BLOCK // ratio
            n_ent = context // ratio
            mb = max(1, -(-n_ent // epb))
            table, nblocks = _shuffled_table(reqs, mb, gen, device)
            comp = fp8_ds_mla.allocate_cache(nblocks, epb, device)
            if n_ent:
                _fill_main(comp, _table_slots(table, n_ent, epb), dgen)
            layer.comp_cache, layer.comp_table, layer.entries_per_block = comp, table, epb
            if ratio == 128:
                width = -(-max(context // 128, 1) // C128_ALIGN) * C128_ALIGN
                layer.c128_indices = torch.empty(t, width, dtype=torch.int32, device=device)
                layer.c128_lens = torch.empty(t, dtype=torch.int32, device=device)
                slot_ops.all_visible_compressed_slots(
                    layer.c128_indices, layer.c128_lens, positions=positions,
                    token_to_req=token_to_req, block_table=table, block_size=epb,
                    compress_ratio=128,
                    arange=torch.arange(width, dtype=torch.int32, device=device),
                )
            if ratio == 4:
                mbi = max(1, -(-n_ent // INDEXER_BLOCK))
                itable, inb = _shuffled_table(reqs, mbi, gen, device)
                icache = torch.zeros(inb, INDEXER_BLOCK, ic.entry_bytes(cfg.indexer_kv_dtype),
                                     dtype=torch.uint8, device=device)
                if n_ent:
                    _fill_indexer(icache, _table_slots(itable, n_ent, INDEXER_BLOCK),
                                  cfg.indexer_kv_dtype, dgen)
                layer.idx_cache, layer.idx_table = icache, itable
                layer.idx_q_raw = _randn(dgen, t, 64, ic.HEAD_DIM, dtype=torch.bfloat16)
                layer.idx_weights = _randn(dgen, t, 64)
        layers.append(layer)
    return Case(
        mode=mode, batch=batch, tokens=t, context=context, device=device,
        positions=positions, token_to_req=token_to_req, swa_slot_mapping=swa_slot_mapping,
        window_indices=window_indices, window_lens=window_lens, cos_sin=cos_sin,
        topk_arange=torch.arange(cfg.index_topk, dtype=torch.int32, device=device),
        minus_one=torch.tensor(-1, dtype=torch.int32, device=device),
        layers=layers, run_indexer=run_indexer, max_compressed=context // 4,
    )


def floor_bytes(cfg: BenchConfig, case: Case) -> int:
    """Bytes one step must read at least (the issue's bandwidth floor), all layers:
    per token, its window and selected compressed entries of 584 B each, plus, on C4 layers
    whose indexer runs, every visible indexer key. Prefill counts per-token reads too (a
    sparse kernel with cross-token reuse can beat it: achieved GB/s may exceed the device's)."""
    pos = case.positions.cpu()
    win = torch.clamp(pos + 1, max=cfg.window)
    total = 0
    ie = ic.entry_bytes(cfg.indexer_kv_dtype)
    for layer in case.layers:
        if layer.ratio <= 1:
            comp = torch.zeros_like(pos)
            idx = 0
        elif layer.ratio == 4:
            vis = torch.div(pos + 1, 4, rounding_mode="floor")
            comp = torch.clamp(vis, max=cfg.index_topk)
            idx = int(vis.sum()) * ie if case.run_indexer else 0
        else:
            comp = torch.div(pos + 1, layer.ratio, rounding_mode="floor")
            idx = 0
        total += int((win + comp).sum()) * ENTRY_BYTES + idx
    return total


# ---------------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------------
def make_manager(cfg: BenchConfig, policy: str, mnbt: int, device: torch.device
                 ) -> WorkspaceManager:
    """The model's workspace for ``policy``, sized like the layer does (q + attention output,
    indexer q, top-k; ``max_num_batched_tokens`` rows) and reserved now (model load)."""
    hf = dict(DSV4_FLASH_HF_CONFIG)
    hf.update(num_hidden_layers=len(cfg.layers), compress_ratios=list(cfg.layers),
              num_attention_heads=cfg.num_heads, index_topk=cfg.index_topk)
    wcfg = WorkspaceConfig.from_hf_config(
        hf, max_num_batched_tokens=mnbt, tp_size=cfg.tp,
        indexer_kv_dtype=cfg.indexer_kv_dtype, padded_heads=cfg.padded_heads,
        include_attn_out=True,
    )
    layers = [(f"layers.{i}.attn", r) for i, r in enumerate(cfg.layers)]
    mgr = WorkspaceManager(wcfg, layers, policy=policy, device=device, debug=False)
    mgr.reserve()
    return mgr


def run_step(cfg: BenchConfig, case: Case, mgr: WorkspaceManager, probe: _StepProbe) -> None:
    """One step of the eager region over every layer of ``case`` (see the module docstring)."""
    t = case.tokens
    fp4 = cfg.indexer_kv_dtype == "mxfp4"
    scale = HEAD_DIM**-0.5
    for layer in case.layers:
        q_lease = mgr.lease(layer.name, "q", t)
        try:
            with probe.kernel("rope"):
                rope_ops.qnorm_rope_kv_insert(
                    layer.q_raw, layer.kv, case.positions, layer.swa_cache,
                    case.swa_slot_mapping, case.cos_sin, RMS_EPS, out_q=q_lease["q"],
                )
            extra_cache = extra_idx = extra_lens = None
            topk_lease = None
            try:
                if layer.ratio == 4:
                    iq = None
                    iq_lease = None
                    if case.run_indexer:
                        iq_lease = mgr.lease(layer.name, "indexer_q", t)
                        with probe.kernel("indexer_q"):
                            iq = indexer_ops.indexer_q_rope_quant(
                                layer.idx_q_raw, case.positions, case.cos_sin,
                                layer.idx_weights, softmax_scale=ic.HEAD_DIM**-0.5,
                                head_scale=layer.idx_q_raw.shape[1]**-0.5,
                                dtype=cfg.indexer_kv_dtype,
                                out=(iq_lease["q"], iq_lease["scales"] if fp4 else None,
                                     iq_lease["weights"]),
                            )
                    topk_lease = mgr.lease(layer.name, "topk", t)
                    try:
                        with probe.kernel("topk"):
                            eager.select_topk_c4(
                                positions=case.positions, token_to_req=case.token_to_req,
                                compressed_block_table=layer.comp_table,
                                entries_per_block=layer.entries_per_block,
                                index_topk=cfg.index_topk,
                                out_local=topk_lease["local"], out_global=topk_lease["global"],
                                out_lens=topk_lease["lens"], arange=case.topk_arange,
                                minus_one=case.minus_one,
                                index_q=None if iq is None else iq.q,
                                index_q_scale=None if iq is None else iq.q_scale,
                                index_weights=None if iq is None else iq.weights,
                                indexer_k_cache=layer.idx_cache,
                                indexer_block_table=layer.idx_table,
                                indexer_kv_dtype=cfg.indexer_kv_dtype,
                                max_compressed=case.max_compressed,
                            )
                    finally:
                        if iq_lease is not None:
                            iq_lease.release()
                    extra_cache = layer.comp_cache
                    extra_idx, extra_lens = topk_lease["global"], topk_lease["lens"]
                elif layer.ratio > 1:
                    extra_cache = layer.comp_cache
                    extra_idx, extra_lens = layer.c128_indices, layer.c128_lens
                with probe.kernel("attend"):
                    eager.attend(
                        q_lease["q"], layer.swa_cache, case.window_indices, case.window_lens,
                        layer.attn_sink, scale, q_lease["out"], extra_cache, extra_idx,
                        extra_lens,
                    )
            finally:
                if topk_lease is not None:
                    topk_lease.release()
        finally:
            q_lease.release()


@dataclasses.dataclass
class _Samples:
    times: list[float] = dataclasses.field(default_factory=list)
    phases: list[dict[str, float]] = dataclasses.field(default_factory=list)
    counted: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    leases: int = 0
    workspace_allocs: int = 0


def _timed_step(cfg: BenchConfig, case: Case, mgr: WorkspaceManager, s: _Samples) -> None:
    dev = case.device
    probe = _StepProbe(dev, count=False)
    _sync(dev)
    mgr.begin_step()
    t0 = time.perf_counter()
    run_step(cfg, case, mgr, probe)
    _sync(dev)
    dt = time.perf_counter() - t0
    mgr.end_step()
    ph = probe.phase_seconds()
    ph["glue"] = max(0.0, dt - sum(ph.values()))
    s.times.append(dt)
    s.phases.append(ph)
    st = mgr.stats()
    s.leases = st["leases_last_step"]
    s.workspace_allocs = st["allocations_last_step"]


def _counted_step(cfg: BenchConfig, case: Case, mgr: WorkspaceManager, s: _Samples) -> None:
    """An untimed step under the allocation counters (dispatch-mode overhead)."""
    dev = case.device
    cuda_dev = dev if dev.type == "cuda" else None
    probe = _StepProbe(dev, count=True)
    _sync(dev)
    if cuda_dev is not None:
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    mgr.begin_step()
    with _TrackingCounter(cuda_dev) as total:
        run_step(cfg, case, mgr, probe)
        _sync(dev)
    mgr.end_step()
    rec = {
        "total": total.count,
        "total_bytes": total.nbytes,
        "kernel": probe.kernel_allocs,
        "kernel_bytes": probe.kernel_bytes,
        "peak_live": total.peak_live_bytes,
        "allocator": total.allocator_count,
        "cuda_peak": (torch.cuda.max_memory_allocated(dev) - base) if cuda_dev is not None
        else None,
    }
    s.counted.append(rec)


# ---------------------------------------------------------------------------------------------
# peer: attention alone, our torch path vs vLLM's C++ CPU kernel
# ---------------------------------------------------------------------------------------------
def peer_status(device: torch.device) -> tuple[bool, str]:
    """Whether vLLM's ``flash_mla_with_kvcache_cpu`` can run here, and why not. A torch
    fallback registered by the plugin (``vllm_compat.cpu_ops``) is not the peer."""
    if device.type != "cpu":
        return False, f"the peer is vLLM's CPU kernel; this run is on {device.type}"
    ok, why = vllm_cpu.load()
    if not ok:
        return False, why
    cpu_ops = sys.modules.get("vllm_dsv4_backend.vllm_compat.cpu_ops")
    if cpu_ops is not None and cpu_ops.is_fallback(PEER_OP):
        return False, (f"torch.ops._C.{PEER_OP} is the plugin's torch fallback (this vLLM "
                       "library lacks the C++ kernel), not vLLM's kernel")
    return True, why


def _attention_fns(cfg: BenchConfig, case: Case, layer: _Layer, peer: bool
                   ) -> tuple[dict[str, Callable[[], object]], torch.Tensor, torch.Tensor]:
    """Attention-only callables on one C4 layer with this case's real top-k: ``ours`` (the
    torch path through ``eager.attend``) and, if ``peer``, vLLM's C++ kernel on the same
    bytes (int64 slot tables with -1 padding prepared once, as vLLM's layer passes them)."""
    t, hp = case.tokens, cfg.padded_heads
    dev = case.device
    q = torch.empty(t, hp, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    rope_ops.qnorm_rope_kv_insert(layer.q_raw, layer.kv, case.positions, layer.swa_cache,
                                  case.swa_slot_mapping, case.cos_sin, RMS_EPS, out_q=q)
    k = cfg.index_topk
    local = torch.empty(t, k, dtype=torch.int32, device=dev)
    glob = torch.empty_like(local)
    lens = torch.empty(t, dtype=torch.int32, device=dev)
    iq = None
    if case.run_indexer:
        iq = indexer_ops.indexer_q_rope_quant(
            layer.idx_q_raw, case.positions, case.cos_sin, layer.idx_weights,
            softmax_scale=ic.HEAD_DIM**-0.5, head_scale=layer.idx_q_raw.shape[1]**-0.5,
            dtype=cfg.indexer_kv_dtype)
    eager.select_topk_c4(
        positions=case.positions, token_to_req=case.token_to_req,
        compressed_block_table=layer.comp_table, entries_per_block=layer.entries_per_block,
        index_topk=k, out_local=local, out_global=glob, out_lens=lens,
        arange=case.topk_arange, minus_one=case.minus_one,
        index_q=None if iq is None else iq.q, index_q_scale=None if iq is None else iq.q_scale,
        index_weights=None if iq is None else iq.weights, indexer_k_cache=layer.idx_cache,
        indexer_block_table=layer.idx_table, indexer_kv_dtype=cfg.indexer_kv_dtype,
        max_compressed=case.max_compressed,
    )
    out_ours = torch.empty_like(q)
    out_peer = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    def ours() -> object:
        eager.attend(q, layer.swa_cache, case.window_indices, case.window_lens,
                     layer.attn_sink, scale, out_ours, layer.comp_cache, glob, lens,
                     kernel="torch")
        return None

    fns: dict[str, Callable[[], object]] = {"ours": ours}
    if peer:
        lay_w = fp8_ds_mla.cache_layout(layer.swa_cache)
        lay_c = fp8_ds_mla.cache_layout(layer.comp_cache)
        w2d = torch.as_strided(layer.swa_cache, (lay_w.num_blocks, ENTRY_BYTES * SWA_BLOCK),
                               (lay_w.stride0, 1))
        c2d = torch.as_strided(layer.comp_cache,
                               (lay_c.num_blocks, ENTRY_BYTES * layer.entries_per_block),
                               (lay_c.stride0, 1))
        wslots = case.window_indices.to(torch.int64).contiguous()
        cslots = glob.to(torch.int64).contiguous()
        op = getattr(torch.ops._C, PEER_OP)

        def peer_fn() -> object:
            return op(out_peer, q, w2d, wslots, SWA_BLOCK, c2d, cslots,
                      layer.entries_per_block, layer.attn_sink, scale)

        fns["peer"] = peer_fn
    fns["gemm_floor"] = gemm_floor_fn(t, hp, int(case.window_lens.max()) + int(lens.max()), dev)
    return fns, out_ours, out_peer


def _interleaved_times(fns: Mapping[str, Callable[[], object]], reps: int,
                       min_s: float) -> dict[str, float]:
    """Median seconds per call, repetitions interleaved across ``fns``."""
    for f in fns.values():
        f()
    inner = {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        f()
        inner[name] = max(1, int(min_s / max(time.perf_counter() - t0, 1e-6)))
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner[name]):
                f()
            samples[name].append((time.perf_counter() - t0) / inner[name])
    return {n: statistics.median(v) for n, v in samples.items()}


def peer_row(cfg: BenchConfig, case: Case, peer_ok: bool, reps: int = 5,
             min_s: float = 0.05) -> dict[str, Any] | None:
    """Attention-only decode figures of the first C4 layer of a decode case."""
    layer = next((x for x in case.layers if x.ratio == 4), None)
    if layer is None or case.mode != "decode":
        return None
    fns, out_ours, out_peer = _attention_fns(cfg, case, layer, peer_ok)
    t = _interleaved_times(fns, reps, min_s)
    entries = cfg.window + min(cfg.index_topk, case.context // 4)
    row: dict[str, Any] = {
        "batch": case.batch, "context": case.context, "entries": entries,
        "ours_ms": t["ours"] * 1e3, "ours_tok_per_s": case.tokens / t["ours"],
        "peer_ms": None, "peer_tok_per_s": None, "ours_over_peer": None, "max_abs_diff": None,
        "gemm_floor_ms": t["gemm_floor"] * 1e3,
        "gemm_floor_tok_per_s": case.tokens / t["gemm_floor"],
        "ours_over_gemm_floor": t["ours"] / t["gemm_floor"],
    }
    if "peer" in t:
        row["peer_ms"] = t["peer"] * 1e3
        row["peer_tok_per_s"] = case.tokens / t["peer"]
        row["ours_over_peer"] = t["ours"] / t["peer"]
        row["max_abs_diff"] = float((out_ours.float() - out_peer.float()).abs().max())
    return row


# ---------------------------------------------------------------------------------------------
# one case, all policies side by side
# ---------------------------------------------------------------------------------------------
ProgressFn = Callable[[int, str], None]


def _auto_steps(cfg: BenchConfig, est_s: float) -> int:
    if cfg.steps is not None:
        return cfg.steps
    n = int(cfg.target_s / max(est_s, 1e-6))
    return max(cfg.min_steps, min(cfg.max_steps, n))


def bench_case(cfg: BenchConfig, case: Case, managers: Mapping[str, WorkspaceManager],
               floor: int, copy_gbps: float, progress: ProgressFn | None = None,
               rng: random.Random | None = None) -> tuple[list[dict[str, Any]],
                                                          list[dict[str, Any]]]:
    """Run every policy on ``case``, steps interleaved round-robin in a shuffled order.

    Returns ``(records, comparisons)``: one record per policy (``CASE_KEYS``) and, for each
    policy other than ``off``, its ratio to ``off`` (``COMPARISON_KEYS``).
    """
    rng = rng or random.Random(0)
    pols = list(managers)
    samples = {p: _Samples() for p in pols}
    label = f"{case.mode} b={case.batch} T={case.tokens} ctx={case.context}"
    for _ in range(cfg.warmup):
        for p in pols:
            _timed_step(cfg, case, managers[p], _Samples())
        if progress:
            progress(len(pols), f"{label} warm-up")
    est = 0.0
    for p in pols:
        t0 = time.perf_counter()
        _timed_step(cfg, case, managers[p], samples[p])
        est = max(est, time.perf_counter() - t0)
    steps = _auto_steps(cfg, est)
    paired: dict[str, list[float]] = {p: [] for p in pols}
    for i in range(steps - 1):
        order = pols[:]
        rng.shuffle(order)
        for p in order:
            _timed_step(cfg, case, managers[p], samples[p])
        if "off" in samples:
            base = samples["off"].times[-1]
            for p in pols:
                paired[p].append(samples[p].times[-1] / base)
        if progress and (i % 4 == 3 or i == steps - 2):
            progress(0, f"{label} step {i + 2}/{steps}")
    for _ in range(cfg.count_steps):
        for p in pols:
            _counted_step(cfg, case, managers[p], samples[p])
    if progress:
        progress(len(pols), f"{label} counted")

    records = []
    n_layers = len(case.layers)
    for p in pols:
        s = samples[p]
        p50 = _percentile(s.times, 50)
        c = s.counted[-1] if s.counted else None
        ws = managers[p].stats()["reserved_bytes_total"]
        glue = (c["total"] - c["kernel"]) if c else None
        glue_bytes = (c["total_bytes"] - c["kernel_bytes"]) if c else None
        achieved = floor / p50 / 1e9
        records.append({
            "mode": case.mode, "policy": p, "batch": case.batch, "tokens": case.tokens,
            "context": case.context, "num_layers": n_layers, "indexer": case.run_indexer,
            "steps": len(s.times),
            "p50_ms": p50 * 1e3, "p99_ms": _percentile(s.times, 99) * 1e3,
            "mean_ms": statistics.fmean(s.times) * 1e3, "min_ms": min(s.times) * 1e3,
            "p50_ms_per_layer": p50 * 1e3 / n_layers,
            "tokens_per_s": case.tokens / p50,
            "allocs_per_step": glue,
            "alloc_bytes_per_step": glue_bytes,
            "workspace_allocs_per_step": s.workspace_allocs,
            "kernel_allocs_per_step": c["kernel"] if c else None,
            "total_allocs_per_step": c["total"] if c else None,
            "allocator_requests_per_step": c["allocator"] if c else None,
            "leases_per_step": s.leases,
            "workspace_bytes": ws,
            "peak_transient_bytes": c["peak_live"] if c else None,
            "peak_bytes": ws + (c["peak_live"] if c else 0),
            "cuda_peak_step_bytes": c["cuda_peak"] if c else None,
            "floor_bytes": floor,
            "achieved_GBps": achieved,
            "floor_ms": floor / (copy_gbps * 1e9) * 1e3,
            "bw_fraction": achieved / copy_gbps,
            "phase_ms": {k: statistics.median(ph[k] for ph in s.phases) * 1e3
                         for k in PHASES},
        })
    comps = []
    if "off" in samples:
        off_rec = next(r for r in records if r["policy"] == "off")
        for r in records:
            if r["policy"] == "off":
                continue
            pr = paired[r["policy"]]
            comps.append({
                "mode": case.mode, "batch": case.batch, "tokens": case.tokens,
                "context": case.context, "policy": r["policy"], "baseline": "off",
                "p50_ratio": r["p50_ms"] / off_rec["p50_ms"],
                "paired_ratio_median": statistics.median(pr) if pr else None,
                "paired_ratio_q1": _percentile(pr, 25) if pr else None,
                "paired_ratio_q3": _percentile(pr, 75) if pr else None,
                "allocs_per_step": r["allocs_per_step"],
                "baseline_allocs_per_step": off_rec["allocs_per_step"],
            })
    return records, comps


# ---------------------------------------------------------------------------------------------
# the whole run
# ---------------------------------------------------------------------------------------------
def _vllm_version() -> str | None:
    """vLLM's version from package metadata (never imports vLLM)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _loadavg() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def estimate_units(cfg: BenchConfig) -> int:
    """Progress units of :func:`run` (one per warm-up round and counted round per policy)."""
    per_case = (cfg.warmup + 1) * len(cfg.policies)
    return len(cfg.cases()) * per_case


def run(cfg: BenchConfig, *, threads: int | None = None, argv: Sequence[str] | None = None,
        progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run every case of ``cfg``; returns the JSON-ready result (keys: ``RESULT_KEYS``).

    ``threads`` sets torch's CPU threads for the run (restored afterwards)."""
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(cfg, argv, progress)
    finally:
        torch.set_num_threads(old_threads)


def _run(cfg: BenchConfig, argv: Sequence[str] | None, progress: ProgressFn | None
         ) -> dict[str, Any]:
    started = time.time()
    dev = resolve_device(cfg.device)
    load0 = _loadavg()
    cases = cfg.cases()
    mnbt = cfg.max_num_batched_tokens or max(t for _, _, t, _ in cases)
    copy_gbps = measure_copy_bandwidth(dev, cfg.probe_bytes)
    managers = {p: make_manager(cfg, p, mnbt, dev) for p in cfg.policies}
    peer_ok, peer_why = peer_status(dev) if cfg.peer else (False, "disabled (--no-peer)")
    records: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    peer_rows: list[dict[str, Any]] = []
    rng = random.Random(cfg.seed)
    skipped: list[dict[str, Any]] = []
    for i, (mode, batch, tokens, context) in enumerate(cases):
        if cfg.time_budget_s is not None and time.time() - started > cfg.time_budget_s:
            skipped.append({"mode": mode, "batch": batch, "tokens": tokens,
                            "context": context})
            continue
        case = build_case(cfg, mode, batch, tokens, context, dev, cfg.seed + i)
        floor = floor_bytes(cfg, case)
        recs, comps = bench_case(cfg, case, managers, floor, copy_gbps, progress, rng)
        records += recs
        comparisons += comps
        if cfg.peer and dev.type == "cpu" and mode == "decode":
            row = peer_row(cfg, case, peer_ok)
            if row is not None:
                peer_rows.append(row)
        del case
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    quoted_rows = []
    if not peer_ok:
        # Reference figures from another run (the issue's): same shapes only.
        for b, tok_s in sorted(QUOTED_PEER_TOK_S.items()):
            rows = [r for r in peer_rows if r["batch"] == b
                    and r["entries"] == QUOTED_PEER_ENTRIES]
            if not rows:
                continue
            r = max(rows, key=lambda x: x["context"])
            quoted_rows.append({
                "batch": b, "context": r["context"], "entries": r["entries"],
                "ours_tok_per_s": r["ours_tok_per_s"], "quoted_tok_per_s": tok_s,
                "ours_over_quoted": tok_s / r["ours_tok_per_s"],
                "gemm_floor_tok_per_s": r["gemm_floor_tok_per_s"],
                # Any fp32 path here is at best the GEMM floor: within 3x of the quoted
                # figure is reachable only if the floor itself is.
                "three_x_reachable": 3 * r["gemm_floor_tok_per_s"] >= tok_s,
            })
    peer = {
        "available": peer_ok, "reason": peer_why, "kernel": f"torch.ops._C.{PEER_OP}",
        "rows": peer_rows, "quoted": {str(k): v for k, v in QUOTED_PEER_TOK_S.items()},
        "quoted_rows": quoted_rows,
    }
    meta = _meta(cfg, dev, argv, started, load0, mnbt, copy_gbps)
    meta["skipped_cases"] = skipped
    result = {
        "schema": SCHEMA, "meta": meta, "cases": records, "comparisons": comparisons,
        "peer": peer, "e2e": None, "summary": summarize(records, comparisons, peer),
    }
    meta["duration_s"] = time.time() - started
    return result


def _meta(cfg: BenchConfig, dev: torch.device, argv: Sequence[str] | None, started: float,
          load0: float | None, mnbt: int | None, copy_gbps: float | None) -> dict[str, Any]:
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine()
    return {
        "argv": list(argv) if argv is not None else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": None,
        "device": str(dev), "device_name": name, "torch": torch.__version__,
        "python": platform.python_version(), "vllm": _vllm_version(),
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "load_avg_start": load0, "load_avg_end": _loadavg(),
        "kernel_path": ops.kernel_path(dev, "decode", need_lse=False),
        "indexer_kv_dtype": cfg.indexer_kv_dtype, "tp": cfg.tp, "num_heads": cfg.num_heads,
        "local_heads": cfg.local_heads, "padded_heads": cfg.padded_heads,
        "head_dim": HEAD_DIM, "window": cfg.window, "index_topk": cfg.index_topk,
        "layers": list(cfg.layers),
        "layer_kinds": [{0: "swa", 1: "swa", 4: "c4", 128: "c128"}[r] for r in cfg.layers],
        "max_num_batched_tokens": mnbt, "device_copy_GBps": copy_gbps,
        "steps": cfg.steps, "warmup": cfg.warmup, "seed": cfg.seed,
        "time_budget_s": cfg.time_budget_s, "skipped_cases": [],
    }


def empty_result(cfg: BenchConfig, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """A result without layer cases (``--e2e-only``): same keys, empty lists."""
    started = time.time()
    dev = resolve_device(cfg.device)
    peer = {"available": False, "reason": "not run", "kernel": f"torch.ops._C.{PEER_OP}",
            "rows": [], "quoted": {str(k): v for k, v in QUOTED_PEER_TOK_S.items()},
            "quoted_rows": []}
    return {
        "schema": SCHEMA, "meta": _meta(cfg, dev, argv, started, _loadavg(), None, None),
        "cases": [], "comparisons": [], "peer": peer, "e2e": None,
        "summary": summarize([], [], peer),
    }
