# SPDX-License-Identifier: Apache-2.0
"""Batch invariance of the plugin's torch attention path (torch only, no vLLM).

Issue 13, item 1: the eager region's output for a token, and the indexer's top-k
for it, must be bitwise the same whether the token runs alone or in any batch.
Upstream asks the same of vLLM (temperature-0 outputs change with the number of
requests in flight, vllm-project/vllm#53257, where FlashMLA's sparse decode was
found batch-shape dependent by 1-2 bf16 ulp).

Two levels:

- ops: ``ops.sparse_mla_decode`` (entry-wise and deduplicated paths),
  ``ops.sparse_mla_prefill``, ``ops.indexer`` q quant / logits / top-k, each row
  alone vs in batches of several sizes and orders;
- the eager step (``bi_world.run_step``: q-norm + RoPE + SWA insert, indexer q
  quant, both compressor stores, ``eager.select_topk_c4``, window slots,
  ``ops.sparse_mla_decode``) over decode-only, prefill-only and mixed batches, a prefill
  split across two calls (chunked prefill) and the short/long-context boundary,
  compared with every token run alone, outputs and final cache bytes.

``ops.indexer.indexer_logits`` scores entries in fixed-width, fixed-origin tiles
for this (a batch-dependent tile width changed a row's logits by 1-310 fp32
ulp), and ``ops.torch_sparse_mla`` reduces each index list in fixed 128-column
segments from the list's own column 0, so padding a row's index lists with -1
to a wider (batch-wide) width, or a smaller scratch budget, keeps its bits.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import bi_world as W
from tests.support.threads import one_thread
from vllm_dsv4_backend import ops
from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.formats import indexer_cache as ic
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.ops import torch_sparse_mla

# ops/indexer.py indexer_logits: the entry chunk is [j0, min(end, j0 + nc)) with
# nc = min(width, 4096) and end = the chunk's widest visible count, so the GEMM / GEMV
# shapes of a row (torch.bmm(w, s) over the heads, torch.mm / bmm for q.k) depend on the
# other rows' lengths and on max_seq_len, and MKL rounds a column differently for a
# different N (measured 1-8 fp32 ulp, 310 ulp near zero). Fix (validated against these
# tests): fixed-width entry tiles, e.g. nc = 512 always, ``ar`` sized to
# round_up(width, nc), every tile computed in full and its result cut to ``width``.


def _bits(t: torch.Tensor) -> torch.Tensor:
    return W.bits(t)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.float() - b.float()).abs().nan_to_num(nan=float("inf"))
    ulp = (_bits(a).long() - _bits(b).long()).abs()
    return (f"max|diff| {d.max().item():.3g}, max ulp {ulp.max().item()}, "
            f"{int((ulp > 0).sum())} differ")


def _batches(n: int, size: int) -> list[list[int]]:
    return [list(range(s, min(s + size, n))) for s in range(0, n, size)]


# ------------------------------------------------------------------------------------------
# sparse MLA (torch path)
# ------------------------------------------------------------------------------------------
def _mla_caches(gen: torch.Generator, nb: int, bs: int):
    swa = fp8_ds_mla.allocate_cache(nb, bs)
    comp = fp8_ds_mla.allocate_cache(nb, bs)
    fp8_ds_mla.quantize_and_insert((torch.randn(nb * bs, 512, generator=gen) * 0.6)
                                   .to(torch.bfloat16), swa, torch.arange(nb * bs))
    fp8_ds_mla.quantize_and_insert((torch.randn(nb * bs, 512, generator=gen) * 0.6)
                                   .to(torch.bfloat16), comp, torch.arange(nb * bs))
    return swa, comp


def test_sparse_mla_decode_batch_invariant():
    """Decode rows (window + compressed cache, sink, per-row lengths incl. 0 and full,
    -1 holes) alone vs in batches of 2, 5, 24 rows and permuted: out and lse bitwise."""
    gen = torch.Generator().manual_seed(11)
    h, nb, bs, n1, n2, t = 8, 24, 64, 128, 512, 24
    swa, comp = _mla_caches(gen, nb, bs)
    q = (torch.randn(t, 1, h, 512, generator=gen) * 0.5).to(torch.bfloat16)
    wi = torch.randint(0, nb * bs, (t, 1, n1), generator=gen, dtype=torch.int32)
    wl = torch.randint(1, n1 + 1, (t,), generator=gen, dtype=torch.int32)
    ci = torch.randint(0, nb * bs, (t, 1, n2), generator=gen, dtype=torch.int32)
    ci[3, 0, 7::5] = -1
    cl = torch.randint(0, n2 + 1, (t,), generator=gen, dtype=torch.int32)
    cl[0], cl[1], wl[2] = 0, n2, n1
    sink = torch.randn(h, generator=gen)

    def run(rows):
        r = torch.tensor(rows)
        return ops.sparse_mla_decode(q[r], swa, wi[r], wl[r], sink, 512**-0.5, comp, ci[r],
                                     cl[r])

    solo = [run([i]) for i in range(t)]
    so = torch.cat([o for o, _ in solo])
    sl = torch.cat([lse for _, lse in solo])
    for size in (2, 5, t):
        parts = [run(rows) for rows in _batches(t, size)]
        bo = torch.cat([o for o, _ in parts])
        bl = torch.cat([lse for _, lse in parts])
        assert _same(bo, so), f"batch {size}: out {_diff(bo, so)}"
        assert _same(bl, sl), f"batch {size}: lse {_diff(bl, sl)}"
    perm = torch.randperm(t, generator=gen).tolist()
    po, pl = run(perm)
    assert _same(po, so[perm]) and _same(pl, sl[perm]), "permuted batch differs"


def test_sparse_mla_decode_dedup_path_batch_invariant(monkeypatch):
    """A prefill-shaped decode call (>= DEDUP_MIN_ENTRIES entries over shared slots)
    takes the deduplicated path; each of its rows alone takes the entry-wise path. Both
    must give the same bits."""
    gen = torch.Generator().manual_seed(12)
    h, nb, bs, w, k, t = 8, 20, 64, 128, 512, 104  # 104 * 640 >= DEDUP_MIN_ENTRIES
    swa, comp = _mla_caches(gen, nb, bs)
    pos = torch.arange(t) + 2000
    q = (torch.randn(t, 1, h, 512, generator=gen) * 0.5).to(torch.bfloat16)
    wi = ((pos - w + 1)[:, None] + torch.arange(w)).remainder(nb * bs).to(torch.int32)
    wi = wi.unsqueeze(1)
    wl = torch.full((t,), w, dtype=torch.int32)
    ci = torch.randperm(nb * bs, generator=gen)[:k].to(torch.int32).expand(t, 1, k).contiguous()
    cl = torch.randint(300, k + 1, (t,), generator=gen, dtype=torch.int32)
    sink = torch.randn(h, generator=gen)
    assert t * (w + k) >= torch_sparse_mla.DEDUP_MIN_ENTRIES
    taken: list[bool] = []
    real = torch_sparse_mla._decode_deduplicated

    def spy(*a, **kw):
        r = real(*a, **kw)
        taken.append(r)
        return r

    monkeypatch.setattr(torch_sparse_mla, "_decode_deduplicated", spy)

    def run(rows):
        r = torch.tensor(rows)
        return ops.sparse_mla_decode(q[r], swa, wi[r], wl[r], sink, 512**-0.5, comp, ci[r],
                                     cl[r])

    solo = [run([i]) for i in range(t)]
    assert taken == [], "a single row must take the entry-wise path"
    bo, bl = run(list(range(t)))
    assert taken == [True], "the whole prompt must take the deduplicated path"
    so = torch.cat([o for o, _ in solo])
    sl = torch.cat([lse for _, lse in solo])
    assert _same(bo, so), f"dedup vs entry-wise out: {_diff(bo, so)}"
    assert _same(bl, sl), f"dedup vs entry-wise lse: {_diff(bl, sl)}"


def test_sparse_mla_prefill_batch_and_chunk_invariant():
    """Prefill rows alone, in batches, and a prompt split across two calls at every
    tested point (chunked prefill): out, max_logits and lse bitwise."""
    gen = torch.Generator().manual_seed(13)
    h, s_kv, topk, t = 8, 600, 256, 40
    kv = (torch.randn(s_kv, 1, 512, generator=gen) * 0.6).to(torch.bfloat16)
    q = (torch.randn(t, h, 512, generator=gen) * 0.5).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (t, 1, topk), generator=gen, dtype=torch.int32)
    idx[::3, 0, 100:] = -1
    lens = torch.randint(0, topk + 1, (t,), generator=gen, dtype=torch.int32)
    sink = torch.randn(h, generator=gen)

    def run(rows):
        r = torch.tensor(rows)
        return ops.sparse_mla_prefill(q[r], kv, idx[r], 512**-0.5, sink, lens[r])

    solo = [run([i]) for i in range(t)]
    ref = [torch.cat([s[j] for s in solo]) for j in range(3)]
    for size in (3, 16, t):
        parts = [run(rows) for rows in _batches(t, size)]
        for j, name in enumerate(("out", "max_logits", "lse")):
            got = torch.cat([p[j] for p in parts])
            assert _same(got, ref[j]), f"batch {size}: {name} {_diff(got, ref[j])}"
    for cut in (1, 17, t - 1):
        a, b = run(list(range(cut))), run(list(range(cut, t)))
        for j in range(3):
            assert _same(torch.cat([a[j], b[j]]), ref[j]), f"chunked at {cut}"


# ops/torch_sparse_mla.py used to reduce the index axis as one segment of the call's full
# width (seg = width whenever it fits the 32 MiB budget), so torch.sum(s, -1) and
# bmm(s, k) reduced over a K that grew with -1 padding: out / lse moved by ~1 bf16 / fp32
# ulp (this test failed on an AVX512 Xeon with MKL 2024.2). That matters to a caller padding
# rows to the batch's widest (a C128 table padded to an adaptive width,
# as vLLM's FlashMLA metadata does); the plugin's CPU layer passes fixed widths. Now every
# GEMM and sum of a row runs over fixed 128-column segments counted from each list's own
# column 0 (the last one padded with invalid columns), and 512-column groups with no valid
# entry are skipped, exactly. Whether BLAS rounds a wider reduction differently depends on
# the CPU, so on some machines the old code passed this test too.
def test_sparse_mla_padding_width_invariant():
    """The same rows with their index lists padded by -1 to a wider (batch-wide) width."""
    gen = torch.Generator().manual_seed(14)
    h, nb, bs, t = 8, 40, 64, 16
    swa, comp = _mla_caches(gen, nb, bs)
    q = (torch.randn(t, 1, h, 512, generator=gen) * 0.5).to(torch.bfloat16)
    wi = torch.randint(0, nb * bs, (t, 1, 128), generator=gen, dtype=torch.int32)
    wl = torch.full((t,), 128, dtype=torch.int32)
    sink = torch.randn(h, generator=gen)
    problems = []
    for n, pad in ((3, 125), (40, 88), (77, 200), (130, 300), (300, 500)):
        ci = torch.randint(0, nb * bs, (t, 1, n), generator=gen, dtype=torch.int32)
        ro, rl = ops.sparse_mla_decode(q, swa, wi, wl, sink, 0.04, comp, ci, None)
        cp = torch.cat([ci, torch.full((t, 1, pad), -1, dtype=torch.int32)], -1)
        po, pl = ops.sparse_mla_decode(q, swa, wi, wl, sink, 0.04, comp, cp, None)
        if not _same(po, ro):
            problems.append(f"width {n}->{n + pad}: out {_diff(po, ro)}")
        if not _same(pl, rl):
            problems.append(f"width {n}->{n + pad}: lse {_diff(pl, rl)}")
    print("\n".join(problems))
    assert not problems, problems


def test_sparse_mla_mixed_widths_padded_batch_invariant() -> None:
    """Rows of different widths, each alone at its own width, vs all together with both
    index lists padded by -1 to the batch's widest (crossing segment and 512-column group
    boundaries, so a row meets groups that hold no valid entry of its own), vs the same
    padded batch under a tiny scratch budget (1-row chunks): decode out / lse and prefill
    out / max_logits / lse bitwise."""
    gen = torch.Generator().manual_seed(15)
    h, nb, bs = 8, 40, 64
    swa, comp = _mla_caches(gen, nb, bs)
    wn = [1, 60, 128, 128, 97, 128, 5, 128, 128]  # window list widths
    cn = [0, 3, 128, 130, 511, 512, 513, 700, 1100]  # compressed list widths
    t = len(wn)
    q = (torch.randn(t, 1, h, 512, generator=gen) * 0.5).to(torch.bfloat16)
    sink = torch.randn(h, generator=gen)
    wrows = [torch.randint(0, nb * bs, (n,), generator=gen, dtype=torch.int32) for n in wn]
    crows = [torch.randint(0, nb * bs, (n,), generator=gen, dtype=torch.int32) for n in cn]
    crows[4][::7] = -1  # holes inside a row stay holes

    def padded(rows, width):
        out = torch.full((len(rows), 1, width), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            out[i, 0, : r.numel()] = r
        return out

    solo = [ops.sparse_mla_decode(q[i : i + 1], swa, wrows[i].view(1, 1, -1), None, sink,
                                  0.04, comp, crows[i].view(1, 1, -1), None)
            for i in range(t)]
    so = torch.cat([o for o, _ in solo])
    sl = torch.cat([lse for _, lse in solo])
    wi, ci = padded(wrows, 300), padded(crows, 1300)
    problems = []
    bo, bl = ops.sparse_mla_decode(q, swa, wi, None, sink, 0.04, comp, ci, None)
    to, tl = ops.sparse_mla_decode(q, swa, wi, None, sink, 0.04, comp, ci, None, budget_bytes=1)
    for label, o, lse in (("padded batch", bo, bl), ("padded, tiny budget", to, tl)):
        if not _same(o, so):
            problems.append(f"decode {label}: out {_diff(o, so)}")
        if not _same(lse, sl):
            problems.append(f"decode {label}: lse {_diff(lse, sl)}")

    # Prefill: the same, with invalid padding written three ways (-1, >= s_kv, past the
    # row's topk_length).
    s_kv = 900
    kv = (torch.randn(s_kv, 1, 512, generator=gen) * 0.6).to(torch.bfloat16)
    pq = q[:, 0]
    prow = [torch.randint(0, s_kv, (n,), generator=gen, dtype=torch.int32) for n in cn]
    ref = [ops.sparse_mla_prefill(pq[i : i + 1], kv, prow[i].view(1, 1, -1), 0.04, sink)
           for i in range(t)]
    ref = [torch.cat([r[j] for r in ref]) for j in range(3)]
    pidx = padded(prow, 1300)
    pidx[1::3, 0, -50:] = s_kv  # out of range: invalid like -1
    lens = torch.tensor(cn, dtype=torch.int32)
    pidx[2::3, 0, 1200:] = 0  # past topk_length: never read
    for label, got in (
        ("padded batch", ops.sparse_mla_prefill(pq, kv, pidx, 0.04, sink, lens)),
        ("padded, tiny budget", ops.sparse_mla_prefill(pq, kv, pidx, 0.04, sink, lens,
                                                       budget_bytes=1)),
    ):
        for j, name in enumerate(("out", "max_logits", "lse")):
            if not _same(got[j], ref[j]):
                problems.append(f"prefill {label}: {name} {_diff(got[j], ref[j])}")
    print("\n".join(problems))
    assert not problems, problems


# ------------------------------------------------------------------------------------------
# lightning indexer (torch path)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_indexer_q_quant_batch_invariant(dtype):
    gen = torch.Generator().manual_seed(21)
    t = 70  # > one internal token chunk (32 tokens of 64 x 128)
    q = torch.randn(t, 64, 128, generator=gen).to(torch.bfloat16)
    q[5] = 0.0
    w = torch.randn(t, 64, generator=gen).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), generator=gen)
    cs = W.cos_sin_cache()

    def run(rows):
        r = torch.tensor(rows)
        return indexer_ops.indexer_q_rope_quant(q[r], pos[r], cs, w[r], softmax_scale=128**-0.5,
                                                head_scale=64**-0.5, dtype=dtype)

    solo = [run([i]) for i in range(t)]
    for size in (3, 33, t):
        parts = [run(rows) for rows in _batches(t, size)]
        for j, name in enumerate(("q", "q_scale", "weights")):
            if solo[0][j] is None:
                continue
            ref = torch.cat([s[j] for s in solo])
            got = torch.cat([p[j] for p in parts])
            assert _same(got, ref), f"{dtype} batch {size}: {name} differs"


def _indexer_setup(dtype: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    nb, bs, r, maxb, t = 64, 64, 4, 16, 40
    kc = torch.full((nb, bs, ic.entry_bytes(dtype)), 0xFF, dtype=torch.uint8)
    ic.quantize_and_insert(torch.randn(nb * bs, 128, generator=gen).to(torch.bfloat16), kc,
                           torch.arange(nb * bs), dtype)
    bt = torch.stack([torch.randperm(nb, generator=gen)[:maxb] for _ in range(r)]).int()
    t2r = torch.randint(0, r, (t,), generator=gen)
    pos = torch.randint(0, maxb * bs * 4, (t,), generator=gen)
    pos[:10] = torch.arange(2040, 2050)  # one request's prefill chunk
    t2r[:10] = 0
    vis = torch.div(pos + 1, 4, rounding_mode="floor")
    q = torch.randn(t, 64, 128, generator=gen).to(torch.bfloat16)
    w = torch.randn(t, 64, generator=gen)
    iq = indexer_ops.indexer_q_rope_quant(q, pos, W.cos_sin_cache(maxb * bs * 4 + 1), w,
                                          softmax_scale=128**-0.5, head_scale=64**-0.5,
                                          dtype=dtype)
    return kc, bt, t2r, vis, iq


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_indexer_logits_batch_invariant(dtype):
    """Logits of a row (its first ``visible`` columns) alone vs in a mixed batch, in one
    request's prefill chunk (the shared-row GEMM), and alone with a wider max_seq_len."""
    kc, bt, t2r, vis, iq = _indexer_setup(dtype, 22)
    t = vis.numel()

    def run(rows, width=None):
        r = torch.tensor(rows)
        return indexer_ops.indexer_logits(
            iq.q[r], None if iq.q_scale is None else iq.q_scale[r], iq.weights[r], kc, vis[r],
            bt, dtype=dtype, token_to_req=t2r[r], max_seq_len=width)

    solo = [run([i])[0, : int(vis[i])] for i in range(t)]
    problems = []
    for label, rows, width in (("mixed batch", list(range(t)), None),
                               ("one request's chunk", list(range(10)), None),
                               ("alone, width 4096", [3], 4096)):
        got = run(rows, width)
        for j, i in enumerate(rows):
            a = got[j, : int(vis[i])]
            if not _same(a, solo[i]):
                problems.append(f"{label}: row {i} (visible {int(vis[i])}): {_diff(a, solo[i])}")
    print(f"{dtype}: {len(problems)} rows differ\n" + "\n".join(problems[:10]))
    assert not problems, problems[:5]


