# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU layer's workspace at load in a real vLLM engine: ``private`` beyond
the memory budget is refused before serving (``WorkspaceBudgetError`` with the
alternatives), ``shared`` is not checked, and the micro-batch count is vLLM's
``parallel_config.num_ubatches``.

Each engine runs in a subprocess (this file as a script, in-process engine) in
which ``layer.core.reserve_budget_bytes`` (the CPU layer reserves through
``core.reserve_and_report``) is replaced by a 1-byte budget: no
machine has that little memory, so the refusal is the layer's wiring, not
this box's size.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs" / "tiny-dsv4"


def _worker(policy: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_DSV4_WORKSPACE"] = policy
    import vllm_dsv4_backend.layer.core as core
    from tests.support.vllm_helpers import exit_with_report

    devices: list[str] = []

    def one_byte(device, *args):
        devices.append(str(device))
        return 1

    core.reserve_budget_bytes = one_byte
    from vllm import LLM

    report: dict = {}
    try:
        LLM(model=str(MODEL), load_format="dummy", tokenizer_mode="hf", kv_cache_dtype="fp8",
            enforce_eager=True, max_model_len=256, seed=0,
            attention_backend="FLASHMLA_SPARSE_DSV4")
        report["loaded"] = True
    except Exception as e:  # noqa: BLE001  (the report is the point)
        report.update(loaded=False, type=type(e).__name__, message=str(e),
                      is_value_error=isinstance(e, ValueError))
    report["budget_devices"] = devices
    exit_with_report(out_path, report)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


pytest.importorskip("vllm")

from tests.support.vllm_helpers import run_script_report  # noqa: E402


def _load(policy: str, tmp_path: Path) -> dict:
    return run_script_report(__file__, [policy], tmp_path / f"{policy}.json", timeout=900)


@pytest.mark.vllm
@pytest.mark.slow
def test_private_over_budget_is_refused_at_load(tmp_path):
    r = _load("private", tmp_path)
    assert r["loaded"] is False, r
    assert r["type"] == "WorkspaceBudgetError" and r["is_value_error"], r
    msg = r["message"]
    for part in ("VLLM_DSV4_WORKSPACE=private needs", "for 4 layers", "per layer: C4",
                 "the budget is 1 bytes", "VLLM_DSV4_WORKSPACE=shared (the default",
                 "--max-num-batched-tokens"):
        assert part in msg, (part, msg)
    assert r["budget_devices"] == ["cpu"]  # asked once, for the model's device


@pytest.mark.vllm
@pytest.mark.slow
def test_shared_is_not_checked_against_the_budget(tmp_path):
    r = _load("shared", tmp_path)
    assert r["loaded"] is True, r
    assert r["budget_devices"] == ["cpu"]


@pytest.mark.vllm
@pytest.mark.parametrize(("parallel", "want"), [
    (SimpleNamespace(use_ubatching=False, num_ubatches=2), 1),
    (SimpleNamespace(use_ubatching=True, num_ubatches=2), 2),  # --enable-dbo
    (SimpleNamespace(use_ubatching=True, num_ubatches=4), 4),  # --ubatch-size 4
    (SimpleNamespace(use_ubatching=True), 2),  # a vLLM without num_ubatches: DBO's 2
])
def test_cpu_layer_reserves_vllms_micro_batch_count(parallel, want):
    from vllm_dsv4_backend.layer import core

    assert core.num_ubatches(parallel) == want


@pytest.mark.vllm
@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 2}])
def test_scheduler_stays_within_the_reserved_tokens(spec):
    """The workspace reserves scheduler_config.max_num_batched_tokens rows (the CPU
    layer passes it); vLLM's scheduler, speculative verification tokens included,
    schedules at most that per step, and CUDA-graph sizes never exceed it."""
    from vllm.engine.arg_utils import EngineArgs

    extra = {} if spec is None else {"speculative_config": spec}
    cfg = EngineArgs(model=str(MODEL), load_format="dummy", tokenizer_mode="hf",
                     max_model_len=256, kv_cache_dtype="fp8",
                     attention_backend="FLASHMLA_SPARSE_DSV4", **extra).create_engine_config()
    mnbt = cfg.scheduler_config.max_num_batched_tokens
    scheduled = cfg.scheduler_config.max_num_scheduled_tokens
    assert scheduled is None or scheduled <= mnbt
    assert all(s <= mnbt for s in cfg.compilation_config.cudagraph_capture_sizes or [])
    cap = cfg.compilation_config.max_cudagraph_capture_size
    assert cap is None or cap <= mnbt
