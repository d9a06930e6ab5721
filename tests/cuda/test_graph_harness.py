# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA-graph harness (tools/cuda_graph) against this environment's vLLM.

The installed vLLM's DeepSeek-V4 control flow is cut into a stand-in package
(``build_stub.py``, into a temporary folder), and the harness drives the
plugin's unmodified CUDA layer and vLLM's own through it, in a subprocess
(the stand-in ``vllm`` must be the first on the path, and this process may
have imported the real one). Every CPU mode must match its serial reference
bit for bit, the plugin's output must equal vLLM's, and both negative
controls must be detected. CUDA modes run too when this machine has CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _vllm_minor() -> str | None:
    try:
        v = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
    minor = ".".join(v.split(".")[:2])
    return minor if minor in ("0.33", "0.34") else None


pytestmark = pytest.mark.skipif(_vllm_minor() is None,
                                reason="needs vLLM 0.33 or 0.34 installed (.venv-vllm033/034)")


def test_harness_cpu_modes_bitwise_and_controls(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "tools" / "cuda_graph"))
    try:
        import build_stub
    finally:
        sys.path.pop(0)
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    stub = tmp_path / "stub"
    version, cuts = build_stub.build(Path(spec.origin).parent.parent, stub)
    assert version.startswith(_vllm_minor() + ".")
    names = {sym for sym, *_ in cuts}
    assert "vllm.models.deepseek_v4.attention:DeepseekV4Attention._sparse_indexer_and_attn" \
        in names

    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=f"{stub}{os.pathsep}{REPO}", PYTHONDONTWRITEBYTECODE="1")
    env.pop("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", None)
    p = subprocess.run([sys.executable, str(REPO / "tools" / "cuda_graph" / "harness.py"),
                        "--steps", "2", "--json", str(out)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert report["vllm"] == version
    assert report["stub"].startswith(str(stub))  # the stand-in shadowed the installed vLLM
    assert report["plugin_equals_vllm_cpu"] is True
    modes = report["modes"]
    assert {"eager", "private"} <= set(modes)
    for mode, entry in modes.items():
        for impl, res in entry.items():
            assert res["bitwise_equal"], (mode, impl, res)
    # 2 micro-batches x (7 q.out + 3 C4 x (indexer_q + topk) + 2 C128 compressor).
    assert modes["eager"]["plugin"]["leases_per_step"] == [30, 30]
    saved = [v - p for v, p in zip(modes["eager"]["vllm"]["allocations_per_step"],
                                   modes["eager"]["plugin"]["allocations_per_step"])]
    assert saved == [42, 42]  # the same 2 x 21 tensors, allocated by vLLM's layer
    controls = report["controls"]
    assert controls["wrong_standin_topk_off_by_one"]["detected"] is True
    assert controls["no_fence_schedule_cpu"]["detected"] is True
