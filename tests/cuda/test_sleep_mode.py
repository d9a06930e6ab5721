# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sleep mode's call path with vLLM 0.33's / 0.34's real classes (registry entry
``sleep_mode_workspace_pool``), on CPU.

vLLM's real ``Worker._init_workspace_and_model_runner`` builds vLLM's workspace
manager with its ``alloc_context`` (the worker's real
``_maybe_get_memory_pool_context("workspace")``) on a simulated CUDA platform with
sleep mode on; the cuMem allocator is a recording stand-in that follows
``CuMemAllocator``'s rules (tags per allocation, ``sleep(offload_tags)`` backs up
those tags and discards the rest, ``wake_up(tags)`` maps back every tag outside
``DEFERRABLE_TAGS`` and the deferrable ones asked for). The plugin's reservation,
made while the model loads (inside the ``weights`` pool, as vLLM's ``load_model``
opens it), must land in the ``workspace`` pool; vLLM's real ``CuMemBackend`` then
discards it on sleep (no host copy) and maps it back on wake-up, also when only
``weights`` are woken; leases after wake-up are the addresses leased before. The
negative control reserves without the entry and lands in ``weights`` (offloaded).
That the bytes are really freed on a GPU is the GPU check's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.cuda_guard import require_vllm_cuda, vllm_minor

require_vllm_cuda()
MINOR = vllm_minor()

import vllm.device_allocator as device_allocator  # noqa: E402
import vllm.v1.worker.gpu_worker as gpu_worker  # noqa: E402
import vllm.v1.worker.workspace as vllm_workspace  # noqa: E402
from vllm.device_allocator.sleep_mode_backend import CuMemBackend  # noqa: E402

from vllm_dsv4_backend.layer import core  # noqa: E402
from vllm_dsv4_backend.vllm_compat import patches, sleep_mode  # noqa: E402


class RecordingCuMem:
    """``CuMemAllocator``'s tag bookkeeping, without cuMem: every ``torch.empty``
    inside ``use_memory_pool(tag)`` is an allocation of the innermost tag."""

    def __init__(self) -> None:
        self.tags: list[str] = []
        self.allocs: list[dict[str, Any]] = []  # tag, ptr, nbytes, state
        self.offload_tags: tuple[str, ...] | None = None

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        self.tags.append(tag or "default")
        try:
            yield
        finally:
            self.tags.pop()

    def record(self, t: torch.Tensor) -> None:
        if self.tags:
            self.allocs.append({"tag": self.tags[-1], "ptr": t.data_ptr(),
                                "nbytes": t.numel() * t.element_size(), "state": "mapped"})

    def get_current_usage(self) -> int:
        return 0

    def sleep(self, offload_tags: Any = None, discardable: Any = ()) -> None:
        tags = (offload_tags,) if isinstance(offload_tags, str) else tuple(offload_tags)
        self.offload_tags = tags
        for a in self.allocs:
            a["state"] = "offloaded" if a["tag"] in tags else "discarded"

    def wake_up(self, tags: list[str] | None = None) -> None:
        for a in self.allocs:  # CuMemAllocator.wake_up's rule
            if tags is None or a["tag"] in tags or a["tag"] not in device_allocator.DEFERRABLE_TAGS:
                a["state"] = "mapped"

    def of(self, ptr: int) -> dict[str, Any]:
        (hit,) = [a for a in self.allocs if a["ptr"] <= ptr < a["ptr"] + a["nbytes"]]
        return hit


@pytest.fixture
def cumem(monkeypatch: pytest.MonkeyPatch) -> RecordingCuMem:
    alloc = RecordingCuMem()
    platform = SimpleNamespace(is_cuda_alike=lambda: True, is_xpu=lambda: False,
                               is_cpu=lambda: False, is_rocm=lambda: False)
    monkeypatch.setattr(gpu_worker, "current_platform", platform)
    monkeypatch.setattr(gpu_worker, "get_mem_allocator_instance", lambda: alloc)
    monkeypatch.setattr(device_allocator, "get_mem_allocator_instance", lambda: alloc)
    empty = torch.empty

    def recording_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = empty(*args, **kwargs)
        alloc.record(t)
        return t

    monkeypatch.setattr(torch, "empty", recording_empty)
    # vLLM's real worker code builds vLLM's workspace manager with its alloc_context.
    worker = object.__new__(gpu_worker.Worker)
    worker.vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(enable_cumem_allocator=True, enable_sleep_mode=True),
        parallel_config=SimpleNamespace(enable_dbo=False))
    worker.device = torch.device("cpu")
    worker.rank = 1  # no usage report
    worker.use_v2_model_runner = True  # 0.33 reads it for the lane count
    monkeypatch.setattr(gpu_worker, "_num_workspace_lanes", lambda *a: 1)
    monkeypatch.setattr(worker, "_make_model_runner", lambda: object(), raising=False)
    monkeypatch.setattr(vllm_workspace, "_manager", None)
    gpu_worker.Worker._init_workspace_and_model_runner(worker)
    assert vllm_workspace.is_workspace_manager_initialized()
    return alloc


