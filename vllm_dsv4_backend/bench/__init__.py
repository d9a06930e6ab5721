# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmarks (not tests): ``python -m vllm_dsv4_backend.bench.kernels`` times the sparse MLA
kernels; ``vllm-dsv4-bench`` (:mod:`.cli`) the eager region under the workspace policies, and
its ``step-ab`` / ``layer-ab`` / ``e2e-layers`` / ``solo-identity`` commands the plugin's
layer against vLLM's own."""

from __future__ import annotations

import functools
import json
import math
import statistics
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


_EXACT_SIGNED_RANK_MAX_N = 150


def _signed_rank_cut_normal(n: int) -> int:
    """:func:`_signed_rank_cut` by the normal approximation of ``T+``."""
    return max(0, math.floor(n * (n + 1) / 4
                             - 1.96 * math.sqrt(n * (n + 1) * (2 * n + 1) / 24)))


@functools.cache  # one summary asks it for the same n once per metric
def _signed_rank_cut(n: int) -> int:
    """0-based rank of the lower 95% bound among the ``n(n+1)/2`` sorted Walsh averages: the
    largest ``t`` with ``P(T+ <= t) <= 0.025`` under the signed-rank null (exact up to
    ``n = 150``, the normal approximation above), 0 where even ``t = 0`` is too likely."""
    if n > _EXACT_SIGNED_RANK_MAX_N:
        return _signed_rank_cut_normal(n)
    top = n * (n + 1) // 2
    counts = [1] + [0] * top  # subsets of ranks 1..n by their sum
    for r in range(1, n + 1):
        for t in range(top, r - 1, -1):
            counts[t] += counts[t - r]
    cut, cum = 0, 0
    for t, c in enumerate(counts):
        cum += c
        if cum * 40 > 2**n:  # P(T+ <= t) > 0.025
            break
        cut = t
    return cut


def hodges_lehmann_ci(ratios: Sequence[float]) -> tuple[float, float, float]:
    """Hodges-Lehmann estimate of the centre of the positive ``ratios`` (non-empty) and its
    distribution-free 95% confidence interval (Wilcoxon signed rank), on their logs:
    ``(estimate, lo, hi)``.

    The estimate is exp of the median of the Walsh averages ``(y_i + y_j) / 2``, ``i <= j``,
    of ``y = log(ratios)``; the interval is exp of the sorted Walsh averages of 0-based
    rank ``k`` and ``N - 1 - k`` (``N = n(n+1)/2``, ``k``: :func:`_signed_rank_cut`), so it
    holds the centre with probability >= 95% (min..max below n = 6, where 95% is
    unreachable). Logs make a ratio and its inverse symmetric. It assumes the log ratios
    are symmetric about their centre, which paired rounds whose order alternates give;
    then it needs about 2/3 of the pairs the median needs for the same interval, and
    single outlying pairs move it as little."""
    if not ratios or any(not (isinstance(r, int | float) and 0 < r < math.inf)
                         for r in ratios):
        raise ValueError(f"ratios: expected a non-empty sequence of finite positive numbers, "
                         f"got {list(ratios)!r}")
    ys = [math.log(r) for r in ratios]
    n = len(ys)
    walsh = sorted((ys[i] + ys[j]) / 2 for i in range(n) for j in range(i, n))
    big = len(walsh)
    k = min(_signed_rank_cut(n), (big - 1) // 2)
    return (math.exp(statistics.median(walsh)), math.exp(walsh[k]),
            math.exp(walsh[big - 1 - k]))


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
