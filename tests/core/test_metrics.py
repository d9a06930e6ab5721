# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workspace's figures for ``/metrics`` (``vllm_dsv4_backend.metrics``), without
vLLM: a workspace reserved through the layer core publishes into the metrics
directory after each model step's last layer, and the front end's collector turns
every live process's files into Prometheus series, summed per rank. The served
scrape is ``tests/vllm/test_workspace_metrics_served.py``."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from vllm_dsv4_backend import metrics  # noqa: E402
from vllm_dsv4_backend.layer import core  # noqa: E402


def _vllm_config(rank: int = 0, dp: int = 0) -> SimpleNamespace:
    hf = SimpleNamespace(index_n_heads=4, index_head_dim=64, index_topk=8)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, served_model_name=["tiny"]),
        attention_config=SimpleNamespace(resolve_indexer_kv_dtype=lambda default: "fp8"),
        parallel_config=SimpleNamespace(use_ubatching=False, rank=rank, data_parallel_rank=dp),
        device_config=SimpleNamespace(device="cpu"),
    )


def _layer() -> SimpleNamespace:
    return SimpleNamespace(max_num_batched_tokens=16, n_local_heads=4, padded_heads=8,
                           head_dim=32)


def scrape(path: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The collector's series as ``{(sample name, sorted labels): value}``."""
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.WorkspaceCollector(path))
    text = prometheus_client.generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def lab(**extra: str) -> tuple[tuple[str, str], ...]:
    """Sorted labels of rank 0's series (``rank`` overridable) plus ``extra``."""
    return tuple(sorted({"engine": "0", "model_name": "tiny", "rank": "0", **extra}.items()))


def _serve(monkeypatch: pytest.MonkeyPatch, path: Path, rank: int, steps: int) -> object:
    ws = core.manager_for(_vllm_config(rank), _layer(), "cpu", model_key=object())
    for name, ratio in (("layers.0", 0), ("layers.1", 4), ("layers.2", 4)):
        ws.add_layer(name, ratio)
    core.reserve_and_report(ws, "CPU")
    holders = [core.RegionHolder(ws, n, platform="CPU") for n in ws.layers]
    for _ in range(steps):
        for h in holders:
            with h.open(4) as region:
                region.lease("q")
    return ws


def test_figures_per_rank_move_with_the_steps(monkeypatch, tmp_path):
    monkeypatch.setattr(core, "_managers", {})
    monkeypatch.setenv("VLLM_DSV4_METRICS_DIR", str(tmp_path))
    ws0 = _serve(monkeypatch, tmp_path, rank=0, steps=3)
    _serve(monkeypatch, tmp_path, rank=1, steps=5)
    got = scrape(str(tmp_path))
    r0 = lab(rank="0")
    r1 = lab(rank="1")
    assert got[("vllm_dsv4_workspace_model_steps_total", r0)] == 3
    assert got[("vllm_dsv4_workspace_model_steps_total", r1)] == 5
    # Every layer leases q once per step; the last step's leases are in (published
    # after the last layer, not at the next step's start).
    assert got[("vllm_dsv4_workspace_leases_total", r0)] == 9
    assert got[("vllm_dsv4_workspace_leases_total", r1)] == 15
    assert got[("vllm_dsv4_workspace_leased_family_allocations_total", r0)] == 0
    assert got[("vllm_dsv4_workspace_fence_waits_total", r0)] == 0
    per_family = ws0.stats()["reserved_bytes_per_family"]
    for fam, n in per_family.items():
        assert got[("vllm_dsv4_workspace_reserved_bytes", lab(family=fam))] == n
    assert sum(per_family.values()) == ws0.stats()["reserved_bytes_total"] > 0
    assert got[("vllm_dsv4_workspace_layers", lab(kind="C4"))] == 2
    assert got[("vllm_dsv4_workspace_layers", lab(kind="SWA"))] == 1
    assert got[("vllm_dsv4_workspace_info", lab(platform="CPU", policy="shared"))] == 1
    assert got[("vllm_dsv4_workspace_peak_leased_bytes", r0)] > 0
    # Nothing per request: no label beyond rank, family / kind and the info pair.
    labels = {k for _, lab in got for k, _ in lab}
    assert labels == {"engine", "model_name", "rank", "family", "kind", "platform", "policy"}


