# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prompt-length sweep over L = 0, 1, 2, 3 (mod 4) around every boundary (torch only).

Issue 29 item 2, after vllm#55927 (a deterministic wrong token in deep-context
retrieval whenever the prompt length is 3 mod 4, on vLLM 0.28, SGLang and hosted
providers; suspected C4 compression boundaries).

For each length ``L`` one request is prefilled (positions ``0 .. L-1`` in one step:
SWA insert, both C4 compressors, the C128 compressor, for every token) and then
decoded once at position ``L``. The attention output of each layer kind -- SWA only
(ratio 1), C4 (lightning indexer, top-k 512) and C128 -- is checked for the last
four prefill tokens (every residue of ``p`` mod 4) and the decode token against a
float64 oracle computed from the raw per-token inputs:

- q: weight-free RMSNorm + GPT-J RoPE, float64;
- SWA keys: RoPE in float64, rounded to bf16 and quantized with ``support.oracle.quantize_ref``
  (the fp8_ds_mla rule), decoded in float64;
- compressed keys: :func:`compressor_oracle` (float64 softmax-pooling of the window,
  C4 overlap, RMSNorm, RoPE at the window start; cross-checked against
  ``compressor_store.oracle_entry``), then the same rounding and quantization;
- which entries a token sees: positions ``max(0, p-127) .. p`` of the window and the
  compressed entries ``j < (p + 1) // ratio``; for C4 with more than 512 visible
  entries the implementation's top-k set, checked on its own (inside the visible
  range, 512 distinct entries, and no unpicked entry scoring above a picked one
  under float64 indexer logits over the stored indexer bytes);
- one softmax with the attention sink (``support.oracle._softmax_with_sink``).

The written caches are checked too: every stored compressed (main and indexer) entry
against the compressor oracle. Unowned cache bytes are 0xFF (NaN), so a read past
what is written shows up as NaN.

Implementations swept here (tests/vllm/test_mod4_sweep_vllm.py adds vLLM 0.32's real
C++ kernels and the served tiny model):

- ``eager``: the plugin's torch ops as the eager region runs them (``rope``,
  ``ops.indexer``, ``ops.compressor``, ``eager.select_topk_c4``, ``ops.slots``,
  ``ops.torch_sparse_mla.sparse_mla_decode``);
- ``fallback``: vLLM's ``torch.ops._C`` call convention (the ops and arguments the CPU
  layer passes) served by the plugin's registered torch fallbacks
  (``vllm_compat.cpu_ops.OPS``), which the layer runs on CPUs without AVX512-BF16.

