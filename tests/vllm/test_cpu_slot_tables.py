# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU layer's slot tables equal vLLM's, value for value.

``layer/cpu_tables.py`` builds the sliding-window and compressed slot tables, the
compressors' gather tables and the short-context top-k rows with fewer ops
than vLLM's ``DeepseekV4CPUAttention.forward_mqa``,
``DeepseekV4CPUCompressor.forward`` and
``DeepseekV4CPUIndexer._fill_short_context_topk`` (and shares them across the
step's layers); the kernels then read exactly the same slots only if every
entry, -1 pads included, is identical. The oracle is vLLM's own
``map_local_to_global_slots_cpu`` and vLLM's formulas, run here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUIndexer  # noqa: E402
from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu  # noqa: E402

from vllm_dsv4_backend.layer import cpu_tables  # noqa: E402


def _block_table(gen: torch.Generator, reqs: int, blocks: int) -> torch.Tensor:
    return torch.randperm(reqs * blocks * 3, generator=gen)[: reqs * blocks].view(
        reqs, blocks).to(torch.int32)


def _window_case(window: int, reqs: int, block_size: int, blocks: int, *, early: int,
                 deep: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """(generator, block table, positions): positions ``0 .. early - 1`` (windows
    reaching before position 0), then ``deep`` random ones inside the blocks."""
    gen = torch.Generator().manual_seed(window)
    table = _block_table(gen, reqs, blocks)
    positions = torch.cat([torch.arange(0, early),
                           torch.randint(0, blocks * block_size - 1, (deep,), generator=gen)])
    return gen, table, positions


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [1, 64, 256])
def test_map_slots_equals_vllm(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    reqs, blocks, tokens, k = 5, 9, 37, 70
    table = _block_table(gen, reqs, blocks)
    local = torch.randint(-1, blocks * block_size, (tokens, k), generator=gen).to(dtype)
    local[3] = -1  # an empty row
    local[4, ::2] = -1
    req = torch.randint(0, reqs, (tokens,), generator=gen, dtype=torch.int32)
    want = map_local_to_global_slots_cpu(local, req, table, block_size)
    got = cpu_tables.map_slots(local, req, table, block_size)
    assert got.dtype == want.dtype == torch.int64
    assert torch.equal(got, want)


def _vllm_window_slots(window, positions, req, table, block_size):
    # vLLM 0.32 DeepseekV4CPUAttention.forward_mqa, the window part.
    start = (positions - window + 1).clamp(min=0)
    local = start.unsqueeze(-1) + torch.arange(window)
    local = torch.where(local <= positions.unsqueeze(-1), local, torch.full_like(local, -1))
    return map_local_to_global_slots_cpu(local, req, table, block_size)


@pytest.mark.parametrize("window", [1, 4, 128])
def test_window_slots_equal_vllm(window):
    reqs, block_size, blocks = 4, 16, 20
    # Positions 0..W-2 (partial windows), exactly W-1, and deep into a request.
    gen, table, positions = _window_case(window, reqs, block_size, blocks, early=window + 2,
                                         deep=30)
    req = torch.randint(0, reqs, positions.shape, generator=gen, dtype=torch.int32)
    md = SimpleNamespace(block_size=block_size, block_table=table, token_to_req_indices=req)
    layer = SimpleNamespace(window_size=window)
    want = _vllm_window_slots(window, positions, req, table, block_size)
    got = cpu_tables.window_slots(layer, md, positions)
    assert torch.equal(got, want)
    # Second call reuses the cached offsets and gives the same table.
    assert torch.equal(cpu_tables.window_slots(layer, md, positions), want)


def test_step_tables_keep_one_table_per_cache_group() -> None:
    # A model has several KV cache groups (the tiny model's SWA caches form two: layers
    # 0/2 and 1/3), each with its own metadata object and block table. Layers of one
    # group share a table; a layer of the other group must never get it.
    tables = cpu_tables.StepTables()
    positions = torch.arange(4)
    md_a, md_b = SimpleNamespace(name="a"), SimpleNamespace(name="b")
    builds: list[str] = []

    def get(md: SimpleNamespace) -> torch.Tensor:
        def build() -> torch.Tensor:
            builds.append(md.name)
            return torch.full((1,), ord(md.name))
        return tables.get("window", md, positions, build)

    got = [int(get(md)) for md in (md_a, md_b, md_a, md_b)]  # layers 0, 1, 2, 3
    assert got == [ord("a"), ord("b"), ord("a"), ord("b")]
    assert builds == ["a", "b"]
    # Other positions (the next step's tensor): rebuilt, never the old table.
    assert int(tables.get("window", md_a, torch.arange(4), lambda: torch.zeros(1))) == 0
    tables.clear()
    get(md_a)
    assert builds == ["a", "b", "a"]


@pytest.mark.parametrize("window", [4, 8, 128])
def test_compressor_gather_slots_equal_vllm(window):
    # vLLM 0.32 DeepseekV4CPUCompressor.forward's gather table; windows of C4
    # without / with overlap and of C128. Early positions reach before position
    # 0 (-1 entries); the state cache's token_to_req may be longer than the
    # step's tokens (vLLM slices it to slot_mapping's length).
    reqs, block_size, blocks = 3, 8, 40
    gen, table, positions = _window_case(window, reqs, block_size, blocks, early=window + 1,
                                         deep=20)
    n = positions.shape[0]
    req = torch.randint(0, reqs, (n + 5,), generator=gen, dtype=torch.int32)
    md = SimpleNamespace(block_size=block_size, block_table=table, token_to_req_indices=req,
                         slot_mapping=torch.zeros(n, dtype=torch.int64))
    win_local = positions.unsqueeze(-1) - window + 1 + torch.arange(window)
    want = map_local_to_global_slots_cpu(win_local, req[:n], table, block_size)
    compressor = SimpleNamespace()
    got = cpu_tables.gather_slots(compressor, md, positions, window)
    assert got.dtype == want.dtype == torch.int64
    assert torch.equal(got, want)
    assert (got[0, : window - 1] == -1).all()
    # Second call reuses the cached offsets.
    assert torch.equal(cpu_tables.gather_slots(compressor, md, positions, window),
                       want)


@pytest.mark.parametrize("ratio", [4, 128])
def test_short_context_rows_equal_vllm_fill(ratio):
    # vLLM's fill writes buffer[:n, :topk]; the plugin copies its rows into the
    # same place. Everything outside that block must stay untouched (sentinel),
    # padded positions beyond n must not count.
    topk, n = 16, 9
    positions = torch.tensor([0, 2, 3, 4, 7, 8, 63, 64, 10_000, 5, 5], dtype=torch.int64)
    sentinel = 12345

    def indexer() -> SimpleNamespace:
        return SimpleNamespace(topk_tokens=topk, compress_ratio=ratio,
                               topk_indices_buffer=torch.full((12, topk + 3), sentinel,
                                                              dtype=torch.int32))

    want, mine = indexer(), indexer()
    DeepseekV4CPUIndexer._fill_short_context_topk(want, positions, n)
    rows = cpu_tables.visible_rows(mine, positions, n)
    mine.topk_indices_buffer[:n, :topk] = rows
    assert rows.dtype == torch.int32
    assert torch.equal(mine.topk_indices_buffer, want.topk_indices_buffer)
    assert (want.topk_indices_buffer[0, :topk] == -1).all()  # nothing visible at p = 0
    assert (want.topk_indices_buffer[n:] == sentinel).all()