def _plugin_workspace() -> Any:
    hf = SimpleNamespace(index_n_heads=4, index_head_dim=64, index_topk=8)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, served_model_name=["m"]),
        attention_config=SimpleNamespace(resolve_indexer_kv_dtype=lambda default: "fp8"),
        parallel_config=SimpleNamespace(use_ubatching=False, rank=0, data_parallel_rank=0),
        device_config=SimpleNamespace(device="cpu"))
    layer = SimpleNamespace(max_num_batched_tokens=16, n_local_heads=4, padded_heads=8,
                            head_dim=32)
    ws = core.manager_for(vllm_config, layer, "cuda", model_key=object())
    ws.add_layer("layers.0", 0)
    ws.add_layer("layers.1", 4)
    return ws


def _lease_ptrs(ws: Any) -> list[int]:
    holder = core.RegionHolder(ws, "layers.1")
    with holder.open(8) as region:
        return [t.data_ptr() for t in region.lease("q").views.values()]


def _reserve_while_loading(cumem: RecordingCuMem, ws: Any) -> dict[str, Any]:
    with cumem.use_memory_pool("weights"):  # vLLM's load_model opens the weights pool
        assert core.reserve_and_report(ws, "CUDA")
    storage = ws.storage
    assert storage is not None
    return cumem.of(storage.data_ptr())


def test_entry_is_in_the_registry() -> None:
    p = patches.PATCHES[sleep_mode.PATCH]
    assert p.modules == (sleep_mode.MODULE,) and "cuda" in p.platforms
    assert "gpu_worker" in p.upstream


def test_worker_gives_its_workspace_the_workspace_tag(cumem: RecordingCuMem) -> None:
    # The fact the entry relies on: vLLM's own scratch is allocated under "workspace".
    with vllm_workspace.current_workspace_manager()._alloc_context():
        torch.empty(64, dtype=torch.uint8)
    assert cumem.allocs[-1]["tag"] == sleep_mode.TAG


def test_reservation_is_discarded_on_sleep_and_mapped_back(cumem: RecordingCuMem,
                                                           monkeypatch) -> None:
    monkeypatch.setattr(core, "_managers", {})
    ws = _plugin_workspace()
    alloc = _reserve_while_loading(cumem, ws)
    assert alloc["tag"] == "workspace", alloc
    assert alloc["nbytes"] == ws.stats()["reserved_bytes_total"] > 0
    before = _lease_ptrs(ws)
    assert all(cumem.of(p) is alloc for p in before)
    backend = CuMemBackend()
    backend.suspend()  # vLLM's real sleep dispatch (level 1)
    assert "weights" in cumem.offload_tags and "workspace" not in cumem.offload_tags
    assert alloc["state"] == "discarded"  # no host copy of scratch
    backend.resume(["weights"])  # an RL trainer wakes the weights first
    assert alloc["state"] == "mapped"  # scratch comes back with any wake-up
    after = _lease_ptrs(ws)
    assert after == before and all(cumem.of(p) is alloc for p in after)


def test_negative_control_without_the_entry_lands_in_weights(cumem: RecordingCuMem,
                                                              monkeypatch) -> None:
    monkeypatch.setattr(core, "_managers", {})
    monkeypatch.setattr(sleep_mode, "reservation_context", contextlib.nullcontext)
    ws = _plugin_workspace()
    alloc = _reserve_while_loading(cumem, ws)
    assert alloc["tag"] == "weights"
    CuMemBackend().suspend()
    assert alloc["state"] == "offloaded"  # copied to host memory like a weight


def test_moved_hook_point_is_one_error_and_a_plain_reservation(cumem: RecordingCuMem,
                                                               monkeypatch, caplog) -> None:
    monkeypatch.setattr(core, "_managers", {})
    monkeypatch.setattr(vllm_workspace.current_workspace_manager(), "_alloc_context", None)
    monkeypatch.setenv("VLLM_DSV4_ATTN_IMPL", "auto")
    ws = _plugin_workspace()
    with caplog.at_level("ERROR", logger="vllm_dsv4_backend"):
        alloc = _reserve_while_loading(cumem, ws)
    assert alloc["tag"] == "weights"  # the old behaviour, serving goes on
    assert any(f"patch {sleep_mode.PATCH} not applied" in r.getMessage()
               for r in caplog.records), caplog.text
    monkeypatch.setenv("VLLM_DSV4_ATTN_IMPL", "plugin")
    with pytest.raises(Exception, match=sleep_mode.PATCH):
        sleep_mode.reservation_context()
