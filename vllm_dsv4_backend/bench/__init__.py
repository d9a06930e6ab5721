# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmarks (not tests), ``vllm-dsv4-bench`` (:mod:`.cli`): the plugin's served layer
against vLLM's own (``step-ab``, ``layer-ab``, ``e2e-layers``, ``solo-identity``, on the
A/B engine of :mod:`.ab`) and the sparse MLA kernel benchmark (``kernels``)."""
