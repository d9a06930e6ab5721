# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU layer's lease plan (``layer.plan.LEASE_PLAN["cpu"]``) against the
leases it really takes while serving the tiny model in-process: a prompt
longer than 4 x index_topk (so the lightning indexer's real top-k runs, not
the short-context fill), then decode. Every planned (kind, family, view) the
indexer dtype has is used, nothing else is, and the workspace reserves
exactly the planned views.

The engine runs in a subprocess (this file as a script, in-process engine)
whose ``Lease.__getitem__`` records each view a layer reads or writes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs" / "tiny-dsv4"


def _worker(dtype: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_DSV4_ATTN_IMPL"] = "plugin"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.plugins import load_general_plugins

    from tests.support.vllm_helpers import TINY_ENGINE, exit_with_report
    from vllm_dsv4_backend.formats.constants import layer_kind
    from vllm_dsv4_backend.layer import core
    from vllm_dsv4_backend.layer.plan import LEASE_PLAN
    from vllm_dsv4_backend.workspace.manager import Lease

    taken: set[tuple[str, str, str]] = set()
    getitem = Lease.__getitem__

    def spy(self, name):
        taken.add((layer_kind(self._manager.layers[self.layer_name]), self.family, name))
        return getitem(self, name)

    Lease.__getitem__ = spy
    load_general_plugins()
    engine = {"attention_config": {"use_fp4_indexer_cache": True}} if dtype == "mxfp4" else {}
    cfg = json.loads((MODEL / "config.json").read_text())
    llm = LLM(model=str(MODEL), **{**TINY_ENGINE, **engine})
    n = 4 * int(cfg["index_topk"]) + 150
    vocab = int(cfg["vocab_size"])
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i) % (vocab - 10) + 3 for i in range(n)]),
               TokensPrompt(prompt_token_ids=list(range(3, 40)))]
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0),
                 use_tqdm=False)
    managers = list(core._managers.values())
    ws = managers[0]
    c = ws.config
    dtype = c.params["indexer_kv_dtype"]
    plan = LEASE_PLAN["cpu"][dtype]
    report = {
        "managers": len(managers),
        "indexer_kv_dtype": dtype,
        "plan": c.params["plan"],
        "taken": sorted(taken),
        "planned": sorted((k, f, v) for k, fams in plan.items() for f, views in fams.items()
                          for v in views if v in {s.name for s in c.family_buffers(f)}),
        "reserved": sorted({(f, s.name) for f in c.family_names for s in c.family_buffers(f)
                            if any(f in c.layer_families(r) for r in ws.layers.values())}),
        "per_family": ws.stats()["reserved_bytes_per_family"],
    }
    exit_with_report(out_path, report)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


pytest.importorskip("vllm")

from tests.support.vllm_helpers import run_script_report  # noqa: E402


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_served_leases_are_the_lease_plan(dtype, tmp_path):
    r = run_script_report(__file__, [dtype], tmp_path / "report.json", timeout=1500,
                          env={**os.environ, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1500"})
    assert r["managers"] == 1 and r["indexer_kv_dtype"] == dtype
    assert r["plan"] == "cpu"  # serving's builder with the CPU layer's own plan
    taken = {tuple(t) for t in r["taken"]}
    planned = {tuple(t) for t in r["planned"]}
    assert taken == planned, (taken - planned, planned - taken)
    assert {tuple(t) for t in r["reserved"]} == {(f, v) for _, f, v in planned}
    # The CPU layer leases no scratch: the family is not reserved at all.
    assert "compressor" not in r["per_family"]
    assert set(r["per_family"]) == {f for _, f, _ in planned}

