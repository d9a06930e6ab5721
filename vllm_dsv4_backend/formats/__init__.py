# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exact byte layouts of DeepSeek-V4's caches (torch only, no vLLM import).

- ``fp8_ds_mla``: the 584 B/token main KV format (block-split).
- ``indexer_cache``: the lightning indexer's K cache, FP8 (132 B) or MXFP4 (68 B).
- ``mxfp4``: e2m1 values with UE8M0 scales over blocks of 32.
"""
