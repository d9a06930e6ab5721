# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layer core both platforms share (``vllm_dsv4_backend.layer.core``),
without vLLM: the workspace config from a vLLM-shaped config, the per-model
registry, reserve-and-report, the step holder, and the one ``layer_kind``."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_dsv4_backend.formats import constants
from vllm_dsv4_backend.layer import core
from vllm_dsv4_backend.workspace import sizing


def _vllm_config(dtype: str = "fp8", ubatching: bool = False) -> SimpleNamespace:
    hf = SimpleNamespace(index_n_heads=4, index_head_dim=64, index_topk=8)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf),
        attention_config=SimpleNamespace(resolve_indexer_kv_dtype=lambda default: dtype),
        parallel_config=SimpleNamespace(use_ubatching=ubatching, num_ubatches=3),
        device_config=SimpleNamespace(device="cpu"),
    )


def _layer() -> SimpleNamespace:
    return SimpleNamespace(max_num_batched_tokens=16, n_local_heads=4, padded_heads=8,
                           head_dim=32)


def test_one_layer_kind():
    assert sizing.layer_kind is constants.layer_kind is core.layer_kind
    assert [constants.layer_kind(r) for r in (0, 1, 4, 128)] == ["swa", "swa", "c4", "c128"]
    for bad in (16, 2, -4, True, "4", 4.0, None):
        with pytest.raises(ValueError, match=r"\[0, 1, 4, 128\]"):
            constants.layer_kind(bad)
    with pytest.raises(ValueError):
        sizing.layer_families(16)


@pytest.mark.parametrize(("asked", "want"), [("fp8", "fp8"), ("mxfp4", "mxfp4"),
                                             ("bf16", "fp8")])
def test_workspace_config_from_vllm_config(asked, want):
    cfg = core.workspace_config(_vllm_config(asked, ubatching=True), _layer(), "cuda")
    assert (cfg.max_num_batched_tokens, cfg.num_local_heads, cfg.padded_q_heads,
            cfg.head_dim) == (16, 4, 8, 32)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (4, 64, 8)
    assert cfg.indexer_kv_dtype == want
    assert cfg.num_ubatches == 3
    assert [s.name for s in cfg.family_buffers("q")] == ["out"]
    assert cfg.lease_plan == core.lease_plan("cuda", want)


def _reserved(cfg: sizing.WorkspaceConfig) -> dict[str, dict[str, list[str]]]:
    return {kind: {f: [s.name for s in cfg.family_buffers(f)] for f in cfg.layer_families(r)}
            for kind, r in (("swa", 0), ("c4", 4), ("c128", 128))}


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_lease_plan_is_what_sizing_reserves(platform, dtype):
    """The workspace reserves exactly the plan's (family, view) pairs: no
    ``topk.local`` (both layers write vLLM's topk_indices_buffer), no padded
    q (vLLM's fused q-norm/RoPE kernel returns its own), compressor scratch
    only for CUDA's C128 layers, MXFP4 scales only under MXFP4."""
    vc = _vllm_config(dtype)
    cfg = core.workspace_config(vc, _layer(), platform)
    indexer_q = ["q", "weights"] if dtype == "fp8" else ["q", "scales", "weights"]
    topk = ["global"] if (platform, dtype) == ("cpu", "fp8") else ["global", "lens"]
    want = {"swa": {"q": ["out"]},
            "c4": {"q": ["out"], "indexer_q": indexer_q, "topk": topk},
            "c128": {"q": ["out"]}}
    if platform == "cuda":
        want["c128"]["compressor"] = ["scratch"]
    assert _reserved(cfg) == want
    no_plan = sizing.WorkspaceConfig(max_num_batched_tokens=16, num_local_heads=4,
                                     padded_q_heads=8, indexer_kv_dtype=dtype)
    assert [s.name for s in no_plan.family_buffers("topk")] == ["local", "global", "lens"]
    assert no_plan.layer_families(4) == sizing.FAMILIES


def test_lease_plan_refuses_unknown_names():
    with pytest.raises(ValueError, match="platform"):
        core.lease_plan("tpu", "fp8")
    with pytest.raises(ValueError, match="unknown family"):
        sizing.LeasePlan({"c4": {"kv": ("q",)}})
    with pytest.raises(ValueError, match="views"):
        sizing.LeasePlan({"c4": {"topk": ("idx",)}})
    with pytest.raises(ValueError, match="one kind and"):
        sizing.LeasePlan({"c4": {"q": ("out",)}, "swa": {"q": ("q", "out")}})


def test_sizing_table_sizes_the_plans(capsys):
    """At 8192 tokens (TP 1) the plan drops what no layer leases: under
    ``shared`` CUDA keeps C128's compressor scratch, CPU reserves none, and
    neither reserves ``topk.local``; the #49236 pool is 548 MiB."""
    mib = sizing.MIB
    rows = {p: sizing.memory_table(tp_sizes=(1,), policies=("shared",),
                                   lease_plans={d: core.lease_plan(p, d)
                                                for d in sizing.INDEXER_KV_DTYPES})
            for p in ("cpu", "cuda")}
    old = sizing.memory_table(tp_sizes=(1,), policies=("shared",))
    for p, rs in rows.items():
        for r, o in zip(rs, old, strict=True):
            assert round(r["pool49236"] / mib) == 548
            lens = 8192 * 4 if (p, r["indexer"]) == ("cpu", "fp8") else 0
            assert r["topk"] == o["topk"] - 8192 * 512 * 4 - lens
            assert r["compressor"] == (8192 * 512 * 4 if p == "cuda" else 0)
    sizing.main(["--tp", "1"])
    out = capsys.readouterr().out
    assert "cpu: the layer's lease plan" in out and "cuda: the layer's lease plan" in out


