# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmarks (not tests): ``python -m vllm_dsv4_backend.bench.kernels`` times the sparse MLA
kernels; ``vllm-dsv4-bench`` (:mod:`.cli`) the eager region under the workspace policies, and
its ``step-ab`` / ``layer-ab`` / ``e2e-layers`` / ``solo-identity`` commands the plugin's
layer against vLLM's own."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def median_ci(xs: Sequence[float]) -> tuple[float, float]:
    """Distribution-free 95% confidence interval of the median of ``xs`` (non-empty): the
    order statistics ``x_(j)``, ``x_(k)`` (1-based) with ``j = floor(n/2 - 0.98 sqrt(n))``
    and ``k = ceil(1 + n/2 + 0.98 sqrt(n))`` (binomial, normal approximation), clamped to
    ``x_(1)`` and ``x_(n)``."""
    s = sorted(xs)
    n = len(s)
    half = 0.98 * n**0.5
    j = max(1, math.floor(n / 2 - half))
    k = min(n, math.ceil(1 + n / 2 + half))
    return s[j - 1], s[k - 1]


def verdict(lo: float | None, hi: float | None) -> str:
    """``plugin`` / ``vllm`` when the ratio's interval excludes 1 that way, else ``tie``."""
    if lo is None or hi is None:
        return "n/a"
    return "plugin" if lo > 1.0 else "vllm" if hi < 1.0 else "tie"


def finish(result: dict[str, Any], json_path: str | None, text: str) -> int:
    """A comparison's last step: the JSON result to ``json_path`` (if given), the table to
    stdout; returns exit code 0."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    print(text)
    return 0
