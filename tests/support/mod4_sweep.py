# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prompt-length sweep over L = 0, 1, 2, 3 (mod 4) (torch only): the world, the float64
oracles, the implementations (``EagerOps``, ``VllmConventionOps``) and :func:`sweep`.

tests/core/test_mod4_sweep.py runs it on the plugin's torch ops and fallbacks (its
docstring says what is checked and why), tests/vllm/test_mod4_sweep_vllm.py on vLLM's
real C++ kernels.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from tests.support.oracle import _softmax_with_sink, e4m3_table, quantize_ref
from vllm_dsv4_backend import eager
from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.formats import indexer_cache as ic
from vllm_dsv4_backend.ops import compressor as comp_ops
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.ops import rope, slots, torch_sparse_mla

H = 8  # q heads (the tiny model's)
HI = 64  # indexer heads
D = 512
ID = 128
ROPE = 64
WINDOW = 128
TOPK = 512
KINDS = ("swa", "c4", "c128")
RATIO = {"swa": 1, "c4": 4, "c128": 128}
SWA_BS = 64  # tokens per SWA block (256-token KV block / 4)
COMP_BS = {4: 64, 128: 2}  # compressed entries per block (256 tokens / ratio)
IND_BS = 64  # indexer entries per block
STATE_BS = 16  # tokens per compressor-state block
EPS = 1e-6
SCALE = D**-0.5
POISON = 0xFF
PREFILL_ROWS = 4  # last prefill tokens checked: every residue of p mod 4

FULL_SWEEP = os.environ.get("DSV4_FULL_SWEEP", "") not in ("", "0")


def _around(centers: Iterable[int], radius: int) -> list[int]:
    return [c + d for c in centers for d in range(-radius, radius + 1) if c + d >= 1]


# Every boundary that matters, each with its mod-4 neighbours:
#   C4 windows (multiples of 4 +- 1..3: every length has one), tiny prompts;
#   the 128-token sliding window and C128 windows (multiples of 128);
#   SWA block edges (64 tokens) and 256-token KV blocks (64 C4 / 2 C128 entries per
#   compressed block, 64 indexer entries per block);
#   511/512/513 tokens (asked for the indexer top-k) and 2048..2056 tokens, where the
#   C4 entries a token sees cross 512 (p = 2051) and the indexer's top-k takes over;
#   4096 (max_model_len of the served tiny model).
FULL_LENGTHS: list[int] = sorted(set(
    list(range(1, 13))
    + _around([64, 192, 320, 448, 576], 3)
    + _around([128, 256, 384, 512, 640, 768, 1024, 1536, 2048], 4)
    + list(range(2044, 2061))
    + _around([4096 - 4], 4)
))
FAST_LENGTHS: list[int] = [1, 2, 3, 4, 126, 127, 128, 129, 130, 131, 255, 256, 257, 258,
                           511, 512, 513, 514, 2049, 2050, 2051, 2052]
LENGTHS = FULL_LENGTHS if FULL_SWEEP else FAST_LENGTHS

# rel_l2 = ||out - oracle|| / ||oracle|| per token and layer. What is left after exact
# quantization in the oracle: bf16 q and bf16 output rounding (2**-9 relative per
# element), fp32 vs float64 compressor and RoPE arithmetic (an occasional 1-ulp bf16 flip
# moving one e4m3 code): at most 3.0e-3 on the torch path, 3.4e-3 on vLLM's C++ kernels
# (docs/correctness.md). A token that sees one compressed entry too many or too few
# moves by about 1/sqrt(n) of its value (n <= 640 entries): the smallest seen in the
# negative controls is 2.6e-2, five times this tolerance.
REL_TOL = 5e-3
ENTRY_REL_TOL = 0.08  # stored compressed entry vs oracle (fp8 e4m3: 3 mantissa bits)
LOGIT_TOL = 1e-5  # top-k margin, relative to the row's max |logit|


# ------------------------------------------------------------------------------------------
# float64 oracles
# ------------------------------------------------------------------------------------------
_E4M3 = e4m3_table()