def test_dead_process_and_torn_files_are_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(core, "_managers", {})
    monkeypatch.setenv("VLLM_DSV4_METRICS_DIR", str(tmp_path))
    _serve(monkeypatch, tmp_path, rank=0, steps=1)
    (jsn,) = tmp_path.glob("ws-*.json")
    dead = tmp_path / "ws-999999999-0"
    dead.with_suffix(".json").write_text(jsn.read_text().replace(
        f'"pid": {os.getpid()}', '"pid": 999999999'))
    dead.with_suffix(".bin").write_bytes((jsn.with_suffix(".bin")).read_bytes())
    (tmp_path / "ws-1-9.json").write_text("{not json")
    got = scrape(str(tmp_path))
    steps = [v for (n, _), v in got.items() if n == "vllm_dsv4_workspace_model_steps_total"]
    assert steps == [1]


def test_off_and_no_directory_publish_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(core, "_managers", {})
    monkeypatch.setenv("VLLM_DSV4_METRICS_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_DSV4_METRICS", "0")
    _serve(monkeypatch, tmp_path, rank=0, steps=1)
    monkeypatch.delenv("VLLM_DSV4_METRICS")
    monkeypatch.delenv("VLLM_DSV4_METRICS_DIR")
    _serve(monkeypatch, tmp_path, rank=1, steps=1)
    assert list(tmp_path.iterdir()) == []


def test_frontend_makes_a_fresh_directory_and_registers_once(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "_frontend", {})
    registered = []
    monkeypatch.setattr(prometheus_client.REGISTRY, "register", registered.append)
    monkeypatch.setenv("VLLM_DSV4_METRICS_DIR", str(tmp_path))  # a parent's: replaced
    monkeypatch.setattr(metrics.atexit, "register", lambda *a: None)
    path = metrics.setup_frontend()
    assert path is not None and path != str(tmp_path)
    assert not os.path.exists(path)  # created by the first publisher only
    assert os.environ["VLLM_DSV4_METRICS_DIR"] == path
    assert metrics.setup_frontend() == path and len(registered) == 1
    assert isinstance(registered[0], metrics.WorkspaceCollector)
    assert list(registered[0].collect())  # a missing directory: empty families, no error



def test_several_api_servers_get_the_series_through_prometheus_multiprocess(monkeypatch,
                                                                           tmp_path):
    """Under ``--api-server-count > 1`` (the default with DP) vLLM sets
    ``PROMETHEUS_MULTIPROC_DIR`` and ``/metrics`` is prometheus_client's multiprocess
    collector over it: the publisher writes the same series there."""
    from prometheus_client import multiprocess

    monkeypatch.setattr(core, "_managers", {})
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp_dir))
    monkeypatch.setenv("VLLM_DSV4_METRICS_DIR", str(tmp_path / "ours"))
    ws = _serve(monkeypatch, tmp_path, rank=1, steps=4)
    registry = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(mp_dir))
    text = prometheus_client.generate_latest(registry).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    r1 = lab(rank="1")
    assert got[("vllm_dsv4_workspace_model_steps_total", r1)] == 4
    assert got[("vllm_dsv4_workspace_leases_total", r1)] == 12
    assert got[("vllm_dsv4_workspace_fence_waits_total", r1)] == 0
    for fam, n in ws.stats()["reserved_bytes_per_family"].items():
        assert got[("vllm_dsv4_workspace_reserved_bytes", lab(rank="1", family=fam))] == n
    assert got[("vllm_dsv4_workspace_layers", lab(rank="1", kind="C4"))] == 2


def test_counters_are_named_not_positional() -> None:
    """The live counters are keyed by name (workspace.live.LIVE_COUNTERS): totals in
    any order give the same figures, and the /metrics series keep their names."""
    from vllm_dsv4_backend.workspace.live import LiveCounters

    live = LiveCounters()
    live.tick({"fallbacks": 0, "fence_waits": 0, "allocations": 0, "leases": 0})
    live.tick({"fence_waits": 1, "leases": 3, "fallbacks": 2, "allocations": 0})
    snap = live.snapshot({"leases": 5, "allocations": 0, "fence_waits": 1, "fallbacks": 2})
    assert (snap["leases_max_per_step"], snap["fence_waits_max_per_step"],
            snap["fallbacks_max_per_step"], snap["leases_total"]) == (3, 1, 2, 5)
    # (A new counter adds a series and a field after these.)
    assert [f"{metrics.PREFIX}_{series}" for _, series, _ in metrics.COUNTER_SERIES][:5] == [
        "vllm_dsv4_workspace_model_steps", "vllm_dsv4_workspace_leases",
        "vllm_dsv4_workspace_leased_family_allocations", "vllm_dsv4_workspace_fence_waits",
        "vllm_dsv4_workspace_fallbacks"]
    assert metrics.FIELDS[:5] == ("model_steps", "leases", "allocations", "fence_waits",
                                  "fallbacks")
