# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer tests of tests/core/test_indexer.py that compare with vLLM's C++ CPU kernels
(``torch.ops._C.*_cpu``), kept here so tests/core stays torch-only.

The cases come from tests.support.indexer (tests/core/test_indexer.py builds its cases
with it too). The kernels exist only in vLLM's AVX512-BF16 ``_C`` library; on other CPUs
(or where the plugin registered its torch fallbacks under the same names) these tests skip.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tests.support.indexer import (  # noqa: E402
    PagedCase,
    fr_list,
    make_cache,
    oracle_rope_row,
    q_inputs,
)
from vllm_dsv4_backend.formats import indexer_cache as ic  # noqa: E402
from vllm_dsv4_backend.ops import indexer as ix  # noqa: E402


def _vllm_op(name: str) -> Any:
    """vLLM's real C++ kernel ``name``, the oracle of these tests. It exists only in vLLM's
    AVX512-BF16 CPU library, so on AVX2 machines the tests skip (a platform skip, like a
    GPU-only test on CPU); on AVX512-BF16/AMX machines (this project's CI runs on both)
    they run and can fail. The torch fallbacks are checked everywhere against the recorded
    C++ outputs instead (tests/core/test_golden_kernels.py)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    op = getattr(torch.ops._C, name, None)
    if op is None:
        pytest.skip(f"torch.ops._C.{name} is not in this vLLM build (AVX512 _C library only)")
    # The plugin registers torch fallbacks (built on these very ops) under the same
    # names on CPUs without the AVX512 library: comparing against them proves nothing.
    if getattr(op, "__vllm_dsv4_fallback__", False):
        pytest.skip(f"torch.ops._C.{name} is the plugin's torch fallback, not vLLM's kernel")
    return op


# ---------------------------------------------------------------------------
# formats.indexer_cache writer
# ---------------------------------------------------------------------------
@pytest.mark.vllm
def test_vllm_cpu_indexer_writer_byte_parity():
    """``compress_norm_rope_store_indexer_cpu`` vs the same entry inserted here.

    The state is built so the pooling and RMSNorm are exact in float32 (equal
    scores, dyadic kv), which leaves RoPE (FMA), the bf16 rounding and the
    FP8 quantization to compare byte for byte.
    """
    op = _vllm_op("compress_norm_rope_store_indexer_cpu")
    ratio, width, hd = 4, 8, 128  # C4: overlapping window of 8 state rows
    g = torch.Generator().manual_seed(17)
    state_bs, n_state_blocks = 4, 6
    state = torch.zeros(n_state_blocks, state_bs, 4 * hd)  # [kv(2*128) | score(2*128)]
    state[..., : 2 * hd] = torch.randint(-64, 65, (n_state_blocks, state_bs, 2 * hd),
                                         generator=g).float() / 64
    positions = torch.tensor([3, 7, 9, 11, 15], dtype=torch.int64)
    kv_slots = torch.tensor([5, 2, 0, -1, 9], dtype=torch.int64)
    state_rows = torch.randperm(n_state_blocks * state_bs, generator=g)
    gather = torch.full((5, width), -1, dtype=torch.int64)
    for t, p in enumerate(positions.tolist()):
        for w in range(width):
            pos = p - width + 1 + w
            if pos >= 0:
                gather[t, w] = state_rows[pos % len(state_rows)]
    rms_w = (torch.randint(1, 9, (hd,), generator=g).float() / 4).contiguous()
    eps = 1e-6
    cos_sin = torch.randn(64, 64, generator=g)
    nb, bs, pad = 3, 4, 16
    backing_vllm, _ = make_cache("fp8", nb, bs, pad)
    kv2d = backing_vllm[:, : bs * 132]
    op(state, gather, positions, kv_slots, rms_w, eps, cos_sin, kv2d, bs, ratio)

    backing, cache = make_cache("fp8", nb, bs, pad)
    rows, slots = [], []
    for t, p in enumerate(positions.tolist()):
        if (p + 1) % ratio or kv_slots[t] < 0:
            continue
        acc = torch.zeros(hd)
        cnt = 0
        for w in range(width):
            s = int(gather[t, w])
            if s < 0:
                continue
            b, o = divmod(s, state_bs)
            off = hd if w >= ratio else 0
            acc += state[b, o, off : off + hd]
            cnt += 1
        v = acc / cnt  # exact: dyadic, equal softmax weights
        inv_rms = 1.0 / torch.sqrt((v * v).sum() / hd + eps)
        v = v * inv_rms * rms_w
        cs = cos_sin[(p // ratio) * ratio]
        roped = oracle_rope_row(fr_list(v), fr_list(cs[:32]), fr_list(cs[32:]))
        rows.append(torch.tensor([float(x) for x in roped]))
        slots.append(int(kv_slots[t]))
    ic.quantize_and_insert(torch.stack(rows).bfloat16(), cache, torch.tensor(slots), "fp8")
    assert torch.equal(backing, backing_vllm)


# ---------------------------------------------------------------------------
# ops.indexer.indexer_q_rope_quant
# ---------------------------------------------------------------------------
@pytest.mark.vllm
def test_q_rope_quant_matches_vllm_cpu_kernel():
    op = _vllm_op("fused_indexer_q_rope_quant_cpu")
    t, h = 5, 64
    q, pos, _, w = q_inputs(t, h, 6)
    cos_sin = torch.randn(1024, 64)
    ss, hs = 128**-0.5, 64**-0.5
    q_fp8 = torch.empty(t, h, 128, dtype=torch.float8_e4m3fn)
    w_out = torch.empty(t, h)
    op(pos, q.float(), cos_sin, q_fp8, w.float(), ss, hs, w_out)
    res = ix.indexer_q_rope_quant(q, pos, cos_sin, w, softmax_scale=ss, head_scale=hs,
                                  dtype="fp8")
    assert torch.equal(res.q.view(torch.uint8), q_fp8.view(torch.uint8))
    assert torch.equal(res.weights, w_out)


# ---------------------------------------------------------------------------
# ops.indexer.indexer_logits
# ---------------------------------------------------------------------------
@pytest.mark.vllm
def test_logits_match_vllm_cpu_kernel():
    op = _vllm_op("fp8_paged_mqa_logits_cpu")
    case = PagedCase("fp8", seed=14, bs=8)
    # the C++ kernel reads every page below seq_len: keep those rows allocated
    keep = torch.tensor([i for i in range(len(case.token_to_req))
                         if not (int(case.token_to_req[i]) == 2 and int(case.seq_lens[i]) > 8)])
    q = case.q.q[keep].contiguous()
    w = case.q.weights[keep].contiguous()
    lens = case.seq_lens[keep].contiguous()
    pages = case.block_table[case.token_to_req[keep]].contiguous()
    width = int(lens.max())
    kv2d = case.backing[:, : case.bs * 132]  # padded stride, as vLLM's per-layer view
    want = op(q, kv2d, w, lens, pages, case.bs, width)
    got = ix.indexer_logits(q, None, w, case.cache, lens, pages, dtype="fp8")
    valid = torch.arange(width)[None, :] < lens[:, None]
    assert torch.isneginf(got[~valid]).all()
    scale = float(want[valid].abs().max())
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-5 * scale)


# ---------------------------------------------------------------------------
# ops.indexer.indexer_topk + local_to_global
# ---------------------------------------------------------------------------
@pytest.mark.vllm
def test_topk_and_mapping_match_vllm_cpu_kernel():
    op = _vllm_op("topk_transform_512_cpu")
    g = torch.Generator().manual_seed(31)
    width, bs = 700, 64
    lens = torch.tensor([0, 5, 511, 512, 513, 700, 650, 700, 690, 600], dtype=torch.int32)
    t = len(lens)
    scores = (torch.randint(-50, 50, (t, width), generator=g).float() / 8).contiguous()  # ties
    # The kernel's streaming-heap tie rule (see ix._stream_heap_select): an all-equal
    # row keeps its first 512, -inf is an ordinary score, -0.0 ties +0.0.
    scores[7] = 0.0
    scores[8, :600] = float("-inf")
    scores[9, ::2] = -0.0
    scores[9, 1::2] = 0.0
    scores[9, 650:] = 1.0
    pages = torch.stack([torch.randperm(40, generator=g)[:11] for _ in range(t)]).int()
    out_pages = torch.empty(t, 512, dtype=torch.int32)
    out_raw = torch.empty(t, 512, dtype=torch.int32)
    op(scores, lens, pages, out_pages, bs, out_raw)
    mine = ix.indexer_topk(scores, None, 512, seq_lens=lens)
    assert torch.equal(mine.sort(dim=1).values, out_raw.sort(dim=1).values)
    gi, gl = ix.local_to_global(mine, torch.arange(t), pages, bs)
    assert torch.equal(gi.sort(dim=1).values, out_pages.sort(dim=1).values)
    assert gl.tolist() == lens.clamp(max=512).tolist()