The default suite runs :data:`FAST_LENGTHS`; ``DSV4_FULL_SWEEP=1`` (a test switch, read
only in tests.support.mod4_sweep, where the sweep lives) runs :data:`FULL_LENGTHS`. The
negative controls shift the causal compressed-entry bound by one (``j < pos // 4``,
``j < (pos + 2) // 4`` and ``j < pos // 128``) and require the sweep to flag exactly the
affected tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from tests.support.compressor_store import oracle_entry
from tests.support.mod4_sweep import (
    LENGTHS,
    PREFILL_ROWS,
    REL_TOL,
    D,
    EagerOps,
    VllmConventionOps,
    compressor_oracle,
    failures,
    fallback_namespace,
    make_world,
    sweep,
    table,
)


# ------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------
def test_compressor_oracle_matches_test_compressor_store_oracle() -> None:
    """The vectorized compressor oracle equals ``compressor_store.oracle_entry``
    (C4 with its overlap and first window, C128)."""
    w = make_world(300, seed=7)
    cs = w.par["cos_sin"]
    for r, kv, sc, ape, rms in ((4, "mkv4", "mscore4", "mape4", "mrms4"),
                                (128, "mkv128", "mscore128", "mape128", "mrms128")):
        coff = 2 if r == 4 else 1
        ns = SimpleNamespace(ratio=r, head_dim=D, coff=coff, kv=[w.raw[kv]],
                             score=[w.raw[sc]], ape=w.par[ape], rms_w=w.par[rms], cos_sin=cs)
        mine = compressor_oracle(w.raw[kv], w.raw[sc], w.par[ape], w.par[rms], cs, r)
        for j in sorted({0, 1, mine.shape[0] - 1}):
            ref = oracle_entry(ns, 0, j * r + r - 1)
            torch.testing.assert_close(mine[j], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["eager", "fallback"])
def test_mod4_sweep(impl: str) -> None:
    """Every layer kind, the last prefill tokens and the decode token, every length of
    the sweep, against the float64 oracle; the stored compressed entries too."""
    make: Callable[[], EagerOps] = (
        EagerOps if impl == "eager" else (lambda: VllmConventionOps(fallback_namespace())))
    t0 = time.perf_counter()
    findings, entry = sweep(LENGTHS, make)
    dt = time.perf_counter() - t0
    print(f"\n[mod4 sweep] {impl}: {len(LENGTHS)} lengths, {len(findings)} tokens, "
          f"{dt:.1f} s\n{table(findings)}")
    bad = failures(findings)
    assert not entry, "\n".join(entry)
    assert not bad, f"{len(bad)} token(s) off the oracle:\n" + "\n".join(bad[:40])


# The mutants and the tokens each must flag (checked rows: L-4 .. L-1 and decode L).
MUTANT_LENGTHS = [127, 128, 130, 131, 512, 2051]


def _expected_c4(L: int, shift: int, rows: list[int]) -> set[int]:
    # (p+1-1)//4 drops entry p//4 where p % 4 == 3; (p+1+1)//4 adds one where p % 4 == 2.
    return {p for p in rows if (p + 1 + shift) // 4 != (p + 1) // 4}


@pytest.mark.parametrize("shift", [-1, 1])
def test_sweep_detects_off_by_one_c4_bound(shift: int) -> None:
    """``j < pos // 4`` (drops the entry a token just completed) and ``j < (pos + 2) //
    4`` (one entry early): the sweep flags exactly the C4 tokens whose visible count
    changes, at every length, and nothing else."""
    lengths = [L for L in MUTANT_LENGTHS if L < 2048]  # short context: the bound itself
    findings, _ = sweep(lengths, lambda: EagerOps(c4_shift=shift))
    for L in lengths:
        rows = list(range(max(0, L - PREFILL_ROWS), L + 1))
        bad = [f for LL, f in findings if LL == L and not f.ok]
        flagged = {f.pos for f in bad}
        expected = _expected_c4(L, shift, rows)
        assert {f.kind for f in bad} <= {"c4"}
        assert expected and expected <= flagged, (L, sorted(flagged))
        # Past the expected tokens only NaN from the one unwritten entry a mutant row
        # names, which the torch sparse MLA spreads to the other rows of its call (an
        # invalid column reads a row another token named; docs/correctness.md).
        extra = [f for f in bad if f.pos not in expected]
        assert all(f.phase == "prefill" and math.isinf(f.rel) for f in extra), extra
    worst = min(f.rel for _, f in findings if not f.ok)
    print(f"\n[mod4 sweep] C4 bound shifted by {shift}: smallest flagged rel {worst:.3g} "
          f"(tolerance {REL_TOL})")


def test_sweep_detects_off_by_one_c4_bound_long_context() -> None:
    """The same mutant (``j < pos // 4``) past 512 visible entries, where the indexer's
    top-k decides: decode at 2051 sees 512 instead of 513 entries (flagged by the top-k
    check: the newest entry outscores a picked one), prefill p = 2047 one too few."""
    findings, _ = sweep([2051], lambda: EagerOps(c4_shift=-1))
    flagged = {(f.kind, f.pos) for _, f in findings if not f.ok}
    assert flagged == {("c4", 2047), ("c4", 2051)}, sorted(flagged)


def test_sweep_detects_off_by_one_c128_bound() -> None:
    """``j < pos // 128``: only tokens at p = 127 (mod 128) lose their newest entry, and
    the sweep flags exactly those (prefill p = 127 at L = 128..131, decode at L = 127)."""
    lengths = [127, 128, 131, 132, 255, 256]
    findings, _ = sweep(lengths, lambda: EagerOps(c128_shift=-1))
    flagged = {(L, f.kind, f.pos) for L, f in findings if not f.ok}
    expected = {(L, "c128", p) for L in lengths
                for p in range(max(0, L - PREFILL_ROWS), L + 1) if p % 128 == 127}
    assert flagged == expected, sorted(flagged)


def test_sweep_detects_off_by_one_in_vllm_convention_path() -> None:
    """The vLLM-convention implementation (fallback ops) with ``j < pos // 4``: flagged."""
    findings, _ = sweep([130], lambda: VllmConventionOps(fallback_namespace(), c4_shift=-1))
    assert {(f.kind, f.pos) for _, f in findings if not f.ok} == {("c4", 127)}
