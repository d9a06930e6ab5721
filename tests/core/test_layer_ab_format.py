# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""bench.layer_ab's table without vLLM: rows with the median's CI, and a case whose batch
never formed is named as not measured instead of vanishing from the table."""

from vllm_dsv4_backend.bench import layer_ab as L


def test_rows_and_missing_cases() -> None:
    row = L._row("decode_b1", "c4", 1, [1.0, 1.0, 1.0], [1.2, 1.1, 1.3], 3,
                 {"plugin_allocs": 5, "vllm_allocs": 9})
    assert row["ratio_median"] == 1.2 and (row["ratio_ci95_lo"], row["ratio_ci95_hi"]) == (1.1, 1.3)
    res = {"model": "tiny", "threads": 2, "rows": [row], "missing_cases": ["decode_b32"],
           "ratio_median_all": 1.2}
    text = L.format_result(res)
    assert "decode_b1" in text and "3/3" in text and "5/9" in text
    assert "decode_b32: not measured" in text
