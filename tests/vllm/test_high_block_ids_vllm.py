# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's C++ CPU DeepSeek-V4 ops with physical block ids past the int32 byte-offset boundary.

The cache-addressing ``torch.ops._C`` ops of vLLM 0.32's CPU build (the SWA writer
``fused_qnorm_rope_kv_insert_cpu``, sparse MLA ``flash_mla_with_kvcache_cpu`` as vLLM's CPU
layer calls it and through the plugin's FlashMLA-interface adapter, ``save_partial_states_cpu``,
the two compressor stores, the indexer's ``fp8_paged_mqa_logits_cpu`` and
``topk_transform_512_cpu``) through the checks of tests.support.high_block_ids (``hb``), which
tests/core/test_high_block_ids.py runs against the plugin's torch fallbacks of the same ops:
cache views of one lazily mapped ``2**31 + 8 MiB`` buffer whose named blocks start at byte
offsets ``>= 2**31``, float64 oracles, poison checks. All of them address those blocks
correctly (measured 2026-12-04, vLLM 0.32.0 CPU, AVX512-BF16): no byte offset is kept in 32
bits.

One int32 limit remains in vLLM's kernels, of slot ids rather than byte offsets:
``topk_transform_512_cpu`` writes its global page ids ``page * page_size + offset`` into an
int32 tensor and wraps them (negative) once they pass ``2**31``, i.e. for indexer blocks
``>= 2**31 / 64`` (33.5M blocks of 8448 B: 283 GB of indexer cache per layer).
:func:`test_topk_transform_page_ids_wrap_past_int32` records that. The plugin's CPU layer does
not consume those ids (they go to a scratch lease; the local ids are mapped in int64 by vLLM's
``map_local_to_global_slots_cpu``), and the plugin's own int32 slot tables refuse such ids
(tests/core/test_high_block_ids.py::test_global_slot_ids_past_int32_are_refused); the
plugin's torch fallback of the op, for CPUs without vLLM's library, keeps the kernel's output
as it is, wrap included.

The ops exist only in vLLM's AVX512-BF16 ``_C`` library; elsewhere these tests skip
(``tests.support.vllm_helpers.real_cpp_ops``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.support import high_block_ids as hb  # noqa: E402
from tests.support.oracle import assert_flashmla_close  # noqa: E402
from tests.support.vllm_helpers import real_cpp_ops  # noqa: E402
from vllm_dsv4_backend.ops import vllm_cpu  # noqa: E402

pytestmark = pytest.mark.vllm

# The shared fixtures (the far buffer, one intra-op thread), bound here so pytest finds them.
far = hb.far
one_thread = hb.one_thread

# vLLM's C++ sparse MLA rounds more than the torch path (bf16 K/V and probabilities, exp
# approximations): tests/core/test_sparse_mla.py's tolerance for it.
CPP_OUT_TOL = {"abs_tol": 2e-3, "rel_tol": 2.01 / 128, "cos_tol": 1e-5}


def test_swa_insert_far_slots(far) -> None:
    """``fused_qnorm_rope_kv_insert_cpu`` writes far SWA slots with the oracle's bytes (its
    subnormal flush aside) and nothing else (:func:`hb.check_swa_insert_op`)."""
    hb.check_swa_insert_op(far, real_cpp_ops(["fused_qnorm_rope_kv_insert_cpu"]))


@pytest.mark.parametrize("extra_block_size", [64, 2], ids=["c4", "c128"])
def test_sparse_mla_far_slots(far, extra_block_size: int) -> None:
    """``flash_mla_with_kvcache_cpu`` (through ``ops.vllm_cpu``'s FlashMLA-interface adapter)
    over window and compressed slots past the boundary agrees with the float64 oracle."""
    real_cpp_ops(["flash_mla_with_kvcache_cpu"])
    c = hb.far_sparse_mla_case(far, extra_block_size)
    out = vllm_cpu.sparse_mla_decode_vllm_cpu(c.q, c.win, c.idx, c.lens, c.sink, c.scale,
                                              c.comp, c.extra, None)
    ref, _ = c.reference()
    assert_flashmla_close(out, ref, name="out", **CPP_OUT_TOL)


@pytest.mark.parametrize("extra_block_size", [64, 2], ids=["c4", "c128"])
def test_sparse_mla_op_far_slots(far, extra_block_size: int) -> None:
    """``flash_mla_with_kvcache_cpu`` called as vLLM's CPU layer calls it (2-D caches, int64
    slot rows; :func:`hb.check_sparse_mla_op`)."""
    hb.check_sparse_mla_op(far, real_cpp_ops(["flash_mla_with_kvcache_cpu"]), extra_block_size,
                           CPP_OUT_TOL)


@pytest.mark.parametrize("store", ["main", "fp8"])
@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_far_state_and_caches(far, ratio: int, store: str) -> None:
    """``save_partial_states_cpu`` and ``compress_norm_rope_store[_indexer]_cpu`` on far state
    and cache blocks (:func:`hb.check_compressor_far`; vLLM's CPU build has
    no MXFP4 store). The C++ writers flush e4m3 subnormals to zero (2**-6 of the scale)."""
    names = ["save_partial_states_cpu",
             "compress_norm_rope_store_cpu" if store == "main"
             else "compress_norm_rope_store_indexer_cpu"]
    C = real_cpp_ops(names)
    hb.check_compressor_far(far, ratio, store, getattr(C, names[0]), getattr(C, names[1]),
                            2.0**-6)


def test_indexer_logits_and_topk_far_pages(far) -> None:
    """``fp8_paged_mqa_logits_cpu`` and ``topk_transform_512_cpu`` over far indexer pages
    against the float64 oracle (:func:`hb.check_logits_topk_ops`)."""
    hb.check_logits_topk_ops(far, real_cpp_ops(["fp8_paged_mqa_logits_cpu",
                                                "topk_transform_512_cpu"]))


def test_topk_transform_page_ids_wrap_past_int32() -> None:
    """Records a limit of vLLM's kernel (see the module docstring): a global page id
    ``page * 64 + offset >= 2**31`` comes out of ``topk_transform_512_cpu`` wrapped, while
    the raw local ids stay right (:func:`hb.check_topk_page_ids_wrap`). If
    vLLM starts refusing or widening them this fails, and the docstring should say so."""
    hb.check_topk_page_ids_wrap(real_cpp_ops(["topk_transform_512_cpu"]))