def test_num_ubatches():
    assert core.num_ubatches(SimpleNamespace(use_ubatching=False, num_ubatches=4)) == 1
    assert core.num_ubatches(SimpleNamespace(use_ubatching=True, num_ubatches=4)) == 4
    assert core.num_ubatches(SimpleNamespace(use_ubatching=True)) == 2


def test_registry_one_manager_per_model_and_key(monkeypatch):
    monkeypatch.setattr(core, "_managers", {})
    vc = _vllm_config()
    a = core.manager_for(vc, _layer(), "cpu")
    assert core.manager_for(vc, _layer(), "cpu") is a
    key = object()
    b = core.manager_for(vc, _layer(), "cpu", key)
    assert b is not a and core.manager_for(vc, _layer(), "cpu", key) is b
    assert core.manager_for(_vllm_config(), _layer(), "cpu") is not a


def test_reserve_and_report_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(core, "_managers", {})
    ws = core.manager_for(_vllm_config("mxfp4"), _layer(), "cpu")
    ws.add_layer("layers.0", 4)
    ws.add_layer("layers.1", 128)
    caplog.set_level(logging.INFO, logger="vllm_dsv4_backend")
    assert core.reserve_and_report(ws, "CPU") is True
    assert core.reserve_and_report(ws, "CPU") is False
    lines = [r.getMessage() for r in caplog.records if "workspace (CPU)" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "policy shared" in lines[0] and "1 micro-batch(es)" in lines[0]
    assert "indexer_q" in lines[0] and "for 2 layers" in lines[0]


def test_step_holder_per_micro_batch(monkeypatch):
    monkeypatch.setattr(core, "_managers", {})
    ws = core.manager_for(_vllm_config(ubatching=True), _layer(), "cpu")
    ws.add_layer("layers.0", 0)
    ws.reserve()
    ids = [0]
    monkeypatch.setattr(core, "ubatch_id", lambda: ids[0])
    holder = core.StepHolder(ws, "layers.0")
    assert holder.current() is None
    with holder.open(4) as s0:
        assert holder.current() is s0 and holder.home() == "cpu"
        ids[0] = 2
        assert holder.current() is None
        with holder.open(2) as s2:
            assert holder.current() is s2 and s2.ubatch == 2
            s2.lease("q")
        ids[0] = 0
        assert holder.current() is s0
    assert holder.current() is None
    assert ws.stats()["leased_bytes_now"] == 0


@pytest.mark.parametrize("every", [0, 2])
def test_model_steps_and_live_summary(monkeypatch, caplog, every):
    """One model step per forward of the first registered layer for
    micro-batch 0 (``model_step``, not the benchmark's ``begin_step``); the
    summary every ``VLLM_DSV4_WORKSPACE_LOG_EVERY`` steps (0: never)."""
    monkeypatch.setattr(core, "_managers", {})
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE_LOG_EVERY", str(every))
    finalizers = []
    monkeypatch.setattr(core.multiprocessing.util, "Finalize",
                        lambda obj, fn, **k: finalizers.append(fn))
    ws = core.manager_for(_vllm_config(ubatching=True), _layer(), "cpu")
    ws.add_layer("layers.0", 4)
    ws.add_layer("layers.1", 0)
    ws.reserve()
    ids = [0]
    monkeypatch.setattr(core, "ubatch_id", lambda: ids[0])
    holders = [core.StepHolder(ws, n, platform="CPU") for n in ("layers.0", "layers.1")]
    caplog.set_level(logging.INFO, logger="vllm_dsv4_backend")
    for _ in range(5):
        for u in (0, 1):
            ids[0] = u
            for h in holders:
                with h.open(4) as step:
                    step.lease("q")
    live = ws.live_stats()
    assert live["steps"] == 5 and ws.stats()["steps"] == 0
    assert live["leases_total"] == 5 * 2 * 2 and live["leases_per_step"] == 4.0
    assert live["leases_max_per_step"] == 4
    assert live["allocations_total"] == 0
    assert live["reserved_bytes_total"] == ws.stats()["reserved_bytes_total"] > 0
    lines = [r.getMessage() for r in caplog.records if "workspace live (CPU)" in r.getMessage()]
    if every == 0:
        assert lines == [] and finalizers == []
        return
    assert len(lines) == 2 and "4 model steps" in lines[1], lines
    assert "leases 4.0/step" in lines[1] and "allocations in leased families 0.0/step" in lines[1]
    assert len(finalizers) == 1
    finalizers[0]()
    assert "5 model steps" in caplog.records[-1].getMessage()
    assert "at shutdown" in caplog.records[-1].getMessage()
