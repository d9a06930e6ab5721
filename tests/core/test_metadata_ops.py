# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Torch metadata ports vs scalar transliterations of vLLM 0.32's Triton kernels.

Each ``_ref_*`` below is a line-by-line scalar rewrite of one Triton program
(``vllm/v1/attention/ops/metadata.py``, ``.../mla/compressor_utils.py``,
``.../mla/indexer.py``, ``.../mla/sparse_swa.py``,
``vllm/models/deepseek_v4/sparse_mla.py``): one Python loop iteration per
``tl.program_id``, C semantics for integer ``//`` and ``%``, masked stores
skipped. Output buffers are poisoned with a sentinel first, so an element the
port writes but the kernel does not (or vice versa) fails the comparison.
Batches are random: zero-length (padding) requests, -1 slots, padded tokens
past the last request, chunked-prefill prefixes, query slices, replay starts.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_dsv4_backend.ops import metadata as md

POISON = 0x5A5A5
SEEDS = list(range(12))


# ----------------------------------------------------------------------------
# C-semantics integer helpers (what Triton does on i32/i64)
# ----------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def cmod(a: int, b: int) -> int:
    return a - cdiv(a, b) * b


def poisoned(shape, dtype=torch.int32) -> torch.Tensor:
    return torch.full((shape,) if isinstance(shape, int) else shape, POISON, dtype=dtype)