def test_indexer_topk_batch_invariant():
    """Given the same logits rows (tie-heavy, -inf runs, signed zeros), the causal top-k
    of a row is the same alone (its own width) as in a batch padded to the widest row."""
    gen = torch.Generator().manual_seed(23)
    t, width = 16, 1500
    logits = (torch.randint(-6, 7, (t, width), generator=gen).float() / 4)
    logits[1, ::3] = float("-inf")
    logits[2] = 0.0
    logits[3, ::2] = -0.0
    logits[4] += torch.randn(width, generator=gen) * 1e-3
    lens = torch.randint(513, width + 1, (t,), generator=gen)
    lens[5], lens[6], lens[7], lens[8] = 0, 7, 512, 513
    solo = []
    for i in range(t):
        n = max(int(lens[i]), 1)
        row = logits[i : i + 1, :n].clone()
        solo.append(indexer_ops.indexer_topk(row, None, 512, seq_lens=lens[i : i + 1])[0])
    for size in (4, t):
        for rows in _batches(t, size):
            r = torch.tensor(rows)
            wide = torch.full((len(rows), width + 300), float("nan"))
            wide[:, :width] = logits[r]
            for j, i in enumerate(rows):  # past a row's length: garbage, never read
                wide[j, int(lens[i]):] = float("nan")
            got = indexer_ops.indexer_topk(wide, None, 512, seq_lens=lens[r])
            for j, i in enumerate(rows):
                assert torch.equal(got[j], solo[i]), f"batch {size}: row {i} top-k differs"


