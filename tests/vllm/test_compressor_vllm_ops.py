# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The compressor-store tests that compare with vLLM's CPU ops (tests.support.compressor_store,
which tests/core/test_compressor_store.py runs on a scalar transliteration), run against the
real ``torch.ops._C`` ops (tests/core stays torch-only).

The ops exist only in the AVX512-BF16 ``_C`` build; on other CPUs vLLM loads
``_C_AVX2``/``_C_AVX512`` without them (or the plugin registers torch fallbacks), and these
tests skip.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tests.support import compressor_store as cs  # noqa: E402

# Collected here, so they use this module's ``cpu_ops`` fixture.
test_save_partial_states_matches_cpu_op = cs.test_save_partial_states_matches_cpu_op
test_indexer_fp8_store_matches_cpu_op = cs.test_indexer_fp8_store_matches_cpu_op
test_values_match_cpu_op_dequant = cs.test_values_match_cpu_op_dequant
test_main_store_matches_cpu_op = cs.test_main_store_matches_cpu_op

_NAMES = ("save_partial_states_cpu", "compress_norm_rope_store_cpu",
          "compress_norm_rope_store_indexer_cpu")


@pytest.fixture
def cpu_ops():
    import vllm._custom_ops  # noqa: F401  (loads the platform's _C library)

    from vllm_dsv4_backend.vllm_compat import cpu_ops as fallbacks

    if not all(hasattr(torch.ops._C, n) for n in _NAMES) or any(
            fallbacks.is_fallback(n) for n in _NAMES):
        pytest.skip("this vLLM build lacks the DeepSeek-V4 CPU compressor ops (they are only in "
                    "the AVX512-BF16 _C library)")
    return torch.ops._C