# ----------------------------------------------------------------------------
# random batches
# ----------------------------------------------------------------------------
def make_batch(rng: random.Random, *, block_size: int, max_reqs: int = 6, max_q: int = 40):
    """Requests with random prefixes and query lengths (some zero-length)."""
    num_reqs = rng.randint(1, max_reqs)
    q_lens, prefixes = [], []
    for _ in range(num_reqs):
        kind = rng.random()
        if kind < 0.15:
            q_lens.append(0)  # padding request
        elif kind < 0.5:
            q_lens.append(1)  # decode
        else:
            q_lens.append(rng.randint(2, max_q))
        prefixes.append(rng.choice([0, rng.randint(0, 700)]))
    seq_lens = [p + q for p, q in zip(prefixes, q_lens)]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    max_blocks = max(1, max(-(-s // block_size) for s in seq_lens) + 1)
    ids = list(range(num_reqs * max_blocks * 2))
    rng.shuffle(ids)
    block_table = torch.tensor(ids[: num_reqs * max_blocks], dtype=torch.int32).view(
        num_reqs, max_blocks
    )
    return qsl, seq_lens, block_table


def slot_mapping_for(rng: random.Random, qsl, seq_lens, block_table, block_size, extra=0):
    """Token slots (int64) with some -1 (replayed tokens) and ``extra`` -1 pads."""
    slots = []
    for r in range(len(seq_lens)):
        q = qsl[r + 1] - qsl[r]
        start = seq_lens[r] - q
        for i in range(q):
            pos = start + i
            if rng.random() < 0.15:
                slots.append(-1)
            else:
                slots.append(int(block_table[r, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * extra
    return torch.tensor(slots, dtype=torch.int64)


# ----------------------------------------------------------------------------
# T1
# ----------------------------------------------------------------------------
def _ref_token_to_req(qsl, out, num_mapped, num_tokens):
    num_reqs = len(qsl) - 1
    for token in range(num_tokens):
        lo, hi = 0, num_reqs
        while lo < hi:
            mid = (lo + hi) // 2
            end = qsl[mid + 1] if mid < num_reqs else 0x7FFFFFFF
            if end <= token:
                lo = mid + 1
            else:
                hi = mid
        req = min(lo, num_reqs - 1)
        out[token] = req if token < num_mapped else 0


@pytest.mark.parametrize("seed", SEEDS)
def test_token_to_req_indices(seed):
    rng = random.Random(seed)
    qsl, _, _ = make_batch(rng, block_size=64)
    num_mapped = qsl[-1] + rng.choice([0, 0, 3])  # padded tokens past the last request
    num_tokens = num_mapped + rng.choice([0, 5])
    out = poisoned(num_tokens + 7)
    ref = out.clone()
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    got = md.compute_token_to_req_indices(qsl_t, out, num_mapped, num_tokens)
    ref_l = ref.tolist()
    _ref_token_to_req(qsl, ref_l, num_mapped, num_tokens)
    assert got.shape[0] == num_tokens
    assert num_tokens == 0 or got.data_ptr() == out.data_ptr()
    assert out.tolist() == ref_l


def test_token_to_req_indices_edges():
    out = poisoned(8)
    md.compute_token_to_req_indices(torch.tensor([0], dtype=torch.int32), out, 0, 4)
    assert out.tolist()[:4] == [0, 0, 0, 0] and out[4] == POISON
    # All-padding tail requests: tokens in [qsl[-1], num_mapped) go to R - 1.
    qsl = torch.tensor([0, 2, 2, 5, 5], dtype=torch.int32)
    out = poisoned(8)
    md.compute_token_to_req_indices(qsl, out, 7, 8)
    assert out.tolist() == [0, 0, 2, 2, 2, 3, 3, 0]


# ----------------------------------------------------------------------------
# T2
# ----------------------------------------------------------------------------
def _ref_compressed_slot_mapping(out, slot_mapping, qsl, seq_lens, bt, bs, cr, world, ci):
    for b in range(len(bt)):
        qs, qe = qsl[b], qsl[b + 1]
        start_pos = seq_lens[b] - (qe - qs)
        for off in range(qe - qs):
            pos = start_pos + off
            slot = slot_mapping[qs + off]
            valid = cmod(pos + 1, cr) == 0 and slot != -1
            local = cdiv(pos, ci * world) * ci + cmod(pos, ci)
            pac = cdiv(local, cr)
            sid = bt[b][cdiv(pac, bs)] * bs + cmod(pac, bs) if valid else -1
            if qs + off < len(out):
                out[qs + off] = sid


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ratio", [4, 128])
def test_compressed_slot_mapping(seed, ratio):
    rng = random.Random(seed * 7 + ratio)
    bs = 256 // ratio
    world, ci = rng.choice([(1, 1), (1, 1), (2, ratio), (4, 2 * ratio)])
    qsl, seq_lens, bt = make_batch(rng, block_size=bs * ratio)
    sm = slot_mapping_for(rng, qsl, seq_lens, bt, 256, extra=rng.choice([0, 4]))
    n = sm.shape[0]
    out = poisoned(n, torch.int64)
    ref = out.tolist()
    md.compressed_slot_mapping(
        out, sm, torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
        bt, bs, ratio, world, ci,
    )
    _ref_compressed_slot_mapping(ref, sm.tolist(), qsl, seq_lens, bt.tolist(), bs, ratio, world, ci)
    assert out.tolist() == ref
    # The padded tail (past the last request) is never written by the kernel.
    assert all(v == POISON for v in out.tolist()[qsl[-1]:])


def test_compressed_slot_mapping_view_truncates_like_caller():
    """The caller passes ``out[:num_tokens]``; writes past it are dropped."""
    qsl = torch.tensor([0, 8], dtype=torch.int32)
    seq = torch.tensor([8], dtype=torch.int32)
    bt = torch.tensor([[3, 9]], dtype=torch.int32)
    sm = torch.arange(8, dtype=torch.int64)
    buf = poisoned(8, torch.int64)
    md.compressed_slot_mapping(buf[:5], sm, qsl, seq, bt, 64, 4)
    assert buf.tolist() == [-1, -1, -1, 3 * 64 + 0, -1, POISON, POISON, POISON]


# ----------------------------------------------------------------------------
# T3
# ----------------------------------------------------------------------------
def _ref_prefill_chunk(qsl, useq, cu, row_start, tts, ks, ke, qs0, qs1, rank, world, inter,
                       num_reqs, cr):
    for b in range(num_reqs):
        qs, qe = qsl[b], qsl[b + 1]
        seq_start, seq_end = cu[b], cu[b + 1]
        rs = row_start[b]
        start_pos = useq[b] - (qe - qs)
        for off in range(qe - qs):
            abs_pos = qs + off
            if not (qs0 <= abs_pos < qs1):
                continue
            out_pos = abs_pos - qs0
            ks[out_pos] = rs
            length = cdiv(start_pos + 1 + off, cr)
            if world > 1:
                base = cdiv(cdiv(length, inter), world) * inter
                rem = length - base * world
                rem = min(max(rem - rank * inter, 0), inter)
                length = base + rem
            ke[out_pos] = rs + length
        for i in range(seq_end - seq_start):
            if seq_start + i < len(tts):
                tts[seq_start + i] = b


@pytest.mark.parametrize("seed", SEEDS)
def test_build_prefill_chunk_metadata(seed):
    rng = random.Random(seed + 100)
    cr = 4
    qsl, useq, _ = make_batch(rng, block_size=256, max_q=60)
    num_reqs = len(useq)
    comp = [s // cr for s in useq]
    cu = [0]
    for c in comp:
        cu.append(cu[-1] + c)
    total_q = qsl[-1]
    qs0 = rng.randint(0, total_q)
    qs1 = rng.randint(qs0, total_q)
    rank, world, inter = rng.choice([(0, 1, 1), (0, 1, 1), (1, 2, 1), (2, 4, 16)])
    row_start = cu[:-1] if world == 1 else [rng.randint(0, 500) for _ in range(num_reqs)]
    tts = poisoned(cu[-1])
    ks, ke = poisoned(qs1 - qs0), poisoned(qs1 - qs0)
    r_tts, r_ks, r_ke = tts.tolist(), ks.tolist(), ke.tolist()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    md.build_prefill_chunk_metadata(
        i32(qsl), i32(useq), i32(cu), i32(row_start), tts, ks, ke, qs0, qs1, rank, world,
        inter, num_reqs=num_reqs, COMPRESS_RATIO=cr,
    )
    _ref_prefill_chunk(qsl, useq, cu, row_start, r_tts, r_ks, r_ke, qs0, qs1, rank, world,
                       inter, num_reqs, cr)
    assert tts.tolist() == r_tts
    assert ks.tolist() == r_ks
    assert ke.tolist() == r_ke


# ----------------------------------------------------------------------------
# T4 (+ DSpark)
# ----------------------------------------------------------------------------
def _ref_swa(idx_rows, lens, W, width, lv, rv, qsl, seq_lens, t2r, valid, bt, bs, replay,
             num_tokens, token_offset, has_image, dspark=False):
    for pid in range(num_tokens):
        tok = pid + token_offset
        if not valid[tok]:
            lens[pid] = 0
            for i in range(width):
                idx_rows[pid][i] = -1
            continue
        r = t2r[tok]
        qs, qe = qsl[r], qsl[r + 1]
        prefix = seq_lens[r] - (qe - qs)
        if dspark:
            start = max(prefix - W, 0)
            end = seq_lens[r]
        else:
            pos = prefix + tok - qs
            left = lv[tok] if has_image else 0
            right = rv[tok] if has_image else 0
            left_add = max(left - (W - 1), 0)
            start = max(pos - (W - 1) - left_add, 0)
            start = max(start, replay[r])
            end = pos + right + 1
        length = end - start
        lens[pid] = length
        for i in range(width):
            p = start + i
            idx_rows[pid][i] = bt[r][cdiv(p, bs)] * bs + cmod(p, bs) if i < length else -1


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["decode", "prefill", "image", "dspark"])
def test_swa_indices_and_lens(seed, mode):
    rng = random.Random(seed * 13 + len(mode))
    W, bs = 16, 8  # small window/blocks so windows cross block boundaries
    qsl, seq_lens, bt = make_batch(rng, block_size=bs)
    num_reqs = len(seq_lens)
    n_all = qsl[-1] + rng.choice([0, 3])  # padded tokens at the end
    t2r = poisoned(n_all)
    md.compute_token_to_req_indices(torch.tensor(qsl, dtype=torch.int32), t2r, qsl[-1], n_all)
    valid = [rng.random() > 0.1 for _ in range(n_all)]
    for t in range(qsl[-1], n_all):
        valid[t] = False
    if n_all == 0:
        pytest.skip("empty batch")
    token_offset = rng.randint(0, n_all - 1) if mode != "decode" else 0
    num_tokens = rng.randint(1, n_all - token_offset)
    width = W + (6 if mode == "image" else 0) + (8 if mode == "dspark" else 0)
    replay = [rng.choice([0, 0, rng.randint(0, 600)]) for _ in range(num_reqs)]
    lv = [rng.randint(0, 30) for _ in range(n_all)]
    rv = [rng.randint(0, 6) for _ in range(n_all)]
    swa = poisoned((n_all + 2, 1, width + 3))
    lens = poisoned(n_all + 2)
    r_rows = swa.view(swa.shape[0], -1).tolist()
    r_lens = lens.tolist()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    valid_t = torch.tensor(valid, dtype=torch.bool)
    if mode == "dspark":
        md.dspark_noncausal_swa_indices(
            swa, lens, W, width, i32(qsl), i32(seq_lens), t2r, valid_t, bt, bs,
            num_tokens=num_tokens, token_offset=token_offset,
        )
    else:
        md.swa_indices_and_lens(
            swa, lens, W, width, i32(lv), i32(rv), i32(qsl), i32(seq_lens), t2r, valid_t, bt,
            bs, i32(replay), num_tokens=num_tokens, token_offset=token_offset,
            has_image=mode == "image",
        )
    _ref_swa(r_rows, r_lens, W, width, lv, rv, qsl, seq_lens, t2r.tolist(), valid, bt.tolist(),
             bs, replay, num_tokens, token_offset, mode == "image", dspark=mode == "dspark")
    assert lens.tolist() == r_lens
    assert swa.view(swa.shape[0], -1).tolist() == r_rows


# ----------------------------------------------------------------------------
# T5
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_prefill_gather_lens(seed):
    rng = random.Random(seed + 300)
    qsl, seq_lens, _ = make_batch(rng, block_size=256)
    num_reqs = len(seq_lens)
    num_decodes = rng.randint(0, num_reqs)
    num_prefills = num_reqs - num_decodes
    W = 128
    replay = [rng.choice([0, rng.randint(0, 800)]) for _ in range(num_reqs)]
    out = poisoned(num_prefills + 2)
    ref = out.tolist()
    for i in range(num_prefills):
        r = num_decodes + i
        q = qsl[r + 1] - qsl[r]
        prefix = seq_lens[r] - q
        ref[i] = q + min(max(prefix - replay[r], 0), W - 1)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    md.prefill_gather_lens(out, i32(seq_lens), i32(qsl), i32(replay), num_prefills,
                           num_decodes, W)
    assert out.tolist() == ref


# ----------------------------------------------------------------------------
# C128A
# ----------------------------------------------------------------------------
def _ref_c128a(gd, dl, pf, positions, cr, maxc, nd, t2r, bt, bs, sm):
    for t in range(len(positions)):
        nc = min(cdiv(positions[t] + 1, cr), maxc)
        if t < nd:
            ok = sm[t] >= 0
            r = t2r[t]
            count = 0
            for off in range(maxc):
                if off < nc:
                    gd[t][off] = bt[r][cdiv(off, bs)] * bs + cmod(off, bs)
                    count += 1
                else:
                    gd[t][off] = -1
            dl[t] = count if ok else 0
        else:
            for off in range(maxc):
                pf[t - nd][off] = off if off < nc else -1


@pytest.mark.parametrize("seed", SEEDS)
def test_build_c128a_topk_metadata(seed):
    rng = random.Random(seed + 500)
    cr, bs = 128, 2
    qsl, seq_lens, bt = make_batch(rng, block_size=bs * cr)
    for r in range(len(seq_lens)):  # long prefixes so C128 entries exist
        seq_lens[r] += rng.choice([0, 1000, 3000])
    bt = torch.randint(0, 1000, (len(seq_lens), 40), dtype=torch.int32,
                       generator=torch.Generator().manual_seed(seed))
    positions = []
    for r in range(len(seq_lens)):
        q = qsl[r + 1] - qsl[r]
        positions += [seq_lens[r] - q + i for i in range(q)]
    n = len(positions)
    nd = rng.randint(0, n)
    t2r = poisoned(n)
    md.compute_token_to_req_indices(torch.tensor(qsl, dtype=torch.int32), t2r, n, n)
    sm = torch.tensor([rng.choice([-1, 5, 9]) for _ in range(n)], dtype=torch.int64)
    maxc = rng.choice([32, 64])  # smaller than some n_comp: exercises the clamp
    gd, dl, pf = poisoned((n + 1, maxc + 5)), poisoned(n + 1), poisoned((n + 1, maxc + 5))
    r_gd, r_dl, r_pf = gd.tolist(), dl.tolist(), pf.tolist()
    md.build_c128a_topk_metadata(gd, dl, pf, torch.tensor(positions, dtype=torch.int64), cr,
                                 maxc, nd, t2r, bt, bs, sm)
    _ref_c128a(r_gd, r_dl, r_pf, positions, cr, maxc, nd, t2r.tolist(), bt.tolist(), bs,
               sm.tolist())
    assert gd.tolist() == r_gd
    assert dl.tolist() == r_dl
    assert pf.tolist() == r_pf


# ----------------------------------------------------------------------------
# uniform decode
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS[:6])
@pytest.mark.parametrize("mdl", [1, 2, 3])
def test_prepare_uniform_decode(seed, mdl):
    rng = random.Random(seed + 700 + mdl)
    num_reqs = rng.randint(1, 6)
    seq = [rng.choice([0, 1, rng.randint(1, 900)]) for _ in range(num_reqs)]  # 0: padding
    bt = torch.randint(0, 500, (num_reqs, 9), dtype=torch.int32,
                       generator=torch.Generator().manual_seed(seed))
    n = num_reqs * mdl
    dsl, ebt, dl = poisoned(n + 3), poisoned((n + 3, 7)), poisoned(n + 3)
    r_dsl, r_ebt, r_dl = dsl.tolist(), ebt.tolist(), dl.tolist()
    for idx in range(n):
        req, local = idx // mdl, idx % mdl
        r_dsl[idx] = max(seq[req] - mdl + local + 1, 0)
        r_ebt[idx] = bt[req, :7].tolist()
        r_dl[idx] = 1
    md.prepare_uniform_decode(torch.tensor(seq, dtype=torch.int32), dsl, bt, ebt, dl, n, mdl)
    assert dsl.tolist() == r_dsl and ebt.tolist() == r_ebt and dl.tolist() == r_dl


# ----------------------------------------------------------------------------
# argument checking
# ----------------------------------------------------------------------------
def test_bad_arguments_raise_value_error_naming_the_argument():
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        md.compute_token_to_req_indices(qsl.float(), torch.zeros(3, dtype=torch.int32), 3, 3)
    with pytest.raises(ValueError, match="out"):
        md.compute_token_to_req_indices(qsl, torch.zeros(2, dtype=torch.int32), 3, 3)
    with pytest.raises(ValueError, match="block_table"):
        md.compressed_slot_mapping(
            torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), qsl,
            torch.tensor([3], dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 64, 4,
        )
    with pytest.raises(ValueError, match="compress_ratio"):
        md.compressed_slot_mapping(
            torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), qsl,
            torch.tensor([3], dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 64, 0,
        )
    # swa_indices_and_lens with a too-short swa_indices, then an int32 is_valid_token.
    for rows, valid_dtype, match in ((1, torch.bool, "swa_indices"),
                                     (3, torch.int32, "is_valid_token")):
        with pytest.raises(ValueError, match=match):
            md.swa_indices_and_lens(
                torch.zeros(rows, 1, 4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                4, 4, qsl, qsl, qsl, torch.tensor([3], dtype=torch.int32),
                torch.zeros(3, dtype=torch.int32), torch.ones(3, dtype=valid_dtype),
                torch.zeros(1, 2, dtype=torch.int32), 4, torch.zeros(1, dtype=torch.int32),
                num_tokens=3, token_offset=0,
            )
    with pytest.raises(ValueError, match="block_table"):
        md.prepare_uniform_decode(
            torch.ones(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
            torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 5, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32), 2, 1,
        )


def test_module_is_torch_only():
    import subprocess
    import sys

    code = (
        "import sys, vllm_dsv4_backend.ops.metadata; "
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
