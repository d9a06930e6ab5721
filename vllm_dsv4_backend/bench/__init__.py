# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmarks (not tests): ``python -m vllm_dsv4_backend.bench.kernels`` times the sparse MLA
kernels; the layer-level benchmark lives beside it."""
