# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's C++ CPU DeepSeek-V4 ops with physical block ids past the int32 byte-offset boundary.

The cache-addressing ``torch.ops._C`` ops of vLLM 0.32's CPU build (the SWA writer
``fused_qnorm_rope_kv_insert_cpu``, sparse MLA ``flash_mla_with_kvcache_cpu`` as vLLM's CPU
layer calls it and through the plugin's FlashMLA-interface adapter, ``save_partial_states_cpu``,
the two compressor stores, the indexer's ``fp8_paged_mqa_logits_cpu`` and
``topk_transform_512_cpu``) through the checks of tests/core/test_high_block_ids.py, which runs
them against the plugin's torch fallbacks of the same ops: cache views of one lazily mapped
``2**31 + 8 MiB`` buffer whose named blocks start at byte offsets ``>= 2**31``, float64
oracles, poison checks. All of them address those blocks correctly (measured 2026-12-04, vLLM
0.32.0 CPU, AVX512-BF16): no byte offset is kept in 32 bits.

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
(``_helpers.real_cpp_ops``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

_CORE = Path(__file__).resolve().parents[1] / "core"
if str(_CORE) not in sys.path:  # the core module imports oracle
    sys.path.insert(0, str(_CORE))

from _helpers import load_core_module, real_cpp_ops  # noqa: E402  (tests/vllm is on sys.path)
from oracle import (  # noqa: E402
    assert_flashmla_close,
    sparse_decode_ref,
)

from vllm_dsv4_backend.formats import fp8_ds_mla as F  # noqa: E402
from vllm_dsv4_backend.ops import vllm_cpu  # noqa: E402

H = load_core_module("test_high_block_ids.py", "_core_high_block_ids")

pytestmark = pytest.mark.vllm

# The core module's fixtures, bound here so pytest finds them for this module.
far = H.far
_one_thread = H._one_thread

# vLLM's C++ sparse MLA rounds more than the torch path (bf16 K/V and probabilities, exp
# approximations): tests/core/test_sparse_mla.py's tolerance for it.
CPP_OUT_TOL = {"abs_tol": 2e-3, "rel_tol": 2.01 / 128, "cos_tol": 1e-5}


def test_swa_insert_far_slots(far) -> None:
    """``fused_qnorm_rope_kv_insert_cpu`` writes far SWA slots with the oracle's bytes (its
    subnormal flush aside) and nothing else (the core module's :func:`check_swa_insert_op`)."""
    H.check_swa_insert_op(far, real_cpp_ops(["fused_qnorm_rope_kv_insert_cpu"]))


@pytest.mark.parametrize("extra_block_size", [64, 2], ids=["c4", "c128"])
def test_sparse_mla_far_slots(far, extra_block_size: int) -> None:
    """``flash_mla_with_kvcache_cpu`` (through ``ops.vllm_cpu``'s FlashMLA-interface adapter)
    over window and compressed slots past the boundary agrees with the float64 oracle."""
    real_cpp_ops(["flash_mla_with_kvcache_cpu"])
    win, _, wb0, end = H._mla_cache(far, 64, 2)
    comp, _, cb0, _ = H._mla_cache(far, extra_block_size, 2, after=end)
    g = torch.Generator().manual_seed(13 + extra_block_size)
    win_pool = torch.cat([torch.arange(wb0 * 64, (wb0 + 2) * 64), torch.tensor([3, 60])])
    comp_pool = torch.cat([torch.arange(cb0 * extra_block_size, (cb0 + 2) * extra_block_size),
                           torch.tensor([1])])
    for cache, pool in ((win, win_pool), (comp, comp_pool)):
        kv = (torch.randn(len(pool), 512, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
        F.quantize_and_insert(kv, cache, pool)
    b, h = 3, 64
    lens = torch.tensor([128, 77, 100], dtype=torch.int32)
    idx = H._named_indices(g, b, 128, win_pool, lens)
    extra = H._named_indices(g, b, 128, comp_pool, None)
    q = torch.randn(b, 1, h, 512, generator=g).clamp(-1, 1).to(torch.bfloat16)
    sink = torch.randn(h, generator=g) + 4.0
    scale = 512**-0.5
    out = vllm_cpu.sparse_mla_decode_vllm_cpu(q, win, idx, lens, sink, scale, comp, extra, None)
    ref, _ = sparse_decode_ref(q, [(win, idx, lens), (comp, extra, None)], sink, scale)
    assert_flashmla_close(out, ref, name="out", **CPP_OUT_TOL)


@pytest.mark.parametrize("extra_block_size", [64, 2], ids=["c4", "c128"])
def test_sparse_mla_op_far_slots(far, extra_block_size: int) -> None:
    """``flash_mla_with_kvcache_cpu`` called as vLLM's CPU layer calls it (2-D caches, int64
    slot rows; the core module's :func:`check_sparse_mla_op`)."""
    H.check_sparse_mla_op(far, real_cpp_ops(["flash_mla_with_kvcache_cpu"]), extra_block_size,
                          CPP_OUT_TOL)


@pytest.mark.parametrize("store", ["main", "fp8"])
@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_far_state_and_caches(far, ratio: int, store: str) -> None:
    """``save_partial_states_cpu`` and ``compress_norm_rope_store[_indexer]_cpu`` on far state
    and cache blocks (the core module's :func:`check_compressor_far`; vLLM's CPU build has
    no MXFP4 store). The C++ writers flush e4m3 subnormals to zero (2**-6 of the scale)."""
    names = ["save_partial_states_cpu",
             "compress_norm_rope_store_cpu" if store == "main"
             else "compress_norm_rope_store_indexer_cpu"]
    C = real_cpp_ops(names)
    H.check_compressor_far(far, ratio, store, getattr(C, names[0]), getattr(C, names[1]),
                           2.0**-6)


def test_indexer_logits_and_topk_far_pages(far) -> None:
    """``fp8_paged_mqa_logits_cpu`` and ``topk_transform_512_cpu`` over far indexer pages
    against the float64 oracle (the core module's :func:`check_logits_topk_ops`)."""
    H.check_logits_topk_ops(far, real_cpp_ops(["fp8_paged_mqa_logits_cpu",
                                               "topk_transform_512_cpu"]))


def test_topk_transform_page_ids_wrap_past_int32() -> None:
    """Records a limit of vLLM's kernel (see the module docstring): a global page id
    ``page * 64 + offset >= 2**31`` comes out of ``topk_transform_512_cpu`` wrapped, while
    the raw local ids stay right (the core module's :func:`check_topk_page_ids_wrap`). If
    vLLM starts refusing or widening them this fails, and the docstring should say so."""
    H.check_topk_page_ids_wrap(real_cpp_ops(["topk_transform_512_cpu"]))