# ------------------------------------------------------------------------------------------
# the eager step: decode-only, prefill-only, mixed, chunked prefill
# ------------------------------------------------------------------------------------------
# The work and its schedules: tests.support.bi_world (tests/vllm runs the same).
REQUESTS, SCHEDULES = W.REQUESTS, W.SCHEDULES


@pytest.fixture(scope="module", params=["fp8", "mxfp4"])
def step_runs(request):
    """Every schedule of REQUESTS, and the solo run, on the torch ops."""
    dtype = request.param
    # One intra-op thread: with OpenMP on a loaded 2-core box every tiny op of a solo step
    # pays a barrier (20x slower); the op-level tests above run at the default count.
    with one_thread():
        world = W.make_world(REQUESTS, dtype, seed=5)
        opsx = W.StepOps()
        solo = W.run_schedule(world, W.solo_schedule(world), opsx)
        runs = {name: W.run_schedule(world, s, opsx) for name, s in SCHEDULES.items()}
    return dtype, solo, runs


def test_schedules_cover_the_same_work():
    want = sorted((r, p) for r, (pre, n) in enumerate(REQUESTS) for p in range(pre, pre + n))
    for name, sched in SCHEDULES.items():
        got = sorted(t for s in sched for t in s)
        assert got == want, name
        for r in range(len(REQUESTS)):  # each request's tokens in order
            seq = [p for s in sched for rr, p in s if rr == r]
            assert seq == sorted(seq), (name, r)


