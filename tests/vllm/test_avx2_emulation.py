# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``scripts/as_avx2.sh`` (how an AVX512-BF16 machine runs the AVX2 half of the suite and
the AVX2 benchmark figures) really puts a process on the AVX2 path: vLLM loads its AVX2
library, which lacks every DeepSeek-V4 C++ op, the plugin registers its torch fallbacks
under their names, and the plugin's C++ path reports itself unavailable. On an AVX2
machine the script changes nothing and the same holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
from vllm_dsv4_backend.ops import vllm_cpu
from vllm_dsv4_backend.vllm_compat import cpu_ops
missing = cpu_ops.missing_ops()
cpu_ops.register_missing()
print(json.dumps({
    "cap": torch.backends.cpu.get_cpu_capability(),
    "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
    "amx": torch.cpu._is_amx_tile_supported(),
    "vllm_base_op": hasattr(torch.ops._C, "rms_norm"),
    "missing": missing, "ops": [op.name for op in cpu_ops.OPS],
    "fallback": [cpu_ops.is_fallback(op.name) for op in cpu_ops.OPS],
    "vllm_cpu": vllm_cpu.load()[0],
}))
"""


def test_as_avx2_runs_the_fallback_path() -> None:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "as_avx2.sh"), sys.executable, "-c",
                        PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["cap"] == "AVX2" and not got["avx512_bf16"] and not got["amx"]
    assert got["vllm_base_op"], "vLLM's AVX2 kernel library did not load"
    assert sorted(got["missing"]) == sorted(got["ops"]), "a DeepSeek-V4 C++ op was loaded"
    assert all(got["fallback"]) and got["vllm_cpu"] is False
