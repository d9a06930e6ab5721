# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FLASHMLA_SPARSE_DSV4 attention backend for DeepSeek-V4, as a vLLM plugin.

Layers (bottom up): ``formats`` (byte layouts), ``ops`` (sparse MLA kernels),
``workspace`` (per-layer buffers), then the vLLM glue (``plugin``, ``backend``,
``layer``). Importing this package never imports vLLM; the entry point
``vllm_dsv4_backend.plugin:register`` does that lazily inside vLLM processes.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
