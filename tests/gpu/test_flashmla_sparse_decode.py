# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.34's real FlashMLA sparse decode against the plugin's serial torch reference
(skipped without CUDA, or on a GPU FlashMLA has no kernels for).

FlashMLA comes from the carried bundle (``.scratch/gpu_bundle/flashmla``, or
``DSV4_FLASHMLA_BUNDLE``; made by ``bash scripts/gpu_check.sh --make-bundle``) on a box
without vLLM, else from an installed CUDA vLLM. The cases, the CUDA-graph replay and the
tolerance are tools/gpu_flashmla's: ``scripts/gpu_check.sh`` runs them once, in its
FlashMLA step (``check.py``, with a sanitizer pass and one JSON), and leaves this file out
of its pytest step; this file is for a GPU machine with pytest. If the ``.so`` does not
load on this torch the tests skip with the loader's error (``check.py`` fails on it).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

# tools/ runs from the checkout (pytest's pythonpath: the repo root); torch + the plugin only.
from tools.gpu_flashmla import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def iface() -> Any:
    from tools.gpu_flashmla import bundle, check

    if torch.cuda.get_device_capability(0)[0] not in (9, 10):
        pytest.skip("FlashMLA sparse decode has SM90a / SM100f kernels only")
    where = os.environ.get("DSV4_FLASHMLA_BUNDLE", str(bundle.DEFAULT_DEST))
    error = f"no bundle in {where}"
    if os.path.isfile(os.path.join(where, "manifest.json")):
        res, mod = check.step_load(os.path.abspath(where), dry=False)
        if mod is not None:
            return mod
        error = res.get("error", "load failed")
    try:
        import vllm._flashmla_C  # noqa: F401
        from vllm.third_party.flashmla import flash_mla_interface

        return flash_mla_interface
    except ImportError as e:
        pytest.skip(f"FlashMLA unavailable: {error}; installed vLLM: {e}")


@pytest.mark.parametrize("spec", cases.CASES, ids=lambda s: s.name)
def test_flashmla_matches_reference(iface: Any, spec: cases.CaseSpec) -> None:
    from tools.gpu_flashmla import runs

    res = runs.run_case(iface, spec, "cuda")
    worst = [{k: c[k].get(m) for k in ("out", "lse")
              for m in ("max_abs_err", "elements_out_of_tolerance", "cos_diff")}
             for c in res["calls"]]
    assert res["ok"], worst


def test_flashmla_cuda_graph_replay(iface: Any) -> None:
    from tools.gpu_flashmla import runs

    (spec,) = [s for s in cases.CASES if s.name == "c4a_h64"]
    res = runs.step_graph(iface, spec)
    assert res["status"] == "PASS", [r["ok"] for r in res["replays"]]
