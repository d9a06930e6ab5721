# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm-dsv4-bench step-ab`` on a real engine (a subprocess: the bench runs vLLM in its
own process): the side switch really alternates the layer classes and builders step by
step, the generation is token for token the plugin-only one (the two sides are bitwise
equal), the steps where a compressor window closes are shared evenly between the sides
(strict alternation gave them all to one side), every case forms pairs of every part,
the ratios are finite, and ``--threads`` sets the engine's thread count. Its pairing
arithmetic is tests/core/test_step_ab.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_ab_alternates_sides_on_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "step-ab.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DSV4_")}
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dsv4_backend.bench.step_ab", "--batches", "1,4",
         "--requests", "1", "--output-len", "12", "--prefill", "300", "--threads", "1",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["schema"] == "vllm-dsv4-step-ab/2"
    # --threads 1, the served worker's count, holds through vLLM's thread binding.
    assert res["threads"] == 1
    assert "(tiny model, 1 thread(s))" in proc.stdout
    assert res["tokens_identical"] == {"decode_b1": True, "decode_b4": True}
    assert [r["case"] for r in res["rows"]] == ["decode_b1", "decode_b4", "prefill_300"]
    for row in res["rows"]:
        # 16-token prompts, 11 decode steps each: positions 19 and 23 close a C4 window.
        closing = row["closing_steps"]
        assert closing["plugin"] >= 1 and abs(closing["plugin"] - closing["vllm"]) <= 1, row
        # The attention layers' timer runs inside the forward's, on both sides: each
        # step's attention time is a part of its forward time (nesting, not speed).
        for side in ("plugin", "vllm"):
            assert 0 < row["attn"][f"{side}_ms_median"] < row["forward"][f"{side}_ms_median"]
        # The figures exist and are finite; their size is the benchmark's to print,
        # never a test's to judge (a loaded CI machine measured a ratio of 5.04).
        for part in ("step", "build", "forward", "attn"):
            x = row[part]
            assert x["pairs"] >= 1, (row["case"], part)
            assert math.isfinite(x["ratio_median"]) and x["ratio_median"] > 0
            assert x["plugin_ms_median"] > 0 and x["vllm_ms_median"] > 0
    assert "tokens of an alternating run equal the plugin-only run" in proc.stdout