def _without(outs: dict, names: tuple[str, ...]) -> dict:
    return {k: {n: v for n, v in row.items() if n not in names} for k, row in outs.items()}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_eager_step_batch_invariant(step_runs, schedule):
    """Attention output, padded q, indexer q bytes + weights, top-k (local ids in order,
    global slots, lengths) of every token, and every cache byte at the end: the schedule
    equals every token run alone, bit for bit. No output holds NaN (the caches are
    poisoned outside the valid region)."""
    dtype, (solo, solo_caches), runs = step_runs
    outs, caches = runs[schedule]
    problems = W.compare(_without(solo, ("logits",)), _without(outs, ("logits",)),
                         f"{dtype} {schedule}")
    for name, ref in solo_caches.items():
        if not torch.equal(caches[name], ref):
            problems.append(f"{dtype} {schedule}: cache {name}: "
                            f"{int((caches[name] != ref).sum())} bytes differ")
    assert not problems, "\n".join(problems[:20])
    for key, row in outs.items():
        assert not torch.isnan(row["out"].float()).any(), f"NaN in out of {key}"
    # The top-k really took both branches: identity fill and indexer ranking.
    assert int(solo[(0, 2050)]["topk_lens"]) == 512 and "logits" not in solo[(0, 2050)]
    assert "logits" in solo[(0, 2059)] and int(solo[(3, 1)]["topk_lens"]) == 0


def test_eager_step_indexer_logits_batch_invariant(step_runs):
    """The indexer logits select_topk_c4 ranks (first ``visible`` columns of each row),
    in every schedule, vs the token run alone (where both ran the indexer)."""
    dtype, (solo, _), runs = step_runs
    problems = []
    for name, (outs, _) in runs.items():
        for key, row in solo.items():
            if "logits" in row and "logits" in outs[key]:
                a, b = row["logits"], outs[key]["logits"]
                if not _same(a, b):
                    problems.append(f"{dtype} {name} {key}: {_diff(b, a)}")
    print("\n".join(problems))
    assert not problems, problems[:5]
