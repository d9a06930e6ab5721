# SPDX-License-Identifier: Apache-2.0
"""The golden calls of ``tests/data/golden`` through vLLM's real C++ kernels.

Where vLLM's AVX512-BF16 kernel library is loaded (``torch.ops._C.<op>`` is the
C++ kernel, not the plugin's torch fallback), every copied call must reproduce
its recorded outputs bit for bit: that proves the data and the replay code
(compaction, renumbered slots, cut tables) that
``tests/core/test_golden_kernels.py`` relies on to test the fallbacks. The
recording ran on AMX; on an AVX512-BF16 CPU without AMX (AMD Zen 4) the two
GEMM-bound kernels take their AVX512 path and must stay within the bound
measured for it (``golden_io.ISA_SENSITIVE``), every other op still bit for bit. Also
checks, on fresh random inputs, the two fallback behaviours matched to the
kernels by construction: the top-k tie rule and the SWA writer's fp8
subnormal flush. No engine starts here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tests.data.golden import golden_io as gio  # noqa: E402
from tests.support.threads import one_thread  # noqa: E402
from tests.support.vllm_helpers import real_cpp_ops  # noqa: E402
from vllm_dsv4_backend.vllm_compat import cpu_ops  # noqa: E402

pytestmark = pytest.mark.vllm

OPS = {op.name: op for op in cpu_ops.OPS}

FILES = list(gio.files())


@pytest.fixture(scope="module")
def real_ops() -> Any:
    """``torch.ops._C`` with vLLM's kernels loaded; skips where they are not real."""
    ops = real_cpp_ops(OPS)
    with one_thread():  # the recording's setting (the box is shared)
        yield ops


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_bits(got: Any, want: Any, skip_nan: bool) -> bool:
    if not isinstance(want, torch.Tensor):
        return got == want
    if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
        return False
    if skip_nan:  # fp8_paged_mqa_logits_cpu: columns past seq_len are never written
        m = ~torch.isnan(want)
        return torch.equal(got[m].view(torch.int32), want[m].view(torch.int32))
    return torch.equal(_bytes(got), _bytes(want))


@pytest.mark.parametrize("entry", FILES, ids=[e["file"][:-3] for e, _ in FILES])
def test_golden_call_reproduces_bit_for_bit(real_ops, entry):
    e, path = entry
    op = e["op"]
    d = gio.load(path)
    outs, after = gio.call(getattr(real_ops, op), OPS[op].schema, d, unpacked_mat2=False)
    assert set(outs) >= set(d["outputs"]), (set(d["outputs"]), set(outs))
    # On a CPU whose AMX support differs from the recording machine's, the GEMM-bound
    # kernels sum in another order; they must stay within their measured bound.
    other_isa = not gio.same_isa_as_recording()
    for name, want in d["outputs"].items():
        if _same_bits(outs[name], want, op == "fp8_paged_mqa_logits_cpu"):
            continue
        why = gio.isa_mismatch(op, outs[name], want) if other_isa else "bits differ"
        assert why is None, f"{e['file']}: output {name} differs from the recording: {why}"
    mutated = set(gio.mutated_arg_names(OPS[op].schema))
    for name, v in d["args"].items():
        if name not in mutated and isinstance(v, torch.Tensor):
            assert torch.equal(_bytes(after[name]), _bytes(v)), f"read-only {name} was written"


@pytest.mark.parametrize("seed", range(4))
def test_topk_fallback_matches_kernel_on_random_ties(real_ops, seed):
    """Fresh tie-heavy scores (few distinct values, -inf runs, signed zeros, all
    equal rows), lengths 0, short, 512, 513 and past the width: the fallback
    selects the kernel's set in every row, raw ids and page slots."""
    g = torch.Generator().manual_seed(1000 + seed)
    t, width, page = 12, 1800, 64
    q = [1, 3, 8, 64][seed]
    s = torch.randint(-q, q + 1, (t, width), generator=g).float() / 4
    s[1, ::7] = float("-inf")
    s[2] = 0.0
    s[3, ::2] = -0.0
    s[4, : width // 2] = float("-inf")
    s[5] += torch.randn(width, generator=g) * 1e-3  # almost no ties
    lens = torch.randint(513, width + 1, (t,), generator=g).int()
    lens[6], lens[7], lens[8], lens[9], lens[10] = 0, 7, 512, 513, 10**6
    pages = torch.stack(
        [torch.randperm(200, generator=g)[: math.ceil(width / page)] for _ in range(t)]
    ).int()

    def run(fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out_pages = torch.full((t, 512), 7, dtype=torch.int32)
        out_raw = torch.full((t, 512), 7, dtype=torch.int32)
        fn(s.clone(), lens.clone(), pages.clone(), out_pages, page, out_raw)
        return out_raw, out_pages

    c_raw, c_pages = run(real_ops.topk_transform_512_cpu)
    f_raw, f_pages = run(cpu_ops.topk_transform_512_cpu)
    for i in range(t):
        assert sorted(f_raw[i].tolist()) == sorted(c_raw[i].tolist()), f"row {i} raw ids"
        assert sorted(f_pages[i].tolist()) == sorted(c_pages[i].tolist()), f"row {i} pages"
    # Rows at most 512 long are the identity in both, in order.
    for i in (6, 7, 8):
        assert torch.equal(f_raw[i], c_raw[i]) and torch.equal(f_pages[i], c_pages[i])


def test_swa_insert_fallback_flushes_subnormals_like_kernel(real_ops):
    """Fresh kv rows whose NoPE tiles mix normal values with values in and just
    below e4m3's subnormal range (after scaling): the fallback writes the
    kernel's cache bytes exactly (tiles with amax >= 448e-4, where both writers
    agree on the scale)."""
    g = torch.Generator().manual_seed(7)
    n, bs, nb = 96, 64, 3
    kv = torch.randn(n, 512, generator=g) * 0.5
    # Per tile: amax ~0.5 -> scale 2**-9; scaled values v * 2**9. Tiny entries
    # land around e4m3's smallest normal 2**-6 (v ~ 2**-15) and below.
    tiny = torch.rand(n, 448, generator=g) < 0.3
    mag = torch.exp2(-15 - 6 * torch.rand(n, 448, generator=g))
    kv[:, :448] = torch.where(tiny, mag * torch.sign(torch.randn(n, 448, generator=g)), kv[:, :448])
    kv[:, 0:448:64] = 0.5  # amax of every tile well above the scale floors
    kv = kv.to(torch.bfloat16)
    q = torch.randn(n, 4, 512, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (n,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:n].long()
    slots[::11] = -1
    cos_sin = torch.randn(4096, 64, generator=g)

    def run(fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.full((nb, bs * 584), 0x5A, dtype=torch.uint8)
        out = fn(q, kv, positions, cache, slots, cos_sin, 4, 1e-6, bs)
        return out, cache

    c_q, c_cache = run(real_ops.fused_qnorm_rope_kv_insert_cpu)
    f_q, f_cache = run(cpu_ops.fused_qnorm_rope_kv_insert_cpu)
    differ = int((c_cache != f_cache).sum())
    assert differ == 0, f"{differ} cache bytes differ from the kernel's"
    torch.testing.assert_close(f_q.float(), c_q.float(), atol=1e-2, rtol=1e-2)
