# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""No test bounds a timing figure from above (docs/usage.md, "The test suite").

A test may check that a figure exists, is finite and positive; its size is the
machine's, and a loaded 2-core CI box once measured a step ratio of 5.04 where a test
required < 5. This scans every test file for an ``assert`` that compares a timing
name (``*_ms``, ``*_s``, ``ratio``, ``seconds``, ``elapsed``, ``speedup``, a clock
reading) with ``<`` / ``<=`` against a positive number, or a positive number against it
with ``>`` / ``>=``. Unit tests of the benchmarks' arithmetic compare synthetic
figures with ``==`` / ``approx`` and are not flagged.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

_TIMING = (r"(?:\w*_ms\w*|\w*_s\b[\"']?\]?|\w*ratio\w*|\w*seconds\w*|\w*elapsed\w*|"
           r"\w*speedup\w*|perf_counter\(\)|monotonic\(\)|time\(\))")
_POSITIVE = r"(?:[1-9][0-9_]*(?:\.[0-9]+)?|0\.[0-9]*[1-9][0-9]*)"
# figure < N, figure <= N; N > figure, N >= figure (N positive: "< 0" is no bound).
_BOUND = re.compile(
    rf"{_TIMING}[^<>=\n]*?<=?\s*{_POSITIVE}\b|{_POSITIVE}\s*>=?[^<>=\n]*?{_TIMING}")


def timing_bounds(text: str) -> list[str]:
    """The ``assert`` lines of ``text`` that bound a timing figure from above."""
    return [line.strip() for line in text.splitlines()
            if line.lstrip().startswith("assert") and _BOUND.search(line)]


def test_no_test_bounds_a_timing_figure() -> None:
    found = {str(p.relative_to(TESTS)): hits for p in sorted(TESTS.rglob("*.py"))
             if p != Path(__file__).resolve() and (hits := timing_bounds(p.read_text()))}
    assert found == {}, f"timing bounds in tests (check finite and positive instead): {found}"


def test_the_scan_flags_what_it_is_for() -> None:
    # The assertion that failed on a loaded CI box, and its kind.
    assert timing_bounds('assert math.isfinite(x["ratio_median"]) and 0.2 < x["ratio_median"] < 5')
    assert timing_bounds("    assert time.monotonic() - t0 < 60")
    assert timing_bounds('    assert 0 < m["mean_ttft_ms"] < 60_000')
    assert timing_bounds('    assert 0.09 <= r["tpot_s"] < 0.2')
    # What a test may check.
    assert not timing_bounds('assert math.isfinite(x["ratio_median"]) and x["ratio_median"] > 0')
    assert not timing_bounds('    assert row["ratio_median"] == 1.2')
    assert not timing_bounds('    assert 0 < row["attn"]["plugin_ms_median"] < row["forward"]["x"]')
