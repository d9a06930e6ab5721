# SPDX-License-Identifier: Apache-2.0
"""A small DeepSeek-V4 C4-layer world for the batch-invariance tests (torch only).

``tests/core/test_batch_invariance.py`` runs it on the plugin's torch ops,
``tests/vllm/test_batch_invariance_kernels.py`` on vLLM's real C++ kernels (tests/core
imports it too, so this module stays torch-only).

A :class:`World` holds a few requests, each with a *prefix* already in the
caches and *work* positions still to run, plus every cache one C4 layer
touches: the SWA ``fp8_ds_mla`` cache, the compressed (C4) ``fp8_ds_mla``
cache, the lightning-indexer K cache (FP8 132 B or MXFP4 68 B entries) and the
two compressor state caches. Every byte no request owns is poisoned (0xFF:
NaN in e4m3 / bf16 / fp32), so a read outside the valid region shows up as
NaN in an output.

:func:`run_step` is one eager step of the layer, in vLLM's CPU order: q-norm +
RoPE + SWA insert, indexer q RoPE + quant, both compressors (state save,
compress, store), indexer logits + causal top-k, window slots, sparse MLA.
Which implementation runs each op is a :class:`StepOps` (torch ops here; the
tests/vllm file passes vLLM's ``torch.ops._C`` kernels). A *schedule* is a list
of steps, each a list of ``(request, position)`` tokens in batch order;
:func:`run_schedule` runs one on a fresh copy of the world and returns every
token's outputs and the final cache bytes, so two schedules of the same work
can be compared bit for bit. :data:`REQUESTS` and :data:`SCHEDULES` are the work
and the schedules both test files run.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from vllm_dsv4_backend import eager
from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.formats import indexer_cache as ic
from vllm_dsv4_backend.ops import compressor as comp_ops
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.ops import rope, slots, torch_sparse_mla

H = 8  # q heads (the tiny model's, unpadded on CPU)
HI = 64  # indexer heads
D = 512
ID = 128
WINDOW = 128
TOPK = 512
RATIO = 4
SWA_BS = 64  # tokens per SWA block
COMP_BS = 64  # C4 entries per compressed block (256 tokens / 4)
IND_BS = 64  # C4 entries per indexer block
STATE_BS = 16  # tokens per compressor-state block
EPS = 1e-6
SCALE = D**-0.5
POISON = 0xFF
MAX_POS = 4096


def cos_sin_cache(max_pos: int = MAX_POS, rope_dim: int = 64, theta: float = 160000.0):
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(torch.float32).contiguous()


@dataclass
class Request:
    prefix: int  # positions 0 .. prefix-1 are in the caches
    work: int  # positions prefix .. prefix+work-1 still to run

    @property
    def length(self) -> int:
        return self.prefix + self.work


@dataclass
class World:
    requests: list[Request]
    indexer_dtype: str
    # caches (3-D views; *_raw are the allocations behind them)
    swa: torch.Tensor
    comp: torch.Tensor
    ind: torch.Tensor
    ind_state: torch.Tensor
    main_state: torch.Tensor
    # block tables [R, max_blocks] int32 (-1 = no block)
    swa_bt: torch.Tensor
    comp_bt: torch.Tensor
    ind_bt: torch.Tensor
    state_bt: torch.Tensor
    # per request, per work position: raw layer inputs
    q_raw: list[torch.Tensor]  # [work, H, 512] bf16
    kv_raw: list[torch.Tensor]  # [work, 512] bf16
    iq_raw: list[torch.Tensor]  # [work, HI, 128] bf16
    iw_raw: list[torch.Tensor]  # [work, HI] bf16
    ikv: list[torch.Tensor]  # [work, 256] f32 (indexer compressor kv, coff 2)
    iscore: list[torch.Tensor]
    mkv: list[torch.Tensor]  # [work, 1024] f32 (main compressor kv, coff 2)
    mscore: list[torch.Tensor]
    # shared parameters
    cos_sin: torch.Tensor
    sink: torch.Tensor
    iape: torch.Tensor
    mape: torch.Tensor
    irms: torch.Tensor
    mrms: torch.Tensor

    def clone(self) -> World:
        return copy.deepcopy(self)

    def cache_bytes(self) -> dict[str, torch.Tensor]:
        """Every byte of every cache (the allocations, padding included)."""
        out = {}
        for name in ("swa", "comp", "ind", "ind_state", "main_state"):
            t = getattr(self, name)
            out[name] = _storage_bytes(t)
        return out


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def _table(gen: torch.Generator, blocks_per_req: list[int], first_col: list[int]):
    """Block tables over a shuffled pool; block 0 of the pool is never assigned (poison)."""
    total = sum(n - f for n, f in zip(blocks_per_req, first_col))
    perm = torch.randperm(total, generator=gen) + 1
    width = max(blocks_per_req)
    bt = torch.full((len(blocks_per_req), width), -1, dtype=torch.int32)
    k = 0
    for r, (n, f) in enumerate(zip(blocks_per_req, first_col)):
        bt[r, f:n] = perm[k : k + n - f].to(torch.int32)
        k += n - f
    return bt, total + 2  # one spare poisoned block at each end


def _slot(bt: torch.Tensor, req: torch.Tensor, idx: torch.Tensor, bs: int) -> torch.Tensor:
    blk = bt[req, idx // bs].long()
    return torch.where(blk >= 0, blk * bs + idx % bs, torch.full_like(blk, -1))


def make_world(reqs: list[tuple[int, int]], indexer_dtype: str, seed: int) -> World:
    """Requests ``(prefix, work)``; prefix entries are written directly by the format
    writers (SWA window, compressed and indexer entries, the compressor states of the
    last 8 prefix positions); everything else in the caches is poison."""
    gen = torch.Generator().manual_seed(seed)
    rq = [Request(p, w) for p, w in reqs]
    lens = [r.length for r in rq]
    n_ent = [max(1, L // RATIO) for L in lens]
    swa_bt, swa_nb = _table(gen, [math.ceil(L / SWA_BS) for L in lens], [0] * len(rq))
    comp_bt, comp_nb = _table(gen, [math.ceil(n / COMP_BS) for n in n_ent], [0] * len(rq))
    ind_bt, ind_nb = _table(gen, [math.ceil(n / IND_BS) for n in n_ent], [0] * len(rq))
    st_first = [max(0, r.prefix - 8) // STATE_BS for r in rq]
    state_bt, st_nb = _table(gen, [math.ceil(L / STATE_BS) for L in lens], st_first)

    swa = fp8_ds_mla.allocate_cache(swa_nb, SWA_BS, fill=POISON)
    comp = fp8_ds_mla.allocate_cache(comp_nb, COMP_BS, fill=POISON)
    eb = ic.entry_bytes(indexer_dtype)
    ind = torch.full((ind_nb, IND_BS, eb), POISON, dtype=torch.uint8)
    ind_state = torch.full((st_nb, STATE_BS, 2 * 2 * ID), float("nan"))
    main_state = torch.full((st_nb, STATE_BS, 2 * 2 * D), float("nan"))

    cs = cos_sin_cache()
    iape = 0.5 * torch.randn(RATIO, 2 * ID, generator=gen)
    mape = 0.5 * torch.randn(RATIO, 2 * D, generator=gen)
    w = World(
        requests=rq, indexer_dtype=indexer_dtype, swa=swa, comp=comp, ind=ind,
        ind_state=ind_state, main_state=main_state, swa_bt=swa_bt, comp_bt=comp_bt,
        ind_bt=ind_bt, state_bt=state_bt, q_raw=[], kv_raw=[], iq_raw=[], iw_raw=[], ikv=[],
        iscore=[], mkv=[], mscore=[], cos_sin=cs, sink=torch.randn(H, generator=gen),
        iape=iape, mape=mape, irms=1.0 + 0.1 * torch.randn(ID, generator=gen),
        mrms=1.0 + 0.1 * torch.randn(D, generator=gen),
    )
    for r, req in enumerate(rq):
        rr = torch.tensor([r])
        # SWA entries of the prefix window (earlier positions stay poison: never read).
        p = torch.arange(max(0, req.prefix - WINDOW), req.prefix)
        kv = (torch.randn(p.numel(), D, generator=gen) * 0.7).to(torch.bfloat16)
        fp8_ds_mla.quantize_and_insert(kv, swa, _slot(swa_bt, rr.expand_as(p), p, SWA_BS))
        # Compressed + indexer entries emitted by the prefix.
        j = torch.arange(req.prefix // RATIO)
        ck = (torch.randn(j.numel(), D, generator=gen) * 0.7).to(torch.bfloat16)
        fp8_ds_mla.quantize_and_insert(ck, comp, _slot(comp_bt, rr.expand_as(j), j, COMP_BS))
        ik = torch.randn(j.numel(), ID, generator=gen).to(torch.bfloat16)
        ic.quantize_and_insert(ik, ind, _slot(ind_bt, rr.expand_as(j), j, IND_BS),
                               indexer_dtype)
        # Compressor states of the last 8 prefix positions (the first windows read them).
        p = torch.arange(max(0, req.prefix - 8), req.prefix)
        st = _slot(state_bt, rr.expand_as(p), p, STATE_BS)
        comp_ops.save_partial_states(torch.randn(p.numel(), 2 * ID, generator=gen),
                                     2 * torch.randn(p.numel(), 2 * ID, generator=gen),
                                     iape, p, ind_state, st)
        comp_ops.save_partial_states(torch.randn(p.numel(), 2 * D, generator=gen),
                                     2 * torch.randn(p.numel(), 2 * D, generator=gen),
                                     mape, p, main_state, st)
        n = req.work
        w.q_raw.append(torch.randn(n, H, D, generator=gen).to(torch.bfloat16))
        w.kv_raw.append((torch.randn(n, D, generator=gen) * 0.7).to(torch.bfloat16))
        w.iq_raw.append(torch.randn(n, HI, ID, generator=gen).to(torch.bfloat16))
        w.iw_raw.append(torch.randn(n, HI, generator=gen).to(torch.bfloat16))
        w.ikv.append(torch.randn(n, 2 * ID, generator=gen))
        w.iscore.append(2 * torch.randn(n, 2 * ID, generator=gen))
        w.mkv.append(torch.randn(n, 2 * D, generator=gen))
        w.mscore.append(2 * torch.randn(n, 2 * D, generator=gen))
    return w


# ------------------------------------------------------------------------------------------
# one step
# ------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """The per-step tensors every op reads (decodes/prefills are just tokens here)."""

    positions: torch.Tensor  # [T] int64
    t2r: torch.Tensor  # [T] int64
    swa_slots: torch.Tensor  # [T] int64
    state_slots: torch.Tensor  # [T] int64
    gather: torch.Tensor  # [T, 8] int64 state slots of p-7 .. p
    ind_slots: torch.Tensor  # [T] int64 slot of entry p // 4
    comp_slots: torch.Tensor  # [T] int64
    visible: torch.Tensor  # [T] int64 (p + 1) // 4
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def make_batch(world: World, tokens: list[tuple[int, int]]) -> Batch:
    t2r = torch.tensor([r for r, _ in tokens], dtype=torch.int64)
    pos = torch.tensor([p for _, p in tokens], dtype=torch.int64)
    win = pos[:, None] - 7 + torch.arange(8)
    gather = torch.where(
        win >= 0,
        _slot(world.state_bt, t2r[:, None].expand_as(win), win.clamp(min=0), STATE_BS),
        torch.full_like(win, -1),
    )
    ent = pos // RATIO
    b = Batch(
        positions=pos,
        t2r=t2r,
        swa_slots=_slot(world.swa_bt, t2r, pos, SWA_BS),
        state_slots=_slot(world.state_bt, t2r, pos, STATE_BS),
        gather=gather,
        ind_slots=_slot(world.ind_bt, t2r, ent, IND_BS),
        comp_slots=_slot(world.comp_bt, t2r, ent, COMP_BS),
        visible=torch.div(pos + 1, RATIO, rounding_mode="floor"),
    )
    for name in ("q_raw", "kv_raw", "iq_raw", "iw_raw", "ikv", "iscore", "mkv", "mscore"):
        per_req = getattr(world, name)
        rows = [per_req[r][p - world.requests[r].prefix] for r, p in tokens]
        b.inputs[name] = torch.stack(rows) if rows else per_req[0][:0].clone()
    return b


class StepOps:
    """The plugin's torch ops."""

    name = "torch"

    def qnorm_rope_kv_insert(self, w: World, b: Batch) -> torch.Tensor:
        t = b.positions.numel()
        out = torch.empty(t, H, D, dtype=torch.bfloat16)
        return rope.qnorm_rope_kv_insert(b.inputs["q_raw"], b.inputs["kv_raw"], b.positions,
                                         w.swa, b.swa_slots, w.cos_sin, EPS, out_q=out)

    def indexer_q(self, w: World, b: Batch):
        return indexer_ops.indexer_q_rope_quant(
            b.inputs["iq_raw"], b.positions, w.cos_sin, b.inputs["iw_raw"],
            softmax_scale=ID**-0.5, head_scale=HI**-0.5, dtype=w.indexer_dtype,
        )

    def compress(self, w: World, b: Batch) -> None:
        comp_ops.save_partial_states(b.inputs["ikv"], b.inputs["iscore"], w.iape, b.positions,
                                     w.ind_state, b.state_slots)
        comp_ops.save_partial_states(b.inputs["mkv"], b.inputs["mscore"], w.mape, b.positions,
                                     w.main_state, b.state_slots)
        ind2d = w.ind.view(w.ind.shape[0], -1)
        comp_ops.compress_norm_rope_store_indexer(
            w.ind_state, b.gather, b.positions, b.ind_slots, w.irms, EPS, w.cos_sin, ind2d,
            IND_BS, RATIO, indexer_kv_dtype=w.indexer_dtype,
        )
        comp_ops.compress_norm_rope_store_main(
            w.main_state, b.gather, b.positions, b.comp_slots, w.mrms, EPS, w.cos_sin,
            fp8_ds_mla.cache_layout(w.comp).blocks_2d(w.comp), COMP_BS, RATIO,
        )

    def topk(self, w: World, b: Batch, iq) -> dict[str, torch.Tensor]:
        """eager.select_topk_c4 as the layer calls it (``max_compressed`` = the batch's
        widest visible count; the short-context rule when nothing exceeds top-k), plus the
        logits the same call computes, for the record."""
        t = b.positions.numel()
        local = torch.empty(t, TOPK, dtype=torch.int32)
        glob = torch.empty(t, TOPK, dtype=torch.int32)
        lens = torch.empty(t, dtype=torch.int32)
        widest = int(b.visible.max()) if t else 0
        use_q = widest > TOPK
        eager.select_topk_c4(
            positions=b.positions, token_to_req=b.t2r, compressed_block_table=w.comp_bt,
            entries_per_block=COMP_BS, index_topk=TOPK, out_local=local, out_global=glob,
            out_lens=lens, arange=torch.arange(TOPK, dtype=torch.int32),
            minus_one=torch.tensor(-1, dtype=torch.int32),
            index_q=iq.q if use_q else None, index_q_scale=iq.q_scale if use_q else None,
            index_weights=iq.weights if use_q else None, indexer_k_cache=w.ind,
            indexer_block_table=w.ind_bt, indexer_kv_dtype=w.indexer_dtype,
            max_compressed=widest,
        )
        res = {"local": local, "global": glob, "lens": lens}
        if use_q:
            res["logits"] = indexer_ops.indexer_logits(
                iq.q, iq.q_scale, iq.weights, w.ind, b.visible, w.ind_bt,
                dtype=w.indexer_dtype, token_to_req=b.t2r, max_seq_len=widest,
            )
        return res

    def window(self, w: World, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        t = b.positions.numel()
        idx = torch.empty(t, WINDOW, dtype=torch.int32)
        lens = torch.empty(t, dtype=torch.int32)
        slots.window_slots(idx, lens, positions=b.positions, token_to_req=b.t2r,
                           block_table=w.swa_bt, block_size=SWA_BS,
                           arange=torch.arange(WINDOW, dtype=torch.int32))
        return idx, lens

    def attend(self, w: World, b: Batch, q, win_idx, win_lens, glob, lens) -> torch.Tensor:
        """Sparse MLA of the step's tokens (one query row each) over window + C4 entries,
        as the layer calls it (no lse)."""
        out = torch.empty(q.shape[0], H, D, dtype=torch.bfloat16)
        torch_sparse_mla.sparse_mla_decode(
            q.unsqueeze(1), w.swa, win_idx.unsqueeze(1), win_lens, w.sink, SCALE, w.comp,
            glob.unsqueeze(1), lens, out=out.unsqueeze(1), need_lse=False,
        )
        return out


def run_step(world: World, tokens: list[tuple[int, int]], ops: StepOps) -> dict:
    """One eager step over ``tokens``; returns ``{(req, pos): {name: tensor row}}``."""
    b = make_batch(world, tokens)
    q = ops.qnorm_rope_kv_insert(world, b)
    iq = ops.indexer_q(world, b)
    ops.compress(world, b)
    tk = ops.topk(world, b, iq)
    win_idx, win_lens = ops.window(world, b)
    out = ops.attend(world, b, q, win_idx, win_lens, tk["global"], tk["lens"])
    res = {}
    for i, key in enumerate(tokens):
        n = int(b.visible[i])
        row = {
            "q": q[i].clone(),
            "index_q": iq.q[i].view(torch.uint8).clone(),
            "index_weights": iq.weights[i].clone(),
            "topk_local": tk["local"][i].clone(),
            "topk_global": tk["global"][i].clone(),
            "topk_lens": tk["lens"][i].clone(),
            "out": out[i].clone(),
        }
        if iq.q_scale is not None:
            row["index_q_scale"] = iq.q_scale[i].clone()
        if "logits" in tk:
            row["logits"] = tk["logits"][i, :n].clone()
        res[key] = row
    return res


def run_schedule(world: World, schedule: list[list[tuple[int, int]]], ops: StepOps):
    """Run ``schedule`` on a copy of ``world``: (per-token outputs, final cache bytes)."""
    w = world.clone()
    outs: dict = {}
    for tokens in schedule:
        outs.update(run_step(w, tokens, ops))
    return outs, w.cache_bytes()


def solo_schedule(world: World) -> list[list[tuple[int, int]]]:
    """Every token alone, each request's positions in order."""
    return [[(r, p)] for r, q in enumerate(world.requests)
            for p in range(q.prefix, q.length)]


# --- the eager step's work and schedules: decode-only, prefill-only, mixed, chunked ---
# (prefix, work): 0 = a long prefill crossing 2048 tokens (visible 511 -> 515, the short-
# context rule then the indexer), 1 = a long decode, 2 = a short decode, 3 = a fresh
# prompt (visible 0 for its first 3 tokens), 4 = a short prefill.
REQUESTS = [(2044, 16), (2200, 2), (300, 2), (0, 12), (100, 12)]


def _tok(r: int, lo: int, hi: int) -> list[tuple[int, int]]:
    return [(r, p) for p in range(lo, hi)]


SCHEDULES = {
    # decodes batched together; each prefill one chunk, alone
    "decode-only": [[(1, 2200), (2, 300)], [(2, 301), (1, 2201)], _tok(0, 2044, 2060),
                    _tok(3, 0, 12), _tok(4, 100, 112)],
    # the three prefills in one batch; decodes alone
    "prefill-only": [_tok(0, 2044, 2060) + _tok(3, 0, 12) + _tok(4, 100, 112),
                     [(1, 2200)], [(1, 2201)], [(2, 300)], [(2, 301)]],
    # decodes and prefill chunks together; every prefill split across two calls
    "mixed-chunked": [[(1, 2200), (2, 300)] + _tok(0, 2044, 2050) + _tok(3, 0, 5)
                      + _tok(4, 100, 107),
                      _tok(4, 107, 112) + [(2, 301)] + _tok(0, 2050, 2060) + _tok(3, 5, 12)
                      + [(1, 2201)]],
    # the long prefill cut at the short/long boundary (first call all <= 512 visible)
    "chunked-at-2051": [_tok(0, 2044, 2051), _tok(0, 2051, 2060) + _tok(3, 0, 12),
                        [(1, 2200), (2, 300)] + _tok(4, 100, 112),
                        [(2, 301), (1, 2201)]],
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of ``t`` as integers (NaN-safe bitwise comparison)."""
    t = t.contiguous()
    if t.dtype in (torch.float32, torch.int32):
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype in (torch.float8_e4m3fn, torch.uint8):
        return t.view(torch.uint8)
    return t


def compare(ref: dict, got: dict, label: str) -> list[str]:
    """Every (token, output) whose bits differ, with its max |diff| and max ulp distance."""
    problems = []
    assert set(ref) == set(got), (label, sorted(set(ref) ^ set(got)))
    for key in sorted(ref):
        for name, a in ref[key].items():
            b = got[key][name]
            if a.shape != b.shape or not torch.equal(bits(a), bits(b)):
                if a.shape != b.shape:
                    problems.append(f"{label} {key} {name}: shape {tuple(a.shape)} vs "
                                    f"{tuple(b.shape)}")
                    continue
                if a.dtype.is_floating_point:
                    diff = (a.float() - b.float()).abs()
                    ulp = (bits(a).long() - bits(b).long()).abs().max().item()
                    problems.append(f"{label} {key} {name}: max|diff| "
                                    f"{diff.nan_to_num(nan=math.inf).max().item():.3g}, "
                                    f"max ulp {ulp}")
                else:
                    problems.append(f"{label} {key} {name}: "
                                    f"{int((a != b).sum())} entries differ")
    return problems
