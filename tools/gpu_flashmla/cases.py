# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-V4 sparse-decode inputs as vLLM 0.34 builds them, and the comparison rule
(torch + the plugin only; runs on CPU: the dry run builds everything here).

One case is one decode step of one layer type with ``N`` requests of one token each
(vLLM flattens MTP tokens the same way: ``b = num_tokens``, ``s_q = 1``):

- the SWA cache (64 tokens a block, 584 B ``fp8_ds_mla``) and its indices/lengths from
  :func:`vllm_dsv4_backend.ops.metadata.swa_indices_and_lens`, the plugin's port of
  vLLM's ``ComputeSWAIndicesAndLensKernel`` (window 128, width 128);
- C4A: an extra cache of compressed entries (``256 // 4 = 64`` a block), the indexer's
  local top-k (width ``index_topk``: 512 Flash, 1024 Pro; short contexts filled
  ``0..n-1`` then -1 as vLLM's ``_fill_short_context_topk_indices``, long ones a random
  pick, some rows with -1 holes inside the used prefix) mapped by
  :func:`~vllm_dsv4_backend.ops.indexer.local_to_global`, the port of
  ``compute_global_topk_indices_and_lens``;
- C128A: every visible compressed entry (``256 // 128 = 2`` a block) from
  :func:`~vllm_dsv4_backend.ops.metadata.build_c128a_topk_metadata`, width padded to a
  multiple of 128 (``_C128A_TOPK_ALIGNMENT``);
- padded rows at the end (a CUDA-graph batch: ``is_valid_token`` False, lengths 0);
- caches allocated padded (``stride(0)`` a multiple of 576 B, FlashMLA's rule) and
  filled with 0xFF (NaN in e4m3, e8m0 and bf16) except the slots some index names, so a
  kernel that reads an unnamed slot shows NaN.

FlashMLA-legal sizes (the interface's and kernels' asserts): ``h_q`` 64 or 128, top-k
widths multiples of 64 (``B_TOPK``; vLLM uses multiples of 128), ``d_qk = d_v = 512``,
block strides multiples of 576 B, ``indices`` contiguous (``stride(0)`` 32 B aligned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.ops import metadata as meta_ops
from vllm_dsv4_backend.ops.torch_sparse_mla import sparse_mla_decode

__all__ = [
    "CASES",
    "bf16_p_emulation",
    "TOLERANCE",
    "CaseSpec",
    "DecodeCase",
    "build_case",
    "compare",
    "flashmla_problems",
    "next_step",
    "random_q",
    "reference",
]

D = fp8_ds_mla.HEAD_DIM
WINDOW = 128  # DeepSeek-V4 sliding window; vLLM's decode SWA index width
SWA_BLOCK = 64  # tokens per SWA cache block
KERNEL_BLOCK = 256  # vLLM's kernel block for V4; compressed blocks hold 256 // ratio
SCALE = D ** -0.5  # DeepSeek-V4's softmax scale

# FlashMLA's own decode-test rule (tests/test_flash_mla_sparse_decoding.py, kernelkit
# check_is_allclose), which compares the kernel with an fp32 reference computed on the
# same dequantized cache values, as the plugin's reference is: +-inf/NaN positions equal;
# each element within abs OR rel; and the cosine distance bound. bf16 out: 2 ulps
# (rel 2.01/128) or 1e-3 absolute, the kernel rounding P to bf16 for the PV product;
# lse fp32: 8 ulps of a 16-bit mantissa or 1e-6.
TOLERANCE: dict[str, dict[str, float]] = {
    "out": {"abs": 1e-3, "rel": 2.01 / 128, "cos": 5e-6},
    "lse": {"abs": 1e-6, "rel": 8.01 / 65536, "cos": 5e-6},
}


@dataclass(frozen=True)
class CaseSpec:
    name: str
    kind: str  # "swa", "c4a", "c128a"
    heads: int  # padded q heads: 64 (V4-Flash) or 128 (V4-Pro)
    num_tokens: int = 32  # decode tokens, the last ``num_padded`` of them padding
    num_padded: int = 2
    max_ctx: int = 6000
    index_topk: int = 512  # C4A extra width (V4-Flash 512, V4-Pro 1024)
    sink: str = "finite"  # "finite", "inf" (heads +inf / -inf / finite), "none"
    seed: int = 0


CASES: tuple[CaseSpec, ...] = (
    CaseSpec("swa_h64", "swa", 64),
    CaseSpec("c4a_h64", "c4a", 64),
    CaseSpec("c128a_h64", "c128a", 64, max_ctx=20000),
    CaseSpec("c4a_h128_pro", "c4a", 128, index_topk=1024, max_ctx=9000),
    CaseSpec("c128a_h128", "c128a", 128, max_ctx=33000),
    CaseSpec("c4a_h64_inf_sink", "c4a", 64, sink="inf"),
    CaseSpec("c4a_h64_no_sink", "c4a", 64, sink="none", num_padded=0),
)


@dataclass
class DecodeCase:
    """Every tensor of one ``flash_mla_with_kvcache`` call (CPU; :meth:`to` moves them)."""

    spec: CaseSpec
    q: torch.Tensor  # [N, 1, H, 512] bf16
    swa_cache: torch.Tensor  # [nb, 64, 1, 584] u8 view of a padded allocation
    swa_indices: torch.Tensor  # [N, 1, 128] i32
    swa_lens: torch.Tensor  # [N] i32
    attn_sink: torch.Tensor | None  # [H] f32
    extra_cache: torch.Tensor | None = None  # [nb, 64 or 2, 1, 584] u8
    extra_indices: torch.Tensor | None = None  # [N, 1, K] i32
    extra_lens: torch.Tensor | None = None  # [N] i32
    facts: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {k: getattr(self, k) for k in (
            "q", "swa_cache", "swa_indices", "swa_lens", "attn_sink", "extra_cache",
            "extra_indices", "extra_lens")}

    def to(self, device: torch.device | str) -> DecodeCase:
        moved = {k: _to(v, device) for k, v in self.tensors().items()}
        return DecodeCase(self.spec, facts=self.facts, **moved)  # type: ignore[arg-type]

    def kwargs(self) -> dict[str, Any]:
        """``flash_mla_with_kvcache``'s arguments as vLLM 0.34's ``_forward_decode``
        passes them (block_table/cache_seqlens None, ``is_fp8_kvcache=True``)."""
        return dict(
            q=self.q, k_cache=self.swa_cache, block_table=None, cache_seqlens=None,
            head_dim_v=D, is_fp8_kvcache=True, indices=self.swa_indices,
            topk_length=self.swa_lens, softmax_scale=SCALE, attn_sink=self.attn_sink,
            extra_k_cache=self.extra_cache, extra_indices_in_kvcache=self.extra_indices,
            extra_topk_length=self.extra_lens,
        )


def flashmla_problems(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                      extra_k_cache: torch.Tensor | None = None,
                      extra_indices: torch.Tensor | None = None) -> list[str]:
    """What FlashMLA's sparse decode (vLLM 0.34's ``.so``, MODEL1 / 584 B) would refuse,
    in its own words (the checks of ``sparse_decode_fwd`` and its SM90 kernel); empty
    when the call is legal. The dry run's stand-in op raises on any of them."""
    bad = []
    if q.dim() != 4 or q.dtype != torch.bfloat16 or q.shape[-1] != D:
        bad.append(f"q must have shape (b, s_q, h_q, d_qk) bf16, d_qk 512: {tuple(q.shape)}")
    elif q.shape[2] not in (64, 128):
        bad.append(f"Unsupported num_heads_q: {q.shape[2]}")
    elif q.stride(0) % q.stride(1) != 0 or q.stride(-1) != 1:
        bad.append("params.stride_q_b % params.stride_q_s_q == 0 (and a contiguous last dim)")
    for cache, idx, name in ((k_cache, indices, "topk"),
                             (extra_k_cache, extra_indices, "extra_topk")):
        if cache is None or idx is None:
            if (cache is None) != (idx is None):
                bad.append("extra_indices_in_kvcache must be provided with extra_k_cache")
            continue
        if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != 584:
            bad.append(f"kv must have shape (num_blocks, page_block_size, 1, 584): "
                       f"{tuple(cache.shape)}")
        elif cache.shape[0] > 1 and cache.stride(0) % fp8_ds_mla.DATA_BYTES_PER_TOKEN:
            bad.append(f"block_stride_bytes % TOKEN_STRIDE == 0: stride(0) {cache.stride(0)}")
        if idx.dim() != 3 or idx.dtype != torch.int32 or idx.shape[:2] != q.shape[:2]:
            bad.append(f"indices must have shape (b, s_q, {name}) int32: {tuple(idx.shape)}")
        elif idx.shape[-1] % 64:
            bad.append(f"{name} ({idx.shape[-1]}) mod B_TOPK (64) must be 0")
        elif idx.stride(-1) != 1 or idx.stride(0) * 4 % 32:
            bad.append("indices.stride(0) must be 32B aligned (and a contiguous last dim)")
    return bad


def _to(t: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dtype == torch.uint8 and t.dim() == 4:
        # A cache view into a padded allocation: move the allocation, keep the strides.
        nb, bs = t.shape[0], t.shape[1]
        s0 = t.stride(0) if nb > 1 else fp8_ds_mla.padded_block_stride(bs)
        raw = torch.as_strided(t, (nb, s0), (s0, 1)).to(device)
        return raw[:, : bs * fp8_ds_mla.BYTES_PER_TOKEN].view(nb, bs, 1, -1)
    return t.to(device)


def _cache(num_blocks: int, block_size: int) -> torch.Tensor:
    # 0xFF everywhere: NaN in e4m3 (data), e8m0 (scales) and bf16 (RoPE), so only the
    # slots written below hold numbers.
    return fp8_ds_mla.allocate_cache(num_blocks, block_size, "cpu", fill=0xFF).unsqueeze(2)


# Values as FlashMLA's decode test draws them (q ~ randn, kv ~ randn / 10, both clamped to
# +-1), the distribution its tolerance (TOLERANCE) was set for: the kernel rounds the
# softmax weights to bf16 for the PV product, an error that scales with |v|; unit-RMS kv
# (DeepSeek-V4's after its RMS norm) puts up to 1.6e-2 absolute error on short rows in an
# emulation of that rounding, past the abs 1e-3 bound, with the same relative accuracy.
def random_q(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g).clamp(-1, 1).to(torch.bfloat16)


def _write(cache: torch.Tensor, slots: torch.Tensor, g: torch.Generator) -> None:
    slots = torch.unique(slots[slots >= 0]).to(torch.int64)
    kv = (torch.randn(slots.numel(), D, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    fp8_ds_mla.quantize_and_insert(kv, cache, slots)


def _block_table(num_reqs: int, blocks_per_req: int, g: torch.Generator,
                 spare: int = 8) -> tuple[torch.Tensor, int]:
    # Distinct shuffled physical blocks (as a block pool hands them out); block 0 stays
    # the null block vLLM's sliding-window manager points dropped blocks at, and
    # ``spare`` blocks are never used (NaN).
    total = num_reqs * blocks_per_req + spare + 1
    ids = torch.randperm(total - 1, generator=g)[: num_reqs * blocks_per_req] + 1
    return ids.view(num_reqs, blocks_per_req).to(torch.int32), total


def build_case(spec: CaseSpec) -> DecodeCase:
    """The inputs of one case, deterministic in ``spec`` (CPU tensors)."""
    g = torch.Generator().manual_seed(1000 + spec.seed)
    n, h = spec.num_tokens, spec.heads
    n_valid = n - spec.num_padded
    # Context lengths: the corners (1 token, one block, the window edge, just past it)
    # and random ones up to max_ctx.
    corners = torch.tensor([1, 5, 64, 127, 128, 129, 511, 512, 513, spec.max_ctx])
    ctx = torch.randint(1, spec.max_ctx + 1, (n,), generator=g)
    ctx[: min(len(corners), n_valid)] = corners[: min(len(corners), n_valid)]
    valid = torch.arange(n) < n_valid
    seq_lens = ctx.to(torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    t2r = torch.arange(n, dtype=torch.int32)

    # SWA: only the window's blocks are real (at most 3 of 64 tokens for a window of 128);
    # earlier logical blocks point at the null block 0, never named by a window.
    max_blocks = math.ceil(spec.max_ctx / SWA_BLOCK)
    real, nb_swa = _block_table(n, 3, g)
    table = torch.zeros(n, max_blocks, dtype=torch.int32)
    for r in range(n):
        last = (int(ctx[r]) - 1) // SWA_BLOCK
        first = max(0, int(ctx[r]) - WINDOW) // SWA_BLOCK
        table[r, first: last + 1] = real[r, : last + 1 - first]
    swa_cache = _cache(nb_swa, SWA_BLOCK)
    swa_indices = torch.full((n, 1, WINDOW), -1, dtype=torch.int32)
    swa_lens = torch.zeros(n, dtype=torch.int32)
    meta_ops.swa_indices_and_lens(
        swa_indices, swa_lens, WINDOW, WINDOW, swa_lens, swa_lens, qsl, seq_lens, t2r,
        valid, table, SWA_BLOCK, torch.zeros(n, dtype=torch.int32), num_tokens=n,
        token_offset=0)
    _write(swa_cache, swa_indices, g)

    q = random_q((n, 1, h, D), g)
    if spec.sink == "none":
        sink = None
    else:
        sink = torch.randn(h, generator=g)
        if spec.sink == "inf":
            sink[0::3] = float("inf")  # FlashMLA: the head's output becomes 0
            sink[1::3] = float("-inf")  # no effect
    case = DecodeCase(spec, q, swa_cache, swa_indices, swa_lens, sink)
    facts: dict[str, Any] = {"num_tokens": n, "padded_rows": spec.num_padded, "heads": h,
                             "swa_block": SWA_BLOCK, "swa_width": WINDOW,
                             "ctx_min": int(ctx[:n_valid].min()),
                             "ctx_max": int(ctx[:n_valid].max())}

    if spec.kind == "c4a":
        bs = KERNEL_BLOCK // 4
        n_comp = torch.div(ctx, 4, rounding_mode="floor")  # j < (pos + 1) // 4, pos = ctx-1
        k = spec.index_topk
        local = torch.full((n, k), -1, dtype=torch.int32)
        for r in range(n_valid):
            m = int(n_comp[r])
            if m <= k:
                local[r, :m] = torch.arange(m, dtype=torch.int32)
            else:
                local[r] = torch.randperm(m, generator=g)[:k].to(torch.int32)
        # -1 holes inside the used prefix of every 4th valid row (FlashMLA skips exactly
        # -1; vLLM's length counts the valid entries, so the row's tail past it is cut).
        for r in range(0, n_valid, 4):
            m = int((local[r] >= 0).sum())
            if m > 2:
                hole = torch.randperm(m, generator=g)[: max(1, m // 8)]
                local[r, hole] = -1
        ctable, nb = _block_table(n, math.ceil(spec.max_ctx / 4 / bs), g)
        gidx, glens = indexer_ops.local_to_global(local, t2r, ctable, bs,
                                                  is_valid_token=valid)
        extra_cache = _cache(nb, bs)
        _write(extra_cache, gidx, g)
        case.extra_cache, case.extra_indices, case.extra_lens = (
            extra_cache, gidx.view(n, 1, k), glens)
        facts.update(extra_block=bs, extra_width=k, holes_rows=len(range(0, n_valid, 4)))
    elif spec.kind == "c128a":
        bs = KERNEL_BLOCK // 128
        max_comp = spec.max_ctx // 128
        width = max(128, math.ceil(max_comp / 128) * 128)
        ctable, nb = _block_table(n, math.ceil(width / bs), g)
        gidx = torch.full((n, width), -1, dtype=torch.int32)
        glens = torch.zeros(n, dtype=torch.int32)
        slot_mapping = torch.where(valid, torch.arange(n), torch.full((n,), -1))
        meta_ops.build_c128a_topk_metadata(
            gidx, glens, torch.empty(0, width, dtype=torch.int32), (ctx - 1).to(torch.int64),
            128, width, n, t2r, ctable, bs, slot_mapping)
        extra_cache = _cache(nb, bs)
        _write(extra_cache, gidx, g)
        case.extra_cache, case.extra_indices, case.extra_lens = (
            extra_cache, gidx.view(n, 1, width), glens)
        facts.update(extra_block=bs, extra_width=width)
    case.facts = facts
    return case


def next_step(case: DecodeCase, seed: int = 1) -> DecodeCase:
    """Another step over the same caches (same shapes and addresses once on a device):
    new queries, the index rows rotated among the requests and some lengths shortened,
    so a CUDA-graph replay must re-plan the tile scheduler from the new lengths."""
    g = torch.Generator().manual_seed(5000 + seed)
    n = case.q.shape[0]
    perm = torch.roll(torch.arange(n), 3)
    q = random_q(tuple(case.q.shape), g)

    def shorten(lens: torch.Tensor) -> torch.Tensor:
        cut = (torch.rand(n, generator=g) < 0.3) & (lens > 0)
        return torch.where(cut, lens // 2, lens).to(torch.int32)

    nxt = DecodeCase(case.spec, q, case.swa_cache, case.swa_indices[perm].contiguous(),
                     shorten(case.swa_lens[perm]), case.attn_sink, case.extra_cache,
                     facts=dict(case.facts, step=seed))
    if case.extra_indices is not None:
        assert case.extra_lens is not None
        nxt.extra_indices = case.extra_indices[perm].contiguous()
        nxt.extra_lens = shorten(case.extra_lens[perm])
    return nxt


def reference(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The plugin's serial torch sparse MLA (FlashMLA semantics, fp32) on CPU copies."""
    c = case.to("cpu")
    out, lse = sparse_mla_decode(
        c.q, c.swa_cache, c.swa_indices, c.swa_lens, c.attn_sink, SCALE,
        c.extra_cache, c.extra_indices, c.extra_lens)
    assert lse is not None
    return out, lse


def bf16_p_emulation(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's math with the one rounding FlashMLA adds (its softmax weights
    ``exp(s - max)`` rounded to bf16 before the PV product, fp32 elsewhere), row by row
    on CPU: :data:`TOLERANCE` must hold for it with room, or the tolerance is too tight
    for the kernel's known behaviour rather than a sign of a bug."""
    c = case.to("cpu")
    n, _, h, _ = c.q.shape
    out = torch.zeros(n, 1, h, D)
    lse = torch.full((n, h, 1), math.inf)
    for i in range(n):
        rows = []
        for cache, idx, lens in ((c.swa_cache, c.swa_indices, c.swa_lens),
                                 (c.extra_cache, c.extra_indices, c.extra_lens)):
            if cache is None or idx is None or lens is None:
                continue
            ids = idx[i, 0, : int(lens[i])]
            rows.append(fp8_ds_mla.dequantize_and_gather(cache, ids[ids >= 0]).float())
        kv = torch.cat(rows)
        if kv.shape[0] == 0:
            continue  # no valid entry: out 0, lse +inf
        s = (c.q[i, 0].float() @ kv.T) * SCALE
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        den = p.sum(-1, keepdim=True)
        o = (p.to(torch.bfloat16).float() @ kv) / den
        l_ = torch.log(den) + m
        if c.attn_sink is not None:
            o = o * torch.sigmoid(l_ - c.attn_sink[:, None])
        out[i, 0], lse[i, :, 0] = o, l_[:, 0]
    return out.to(torch.bfloat16), lse


def compare(got: torch.Tensor, ref: torch.Tensor, what: str) -> dict[str, Any]:
    """FlashMLA's ``check_is_allclose`` with :data:`TOLERANCE` ``[what]``; the report has
    the verdict and the worst errors."""
    tol = TOLERANCE[what]
    a = got.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    rep: dict[str, Any] = {"shape": list(a.shape), "tolerance": tol}
    if a.shape != r.shape:
        rep.update(ok=False, problem=f"shape {tuple(a.shape)} vs {tuple(r.shape)}")
        return rep
    nan_a, nan_r = torch.isnan(a), torch.isnan(r)
    pinf = (a == math.inf) != (r == math.inf)
    ninf = (a == -math.inf) != (r == -math.inf)
    special_mismatch = int(((nan_a != nan_r) | pinf | ninf).sum())
    fin = torch.isfinite(a) & torch.isfinite(r)
    a_f, r_f = a[fin], r[fin]
    err = (a_f - r_f).abs()
    rel = err / (r_f.abs() + 1e-6)
    bad = int(((err >= tol["abs"]) & (rel >= tol["rel"])).sum())
    denom = float((a_f * a_f + r_f * r_f).sum())
    cos = 1.0 - 2.0 * float((a_f * r_f).sum()) / denom if denom > 0 else 0.0
    rep.update(
        nan_got=int(nan_a.sum()), inf_got=int(torch.isinf(a).sum()),
        special_mismatch=special_mismatch, elements_out_of_tolerance=bad,
        max_abs_err=float(err.max()) if err.numel() else 0.0,
        max_rel_err=float(rel.max()) if rel.numel() else 0.0,
        cos_diff=cos,
        ok=special_mismatch == 0 and bad == 0 and cos <= tol["cos"],
    )
    return rep
