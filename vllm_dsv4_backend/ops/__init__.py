# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's DeepSeek-V4 kernels in PyTorch (torch only; never imports vLLM).

Each runs anywhere, stands in where a platform lacks vLLM's kernel, and is the tests'
oracle. One module a kernel family:

- :mod:`.torch_sparse_mla`: sparse MLA with FlashMLA's interface
  (:func:`sparse_mla_decode` over ``fp8_ds_mla`` caches, :func:`sparse_mla_prefill` over a
  bf16 KV buffer; re-exported here);
- :mod:`.indexer`: the C4 lightning indexer (q quantization, logits, top-k);
- :mod:`.compressor`: the C4 / C128 compressors;
- :mod:`.metadata`: the per-step index tables vLLM's kernels take;
- :mod:`.rope`, :mod:`.slots`, :mod:`.blas`, :mod:`.checks`: shared pieces;
- :mod:`.vllm_cpu`: the FlashMLA-interface adapter to vLLM's C++
  ``flash_mla_with_kvcache_cpu`` (tests compare it with the torch path).
"""

from __future__ import annotations

from vllm_dsv4_backend.ops.torch_sparse_mla import (
    decode_scratch_nbytes,
    prefill_scratch_nbytes,
    sparse_mla_decode,
    sparse_mla_prefill,
)

__all__ = [
    "decode_scratch_nbytes",
    "prefill_scratch_nbytes",
    "sparse_mla_decode",
    "sparse_mla_prefill",
]