def rope_f64(x: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved pairs) RoPE on the last 64 dims of ``x [n, ..., d]`` at ``pos``."""
    y = x.clone()
    cs = cos_sin.double()[pos]
    shape = (cs.shape[0],) + (1,) * (x.dim() - 2) + (ROPE // 2,)
    cos, sin = cs[:, : ROPE // 2].reshape(shape), cs[:, ROPE // 2 :].reshape(shape)
    d = x.shape[-1]
    e, o = x[..., d - ROPE :: 2], x[..., d - ROPE + 1 :: 2]
    y[..., d - ROPE :: 2] = e * cos - o * sin
    y[..., d - ROPE + 1 :: 2] = o * cos + e * sin
    return y


def compressor_oracle(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                      rms_w: torch.Tensor, cos_sin: torch.Tensor, ratio: int) -> torch.Tensor:
    """float64 entries ``j = 0 .. n-1`` of every completed window (``n = len // ratio``).

    ``kv``/``score`` ``[len, coff*d]`` raw per-token rows (score without ape); C4
    (``coff = 2``) pools the previous window's rows on channels ``[:d]`` with the current
    window's on ``[d:2d]``, per-channel softmax, RMSNorm with ``rms_w``, RoPE at ``j *
    ratio``: the published compressor (``compressor_store.oracle_entry``), vectorized.
    """
    coff = 2 if ratio == 4 else 1
    d = kv.shape[1] // coff
    n = kv.shape[0] // ratio
    k = kv[: n * ratio].double().view(n, ratio, coff * d)
    s = (score[: n * ratio].double().view(n, ratio, coff * d) + ape.double().unsqueeze(0))
    cur_k, cur_s = k[..., (coff - 1) * d :], s[..., (coff - 1) * d :]
    if coff == 2:
        prev_k = torch.cat([torch.zeros_like(k[:1, :, :d]), k[:-1, :, :d]])
        prev_s = torch.cat([torch.full_like(s[:1, :, :d], -math.inf), s[:-1, :, :d]])
        cur_k, cur_s = torch.cat([prev_k, cur_k], 1), torch.cat([prev_s, cur_s], 1)
    x = (torch.softmax(cur_s, dim=1) * cur_k).sum(1)
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * rms_w.double()
    return rope_f64(y, torch.arange(n) * ratio, cos_sin)


def fp8_ds_mla_f64(values: torch.Tensor) -> torch.Tensor:
    """float64 value of each row as the fp8_ds_mla format stores it (bf16, then e4m3
    NoPE tiles with ue8m0 scales by ``oracle.quantize_ref``, bf16 RoPE)."""
    if values.shape[0] == 0:
        return values.double()
    nope, scale, rp = quantize_ref(values.to(torch.bfloat16))
    n = values.shape[0]
    v = _E4M3[nope.long()].view(n, 7, 64) * torch.pow(2.0, scale.double() - 127).unsqueeze(-1)
    return torch.cat([v.view(n, 448), rp.double()], -1)


def q_oracle(q_raw: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    x = q_raw.double()
    x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS)
    return rope_f64(x, pos, cos_sin)


# ------------------------------------------------------------------------------------------
# the world: one request of L + 1 tokens, every cache of the three layer kinds
# ------------------------------------------------------------------------------------------
@dataclass
class World:
    length: int  # prompt length L (decode at position L)
    n: int  # L + 1 positions with inputs
    raw: dict[str, torch.Tensor]
    par: dict[str, torch.Tensor]
    caches: dict[str, torch.Tensor]
    bt: dict[str, torch.Tensor]  # block tables [1, max_blocks] int32, -1 unused
    oracle_cache: dict[str, torch.Tensor] = field(default_factory=dict)


def cos_sin_cache(max_pos: int) -> torch.Tensor:
    inv = 1.0 / 160000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(torch.float32).contiguous()


def _table(gen: torch.Generator, blocks: int) -> tuple[torch.Tensor, int]:
    """A shuffled block table over a pool with a poisoned spare block at each end."""
    perm = torch.randperm(blocks, generator=gen) + 1
    return perm.to(torch.int32).view(1, -1), blocks + 2


def make_world(length: int, seed: int = 0) -> World:
    gen = torch.Generator().manual_seed(seed * 100003 + length)
    n = length + 1

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=gen)

    raw = {
        "q": rnd(n, H, D).to(torch.bfloat16),
        "kv": rnd(n, D, scale=0.7).to(torch.bfloat16),
        "iq": rnd(n, HI, ID).to(torch.bfloat16),
        "iw": rnd(n, HI).to(torch.bfloat16),
        "ikv": rnd(n, 2 * ID), "iscore": rnd(n, 2 * ID, scale=2.0),
        "mkv4": rnd(n, 2 * D), "mscore4": rnd(n, 2 * D, scale=2.0),
        "mkv128": rnd(n, D), "mscore128": rnd(n, D, scale=2.0),
    }
    par = {
        "cos_sin": cos_sin_cache(n + 8),
        "sink": rnd(H),
        "iape": rnd(4, 2 * ID, scale=0.5), "mape4": rnd(4, 2 * D, scale=0.5),
        "mape128": rnd(128, D, scale=0.5),
        "irms": 1.0 + rnd(ID, scale=0.1), "mrms4": 1.0 + rnd(D, scale=0.1),
        "mrms128": 1.0 + rnd(D, scale=0.1),
    }
    bt, caches = {}, {}
    bt["swa"], nb = _table(gen, math.ceil(n / SWA_BS))
    caches["swa"] = fp8_ds_mla.allocate_cache(nb, SWA_BS, fill=POISON)
    for r in (4, 128):
        bt[f"comp{r}"], nb = _table(gen, max(1, math.ceil(n // r / COMP_BS[r])))
        caches[f"comp{r}"] = fp8_ds_mla.allocate_cache(nb, COMP_BS[r], fill=POISON)
        bt[f"state{r}"], nb = _table(gen, math.ceil(n / STATE_BS))
        width = (2 if r == 4 else 1) * D
        caches[f"mstate{r}"] = torch.full((nb, STATE_BS, 2 * width), math.nan)
    caches["istate4"] = torch.full((caches["mstate4"].shape[0], STATE_BS, 4 * ID), math.nan)
    bt["ind"], nb = _table(gen, max(1, math.ceil(n // 4 / IND_BS)))
    caches["ind"] = torch.full((nb, IND_BS, ic.entry_bytes("fp8")), POISON, dtype=torch.uint8)
    return World(length, n, raw, par, caches, bt)


def _slot(bt: torch.Tensor, idx: torch.Tensor, bs: int) -> torch.Tensor:
    """Global slots of local indices ``idx`` (-1 stays -1)."""
    safe = idx.clamp(min=0)
    s = bt[0, safe // bs].long() * bs + safe % bs
    return torch.where(idx >= 0, s, torch.full_like(s, -1))


@dataclass
class Step:
    positions: torch.Tensor  # [T] every token of the step (cache writes)
    rows: torch.Tensor  # [Q] indices into positions of the tokens attended/checked
    max_seq_len: int  # the step's longest sequence (vLLM's short-context rule)


# ------------------------------------------------------------------------------------------
# implementations
# ------------------------------------------------------------------------------------------
class EagerOps:
    """The plugin's torch ops, as its eager region runs them.

    ``c4_shift`` / ``c128_shift`` (negative controls only) move the causal bound of
    the compressed entries: ``j < (p + 1 + shift) // ratio``.
    """

    name = "eager"

    def __init__(self, c4_shift: int = 0, c128_shift: int = 0) -> None:
        self.c4_shift = c4_shift
        self.c128_shift = c128_shift

    # -- per step, every token ------------------------------------------------------------
    def qnorm_rope_kv_insert(self, w: World, pos: torch.Tensor,
                             swa_slots: torch.Tensor) -> torch.Tensor:
        out = torch.empty(pos.numel(), H, D, dtype=torch.bfloat16)
        return rope.qnorm_rope_kv_insert(w.raw["q"][pos], w.raw["kv"][pos], pos,
                                         w.caches["swa"], swa_slots, w.par["cos_sin"], EPS,
                                         out_q=out)

    def compress(self, w: World, r: int, pos: torch.Tensor, state_slots: torch.Tensor,
                 gather: torch.Tensor, comp_slots: torch.Tensor,
                 ind_slots: torch.Tensor | None) -> None:
        c, p = w.caches, w.par
        comp_ops.save_partial_states(w.raw[f"mkv{r}"][pos], w.raw[f"mscore{r}"][pos],
                                     p[f"mape{r}"], pos, c[f"mstate{r}"], state_slots)
        if ind_slots is not None:
            comp_ops.save_partial_states(w.raw["ikv"][pos], w.raw["iscore"][pos], p["iape"],
                                         pos, c["istate4"], state_slots)
            comp_ops.compress_norm_rope_store_indexer(
                c["istate4"], gather, pos, ind_slots, p["irms"], EPS, p["cos_sin"],
                c["ind"].view(c["ind"].shape[0], -1), IND_BS, r, indexer_kv_dtype="fp8")
        comp = c[f"comp{r}"]
        comp_ops.compress_norm_rope_store_main(
            c[f"mstate{r}"], gather, pos, comp_slots, p[f"mrms{r}"], EPS, p["cos_sin"],
            fp8_ds_mla.cache_layout(comp).blocks_2d(comp), COMP_BS[r], r)

    # -- per checked row --------------------------------------------------------------------
    def indexer_q(self, w: World, pos: torch.Tensor) -> indexer_ops.IndexerQ:
        return indexer_ops.indexer_q_rope_quant(
            w.raw["iq"][pos], pos, w.par["cos_sin"], w.raw["iw"][pos],
            softmax_scale=ID**-0.5, head_scale=HI**-0.5, dtype="fp8")

    def topk_c4(self, w: World, pos: torch.Tensor, iq: indexer_ops.IndexerQ,
                max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(local entry ids ``[Q, 512]``, global slots ``[Q, 512]``, lengths ``[Q]``)."""
        t = pos.numel()
        local = torch.empty(t, TOPK, dtype=torch.int32)
        glob = torch.empty(t, TOPK, dtype=torch.int32)
        lens = torch.empty(t, dtype=torch.int32)
        long_ctx = max_seq_len // 4 > TOPK
        eager.select_topk_c4(
            positions=pos + self.c4_shift, token_to_req=torch.zeros_like(pos),
            compressed_block_table=w.bt["comp4"], entries_per_block=COMP_BS[4],
            index_topk=TOPK, out_local=local, out_global=glob, out_lens=lens,
            arange=torch.arange(TOPK, dtype=torch.int32),
            minus_one=torch.tensor(-1, dtype=torch.int32),
            index_q=iq.q if long_ctx else None, index_q_scale=None,
            index_weights=iq.weights if long_ctx else None, indexer_k_cache=w.caches["ind"],
            indexer_block_table=w.bt["ind"], indexer_kv_dtype="fp8",
            max_compressed=max_seq_len // 4)
        return local, glob, lens

    def c128_slots(self, w: World, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(1, -(-w.n // 128))
        idx = torch.empty(pos.numel(), width, dtype=torch.int32)
        lens = torch.empty(pos.numel(), dtype=torch.int32)
        slots.all_visible_compressed_slots(
            idx, lens, positions=pos + self.c128_shift, token_to_req=torch.zeros_like(pos),
            block_table=w.bt["comp128"], block_size=COMP_BS[128], compress_ratio=128,
            arange=torch.arange(width, dtype=torch.int32))
        return idx, lens

    def window(self, w: World, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.empty(pos.numel(), WINDOW, dtype=torch.int32)
        lens = torch.empty(pos.numel(), dtype=torch.int32)
        slots.window_slots(idx, lens, positions=pos, token_to_req=torch.zeros_like(pos),
                           block_table=w.bt["swa"], block_size=SWA_BS,
                           arange=torch.arange(WINDOW, dtype=torch.int32))
        return idx, lens

    def attend(self, w: World, kind: str, q: torch.Tensor, win: tuple[torch.Tensor, ...],
               comp: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        out = torch.empty(q.shape[0], H, D, dtype=torch.bfloat16)
        cache = None if comp is None else w.caches[f"comp{RATIO[kind]}"]
        torch_sparse_mla.sparse_mla_decode(
            q.unsqueeze(1), w.caches["swa"], win[0].unsqueeze(1), win[1], w.par["sink"], SCALE,
            cache, None if comp is None else comp[0].unsqueeze(1),
            None if comp is None else comp[1], out=out.unsqueeze(1), need_lse=False,
        )
        return out


def _blocks_2d(cache: torch.Tensor) -> torch.Tensor:
    return fp8_ds_mla.cache_layout(cache).blocks_2d(cache)


class VllmConventionOps(EagerOps):
    """vLLM's CPU layer: the ``torch.ops._C`` ops it calls, with its arguments, on the
    namespace ``C`` (the plugin's registered fallbacks here; vLLM's real C++ kernels in
    tests/vllm). Index tables are built as vLLM's layer builds them (local ids, -1
    pads, mapped through the block table); tests/vllm swaps in the plugin layer's own
    table builders."""

    name = "fallback"

    def __init__(self, c: Any, c4_shift: int = 0, c128_shift: int = 0) -> None:
        super().__init__(c4_shift, c128_shift)
        self.C = c

    def qnorm_rope_kv_insert(self, w, pos, swa_slots):
        return self.C.fused_qnorm_rope_kv_insert_cpu(
            w.raw["q"][pos], w.raw["kv"][pos], pos, _blocks_2d(w.caches["swa"]), swa_slots,
            w.par["cos_sin"], H, EPS, SWA_BS)

    def compress(self, w, r, pos, state_slots, gather, comp_slots, ind_slots):
        c, p, C = w.caches, w.par, self.C
        C.save_partial_states_cpu(w.raw[f"mkv{r}"][pos], w.raw[f"mscore{r}"][pos],
                                  p[f"mape{r}"], pos, c[f"mstate{r}"], state_slots)
        if ind_slots is not None:
            C.save_partial_states_cpu(w.raw["ikv"][pos], w.raw["iscore"][pos], p["iape"], pos,
                                      c["istate4"], state_slots)
            C.compress_norm_rope_store_indexer_cpu(
                c["istate4"], gather, pos, ind_slots, p["irms"], EPS, p["cos_sin"],
                c["ind"].view(c["ind"].shape[0], -1), IND_BS, r)
        C.compress_norm_rope_store_cpu(
            c[f"mstate{r}"], gather, pos, comp_slots, p[f"mrms{r}"], EPS, p["cos_sin"],
            _blocks_2d(c[f"comp{r}"]), COMP_BS[r], r)

    def indexer_q(self, w, pos):
        t = pos.numel()
        qo = torch.empty(t, HI, ID, dtype=torch.float8_e4m3fn)
        wo = torch.empty(t, HI)
        self.C.fused_indexer_q_rope_quant_cpu(pos, w.raw["iq"][pos].float(), w.par["cos_sin"],
                                              qo, w.raw["iw"][pos].float(), ID**-0.5,
                                              HI**-0.5, wo)
        return indexer_ops.IndexerQ(qo, None, wo)

    def map_slots(self, local: torch.Tensor, bt: torch.Tensor, bs: int) -> torch.Tensor:
        return _slot(bt, local.long(), bs)

    def topk_c4(self, w, pos, iq, max_seq_len):
        """``DeepseekV4CPUIndexer``: the short-context fill when ``max_seq_len // 4 <=
        512``, else ``fp8_paged_mqa_logits_cpu`` + ``topk_transform_512_cpu``."""
        t = pos.numel()
        vis = torch.div(pos + 1 + self.c4_shift, 4, rounding_mode="floor")
        if max_seq_len // 4 <= TOPK:
            ar = torch.arange(TOPK)
            local = torch.where(ar[None] < vis[:, None], ar[None], torch.full((t, TOPK), -1))
        else:
            page_table = w.bt["ind"].expand(t, -1).contiguous()
            vis32 = vis.to(torch.int32)
            logits = self.C.fp8_paged_mqa_logits_cpu(
                iq.q, w.caches["ind"].view(w.caches["ind"].shape[0], -1), iq.weights, vis32,
                page_table, IND_BS, max_seq_len // 4)
            local = torch.full((t, TOPK), -1, dtype=torch.int32)
            pages = torch.empty(t, TOPK, dtype=torch.int32)
            self.C.topk_transform_512_cpu(logits, vis32, page_table, pages, IND_BS, local)
        glob = self.map_slots(local, w.bt["comp4"], COMP_BS[4])
        return local.to(torch.int32), glob, (local >= 0).sum(1).to(torch.int32)

    def c128_slots(self, w, pos):
        width = -(-(w.n + 8) // 128)  # vLLM: ceil(max_model_len / ratio)
        n = torch.div(pos + 1 + self.c128_shift, 128, rounding_mode="floor").clamp(max=width)
        ar = torch.arange(width)
        local = torch.where(ar[None] < n[:, None], ar[None], torch.full((pos.numel(), width), -1))
        return self.map_slots(local, w.bt["comp128"], COMP_BS[128]), n.to(torch.int32)

    def window(self, w, pos):
        start = (pos - WINDOW + 1).clamp(min=0)
        local = start[:, None] + torch.arange(WINDOW)
        local = torch.where(local <= pos[:, None], local, torch.full_like(local, -1))
        return self.map_slots(local, w.bt["swa"], SWA_BS), None

    def attend(self, w, kind, q, win, comp):
        out = torch.empty(q.shape[0], H, D, dtype=torch.bfloat16)
        swa = _blocks_2d(w.caches["swa"])
        if comp is None:  # vLLM's SWA-only layers: an empty compressed table
            cache2d, cslots, cbs = swa, win[0].new_full((q.shape[0], 0), -1), 1
        else:
            cache2d, cslots = _blocks_2d(w.caches[f"comp{RATIO[kind]}"]), comp[0]
            cbs = COMP_BS[RATIO[kind]]
        self.C.flash_mla_with_kvcache_cpu(out, q, swa, win[0].long().contiguous(), SWA_BS,
                                          cache2d, cslots.long().contiguous(), cbs,
                                          w.par["sink"], SCALE)
        return out


def fallback_namespace() -> SimpleNamespace:
    """The plugin's torch fallbacks of vLLM's ops, called directly (no vLLM)."""
    from vllm_dsv4_backend.vllm_compat import cpu_ops

    return SimpleNamespace(**{op.name: op.impl for op in cpu_ops.OPS})


# ------------------------------------------------------------------------------------------
# running a length
# ------------------------------------------------------------------------------------------
@dataclass
class Checked:
    """One attended token of one layer kind."""

    kind: str
    phase: str  # "prefill" or "decode"
    pos: int
    out: torch.Tensor  # [H, D] bf16
    selected: torch.Tensor | None = None  # C4 long context: local entry ids picked
    index_q: torch.Tensor | None = None  # C4 long context: dequantized q [HI, ID] f64
    index_w: torch.Tensor | None = None  # [HI] f64


def run_step(w: World, ops: EagerOps, step: Step, phase: str) -> list[Checked]:
    pos = step.positions
    swa_slots = _slot(w.bt["swa"], pos, SWA_BS)
    q_all = ops.qnorm_rope_kv_insert(w, pos, swa_slots)
    state = {r: _slot(w.bt[f"state{r}"], pos, STATE_BS) for r in (4, 128)}
    for r in (4, 128):
        win = (2 if r == 4 else 1) * r
        g = pos[:, None] - win + 1 + torch.arange(win)
        gather = _slot(w.bt[f"state{r}"], torch.where(g >= 0, g, -1), STATE_BS)
        emit = (pos + 1) % r == 0
        ent = torch.where(emit, pos // r, -1)
        comp_slots = _slot(w.bt[f"comp{r}"], ent, COMP_BS[r])
        ind_slots = _slot(w.bt["ind"], ent, IND_BS) if r == 4 else None
        ops.compress(w, r, pos, state[r], gather, comp_slots, ind_slots)
    rows = step.rows
    qpos = pos[rows]
    q = q_all[rows].contiguous()
    win = ops.window(w, qpos)
    res: list[Checked] = []
    iq = ops.indexer_q(w, qpos)
    for kind in KINDS:
        sel = None
        if kind == "swa":
            comp = None
        elif kind == "c4":
            local, glob, lens = ops.topk_c4(w, qpos, iq, step.max_seq_len)
            comp, sel = (glob, lens), local
        else:
            comp = ops.c128_slots(w, qpos)
        out = ops.attend(w, kind, q, win, comp)
        for i, p in enumerate(qpos.tolist()):
            c = Checked(kind, phase, p, out[i])
            if kind == "c4" and step.max_seq_len // 4 > TOPK:
                assert sel is not None
                c.selected = sel[i]
                c.index_q = _E4M3[iq.q[i].view(torch.uint8).long()]
                c.index_w = iq.weights[i].double()
            res.append(c)
    return res


def run_length(w: World, ops: EagerOps) -> list[Checked]:
    """Prefill ``0 .. L-1`` (attention for the last :data:`PREFILL_ROWS` tokens), then
    decode at ``L``."""
    L = w.length
    pre = Step(torch.arange(L), torch.arange(max(0, L - PREFILL_ROWS), L), L)
    dec = Step(torch.tensor([L]), torch.tensor([0]), L + 1)
    return run_step(w, ops, pre, "prefill") + run_step(w, ops, dec, "decode")


# ------------------------------------------------------------------------------------------
# checking a length
# ------------------------------------------------------------------------------------------
def _oracle_values(w: World) -> dict[str, torch.Tensor]:
    """float64 values of every SWA row and compressed entry (cached on the world)."""
    if w.oracle_cache:
        return w.oracle_cache
    cs = w.par["cos_sin"]
    pos = torch.arange(w.n)
    kv = rope_f64(w.raw["kv"].double(), pos, cs)
    o = {"swa": fp8_ds_mla_f64(kv), "q": q_oracle(w.raw["q"], pos, cs)}
    o["c4"] = compressor_oracle(w.raw["mkv4"], w.raw["mscore4"], w.par["mape4"],
                                w.par["mrms4"], cs, 4)
    o["c128"] = compressor_oracle(w.raw["mkv128"], w.raw["mscore128"], w.par["mape128"],
                                  w.par["mrms128"], cs, 128)
    o["ind"] = compressor_oracle(w.raw["ikv"], w.raw["iscore"], w.par["iape"], w.par["irms"],
                                 cs, 4)
    o["c4q"] = fp8_ds_mla_f64(o["c4"])
    o["c128q"] = fp8_ds_mla_f64(o["c128"])
    w.oracle_cache.update(o)
    return o


def _stored_indexer_f64(w: World, n: int) -> torch.Tensor:
    """float64 indexer entries ``0 .. n-1`` decoded from the cache bytes (128 e4m3 values
    then a 4-byte fp32 scale per entry, block-planar)."""
    j = torch.arange(n)
    blk = w.bt["ind"][0, j // IND_BS].long()
    off = j % IND_BS
    raw = w.caches["ind"].view(w.caches["ind"].shape[0], -1)
    vals = raw[blk[:, None], off[:, None] * 128 + torch.arange(128)]
    scl = raw[blk[:, None], IND_BS * 128 + off[:, None] * 4 + torch.arange(4)]
    return _E4M3[vals.long()] * scl.contiguous().view(torch.float32).double()


def _stored_main_f64(w: World, r: int, n: int) -> torch.Tensor:
    from tests.support.oracle import dequant_slots_f64

    return dequant_slots_f64(w.caches[f"comp{r}"], _slot(w.bt[f"comp{r}"], torch.arange(n),
                                                           COMP_BS[r]))


@dataclass
class Finding:
    kind: str
    phase: str
    pos: int
    rel: float  # ||out - oracle|| / ||oracle||
    max_abs: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.note and self.rel <= REL_TOL


def entry_problems(w: World) -> list[str]:
    """Every stored compressed entry (C4 main + indexer, C128) vs the compressor oracle."""
    o = _oracle_values(w)
    out = []
    for name, ref, got in (
        ("c4 main", o["c4"], _stored_main_f64(w, 4, o["c4"].shape[0])),
        ("c4 indexer", o["ind"], _stored_indexer_f64(w, o["ind"].shape[0])),
        ("c128 main", o["c128"], _stored_main_f64(w, 128, o["c128"].shape[0])),
    ):
        if ref.shape[0] == 0:
            continue
        rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        bad = (~(rel <= ENTRY_REL_TOL)).nonzero().view(-1)
        if bad.numel():
            j = int(bad[0])
            out.append(f"L={w.length} {name}: {bad.numel()} entries off, first j={j} "
                       f"rel {float(rel[j]):.3g}")
    return out


def check(w: World, got: list[Checked]) -> list[Finding]:
    o = _oracle_values(w)
    res = []
    for c in got:
        p = c.pos
        lo = max(0, p - WINDOW + 1)
        keys = [o["swa"][lo : p + 1]]
        note = ""
        r = RATIO[c.kind]
        if r > 1:
            vis = (p + 1) // r
            if c.selected is None:
                keys.append(o[f"{c.kind}q"][:vis])
            else:
                note = _topk_problem(w, c, vis)
                sel = c.selected[c.selected >= 0].long()
                keys.append(o["c4q"][sel.clamp(max=max(0, o["c4q"].shape[0] - 1))])
        k = torch.cat(keys)
        q = o["q"][p]
        scores = (q @ k.T) * SCALE
        ref, _, _ = _softmax_with_sink(scores, torch.ones(1, k.shape[0], dtype=torch.bool), k,
                                       w.par["sink"])
        a = c.out.double()
        if not torch.isfinite(a).all():
            note = note or "non-finite output (read past the written entries)"
            rel = mx = math.inf
        else:
            rel = float((a - ref).norm() / ref.norm())
            mx = float((a - ref).abs().max())
        res.append(Finding(c.kind, c.phase, p, rel, mx, note))
    return res


def _topk_problem(w: World, c: Checked, vis: int) -> str:
    sel = c.selected
    picked = sel[sel >= 0].long()
    if picked.numel() != min(TOPK, vis):
        return f"top-k holds {picked.numel()} entries, expected {min(TOPK, vis)}"
    if picked.unique().numel() != picked.numel():
        return "top-k repeats an entry"
    if int(picked.max()) >= vis or int(picked.min()) < 0:
        return f"top-k picks entry {int(picked.max())} >= visible {vis}"
    k = _stored_indexer_f64(w, vis)
    assert c.index_q is not None and c.index_w is not None
    logits = ((c.index_q @ k.T).clamp_min(0) * c.index_w[:, None]).sum(0)
    mask = torch.zeros(vis, dtype=torch.bool)
    mask[picked] = True
    if (~mask).any():
        margin = float(logits[~mask].max() - logits[mask].min())
        if margin > LOGIT_TOL * float(logits.abs().max()):
            return f"top-k left out an entry scoring {margin:.3g} above a picked one"
    return ""


def sweep(lengths: Iterable[int], make_ops: Callable[[], EagerOps], seed: int = 0,
          ) -> tuple[list[tuple[int, Finding]], list[str]]:
    findings, entry = [], []
    for L in lengths:
        w = make_world(L, seed)
        got = run_length(w, make_ops())
        findings += [(L, f) for f in check(w, got)]
        entry += entry_problems(w)
    return findings, entry


def table(findings: list[tuple[int, Finding]]) -> str:
    """Max rel error and max |diff| per layer kind, phase and L mod 4 (markdown)."""
    lines = ["| kind | phase | L mod 4 | lengths | tokens | max rel_l2 | max abs |",
             "|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        for phase in ("prefill", "decode"):
            for m in range(4):
                fs = [(L, f) for L, f in findings
                      if f.kind == kind and f.phase == phase and m == L % 4]
                if not fs:
                    continue
                lines.append(
                    f"| {kind} | {phase} | {m} | {len({L for L, _ in fs})} | {len(fs)} | "
                    f"{max(f.rel for _, f in fs):.2e} | {max(f.max_abs for _, f in fs):.2e} |")
    return "\n".join(lines)


def failures(findings: list[tuple[int, Finding]]) -> list[str]:
    return [f"L={L} {f.kind} {f.phase} p={f.pos} (p%4={f.pos % 4}): rel {f.rel:.3g}, "
            f"max|diff| {f.max_abs:.3g} {f.note}".rstrip()
            for L, f in findings if not f.ok]


