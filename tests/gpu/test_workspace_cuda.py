# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Workspace manager on real CUDA streams (skipped without CUDA).

The CPU simulation (tests/core/test_stream_schedule.py) proves the fencing
logic over random interleavings; this file runs the same DeepSeek-V4 fan-out
(default / aux0 / aux1 streams per micro-batch, 43 Flash layers, two
micro-batches) on real streams with real kernels, every consumer slowed by
``torch.cuda._sleep`` so that an unfenced producer on another stream overtakes
it. Fences on: no wrong stamp. Fences off (test-only switch): corruption.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.families import AUX_FAMILIES, EVERY_FAMILY_PLAN, FAMILIES
from tests.support.stream_schedule import Pool49236Layout
from vllm_dsv4_backend.layer.plan import (
    DSV4_FLASH_HF_CONFIG,
    build_workspace_config,
    dims_from_hf_config,
)
from vllm_dsv4_backend.testing.schedule import (
    STREAM_ROLES,
    StampKernels,
    enqueue_dsv4_step,
    make_stamp_source,
)
from vllm_dsv4_backend.workspace import (
    CudaStreamBackend,
    WorkspaceConfig,
    WorkspaceManager,
    count_allocations,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)
# ~2 ms per consumer on an H200: the GPU, not Python's issue of the next layer (~0.5 ms),
# must be behind, or an unfenced producer is only enqueued after the consumer finished.
# At 200_000 (~0.1 ms) no unfenced producer ever overtook on an H200 (2026-12-04).
SLEEP_CYCLES = 4_000_000


def flash_config(tokens: int = 64, indexer: str = "mxfp4", num_ubatches: int = 2
                 ) -> WorkspaceConfig:
    dims, ratios = dims_from_hf_config(DSV4_FLASH_HF_CONFIG, tp_size=4)
    assert ratios == FLASH_RATIOS
    return build_workspace_config(dims, max_num_batched_tokens=tokens, indexer_kv_dtype=indexer,
                                  plan=EVERY_FAMILY_PLAN, num_ubatches=num_ubatches,
                                  compress_ratios=ratios)


def make_streams(num_ubatches: int = 2) -> list[dict[str, torch.cuda.Stream]]:
    return [{r: torch.cuda.Stream() for r in STREAM_ROLES} for _ in range(num_ubatches)]


def run_program(mgr: WorkspaceManager, variant: str, seed: int = 0) -> list[tuple[str, int]]:
    torch.cuda.synchronize()
    be = mgr.backend
    k = StampKernels(be, device="cuda", sleep_cycles=SLEEP_CYCLES)
    rng = random.Random(seed)
    stamps = make_stamp_source()
    streams = make_streams(mgr.config.num_ubatches)
    for step, toks in enumerate(((5, 3), (64, 17), (1, 64))):
        enqueue_dsv4_step(mgr, k, streams, toks, variant=variant, rng=rng, stamps=stamps,
                          step=step)
    return k.mismatches()  # synchronizes


@pytest.mark.parametrize("variant", ["wide", "narrow", "random"])
@pytest.mark.parametrize("debug", [False, True])
def test_fenced_real_streams_never_corrupt(variant, debug):
    mgr = WorkspaceManager(flash_config(), policy="shared", device="cuda", debug=debug)
    assert isinstance(mgr.backend, CudaStreamBackend)
    mgr.reserve()
    bad = run_program(mgr, variant)
    assert bad == [], bad[:5]
    assert mgr.stats()["fence_waits_total"] > 0


@pytest.mark.parametrize("variant", ["wide", "narrow", "random"])
def test_fences_off_real_streams_corrupt(variant):
    mgr = WorkspaceManager(flash_config(), policy="shared", device="cuda",
                           _unsafe_disable_fences_for_tests=True)
    mgr.reserve()
    bad = run_program(mgr, variant)
    assert bad, "unfenced producers never overtook a sleeping consumer"


def test_pool49236_layout_corrupts_on_real_streams():
    mgr = Pool49236Layout(flash_config(), policy="shared", device="cuda")
    mgr.reserve()
    assert run_program(mgr, "wide")


def test_reserve_is_visible_to_memory_profiling():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    mgr = WorkspaceManager(flash_config(tokens=256), policy="shared", device="cuda")
    mgr.reserve()
    grown = torch.cuda.memory_allocated() - before
    total = mgr.stats()["reserved_bytes_total"]
    assert total <= grown < total + (2 << 20)


@pytest.mark.parametrize("policy", ["shared", "private", "off"])
def test_flash_schedule_zero_allocations_on_cuda(policy):
    """43 layers, real aux streams and fences, 50 decode + mixed steps: no
    tensor allocation and no caching-allocator request after warm-up."""
    t_max = 64
    cfg = flash_config(tokens=t_max, num_ubatches=1)
    mgr = WorkspaceManager(cfg, policy=policy, device="cuda")
    mgr.reserve()
    d = torch.cuda.current_stream()
    a0, a1 = torch.cuda.Stream(), torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = {  # random bytes, one row per token, made before the measured region
        fam: {
            s.name: torch.randint(0, 256, (t_max, s.bytes_per_token), device="cuda",
                                  dtype=torch.uint8, generator=gen)
            for s in cfg.family_buffers(fam)
        }
        for fam in FAMILIES
    }
    out = torch.empty(t_max, cfg.params["padded_q_heads"], cfg.params["head_dim"],
                      dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    role = {"q": d, "indexer_q": a0, "topk": a0, "compressor": a1}

    def bytes_of(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(v.shape[0], -1).view(torch.uint8)

    rng = random.Random(0)
    steps = [8] * 50 + [rng.randint(1, t_max) for _ in range(10)] + [t_max]
    counts = []
    for step, t in enumerate(steps):
        with count_allocations(cuda_device="cuda") as c:
            for name in mgr.layers:
                leases = {}
                for fam in mgr.layer_families(name):
                    s = role[fam]
                    ls = mgr.lease(name, fam, t, stream=s)
                    with torch.cuda.stream(s):
                        for vname, v in ls.views.items():
                            b = bytes_of(v)
                            b.copy_(src[fam][vname][:t])  # producer kernel
                    leases[fam] = ls
                ev = torch.cuda.Event()
                for s in (a0, a1):
                    ev.record(s)
                    d.wait_event(ev)
                if "topk" in leases:
                    leases["topk"].used_on(d)
                torch.mul(leases["q"]["q"], 2, out=out[:t])  # the attention consumer
                for ls in leases.values():
                    ls.release()
        if step >= 2:
            counts.append((c.count, c.allocator_count))
    torch.cuda.synchronize()
    # Correct contents after the last step (T = t_max): the last C4 layer's views.
    last_c4 = [n for n, r in mgr.layers.items() if r == 4][-1]
    if policy != "off":
        for fam in AUX_FAMILIES:
            with mgr.lease(last_c4, fam, t_max) as ls:
                for vname, v in ls.views.items():
                    assert torch.equal(bytes_of(v), src[fam][vname]), (fam, vname)
    if policy == "off":
        assert all(n > 0 for n, _ in counts)
    else:
        assert set(counts) == {(0, 0)}, counts[:5]
        assert mgr.stats()["fence_waits_total"] > 0
