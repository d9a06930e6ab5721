# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one home of DeepSeek-V4's format names and layer kinds (torch-free).

Every module that accepts an indexer cache dtype, a KV cache dtype or a
layer's compress ratio validates against these, so the supported values are
written once.
"""

from __future__ import annotations

import operator

__all__ = [
    "INDEXER_KV_DTYPES",
    "KERNEL_BLOCK_SIZE",
    "KV_CACHE_DTYPES",
    "LAYER_KINDS",
    "layer_kind",
]

# The lightning indexer's K cache: FP8 (132 B/entry) or MXFP4 (68 B/entry).
INDEXER_KV_DTYPES: tuple[str, ...] = ("fp8", "mxfp4")
# --kv-cache-dtype values that store the 584 B fp8_ds_mla format.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_ds_mla")
# Tokens per kernel block (64 per SWA block, 64 C4 / 2 C128 entries per block).
KERNEL_BLOCK_SIZE = 256
# vLLM compress ratio -> layer kind (0 and 1 both mean sliding-window only).
LAYER_KINDS: dict[int, str] = {0: "swa", 1: "swa", 4: "c4", 128: "c128"}


def layer_kind(compress_ratio: int) -> str:
    """``"swa"``, ``"c4"`` or ``"c128"`` for a vLLM compress ratio (the one
    definition: the workspace's sizing and the layers import it).

    Raises:
        ValueError: not an int (bools and strings included), or a ratio
            DeepSeek-V4 does not use (the message lists the supported ones).
    """
    kind = None
    if not isinstance(compress_ratio, bool):
        try:
            kind = LAYER_KINDS.get(operator.index(compress_ratio))
        except TypeError:
            kind = None
    if kind is None:
        raise ValueError(
            f"compress_ratio: expected one of {sorted(LAYER_KINDS)} (0 and 1: sliding window "
            f"only, 4: C4, 128: C128), got {compress_ratio!r}"
        )
    return kind
