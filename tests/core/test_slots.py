# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Window and all-visible compressed slot tables vs a scalar Python oracle."""

import pytest
import torch

from vllm_dsv4_backend.ops.slots import all_visible_compressed_slots, window_slots


def _oracle(local_lists, reqs, block_table, block_size, width):
    rows, lens = [], []
    for local, r in zip(local_lists, reqs):
        row = []
        for j in local:
            b = int(block_table[r, j // block_size])
            row.append(-1 if b < 0 else b * block_size + j % block_size)
        lens.append(len(local))
        rows.append(row + [-1] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def _batch(seed, num_reqs=3, max_blocks=40, max_pos=2000):
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(500, generator=g)[: num_reqs * max_blocks].view(num_reqs, max_blocks)
    bt = bt.to(torch.int32)
    positions, reqs = [], []
    for r in range(num_reqs):
        n = int(torch.randint(1, 6, (1,), generator=g))
        start = int(torch.randint(0, max_pos, (1,), generator=g))
        positions += list(range(start, start + n))
        reqs += [r] * n
    return bt, torch.tensor(positions), torch.tensor(reqs, dtype=torch.int32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window,block_size", [(128, 64), (8, 3)])
def test_window_slots(seed, window, block_size):
    bt, pos, reqs = _batch(seed, max_pos=block_size * 40 - 10)
    pos = torch.cat([pos, torch.tensor([0, 1, window - 1, window])])
    reqs = torch.cat([reqs, torch.zeros(4, dtype=torch.int32)])
    out = torch.full((len(pos), window), 7, dtype=torch.int32)
    lens = torch.full((len(pos),), 7, dtype=torch.int32)
    window_slots(out, lens, positions=pos, token_to_req=reqs, block_table=bt,
                 block_size=block_size, arange=torch.arange(window, dtype=torch.int32))
    locals_ = [list(range(max(0, p - window + 1), p + 1)) for p in pos.tolist()]
    ref, ref_lens = _oracle(locals_, reqs.tolist(), bt, block_size, window)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lens, ref_lens, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(4))
def test_all_visible_compressed(seed):
    bt, pos, reqs = _batch(seed)
    bt[0, 3] = -1  # an unallocated block must map to -1, never a real slot
    width, ratio, bs = 128, 128, 2
    pos = torch.cat([pos, torch.tensor([0, 126, 127, 128, 255, 256])])
    reqs = torch.cat([reqs, torch.zeros(6, dtype=torch.int32)])
    out = torch.full((len(pos), width), 7, dtype=torch.int32)
    lens = torch.full((len(pos),), 7, dtype=torch.int32)
    all_visible_compressed_slots(out, lens, positions=pos, token_to_req=reqs, block_table=bt,
                                 block_size=bs, compress_ratio=ratio,
                                 arange=torch.arange(width, dtype=torch.int32))
    locals_ = [list(range(min(width, (p + 1) // ratio))) for p in pos.tolist()]
    ref, ref_lens = _oracle(locals_, reqs.tolist(), bt, bs, width)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lens, ref_lens, rtol=0, atol=0)
    assert lens[-6:].tolist() == [0, 0, 1, 1, 2, 2]


def test_bad_out_buffer():
    with pytest.raises(ValueError, match="out_lens"):
        window_slots(torch.empty(2, 4, dtype=torch.int32), torch.empty(2, dtype=torch.int64),
                     positions=torch.zeros(2, dtype=torch.long),
                     token_to_req=torch.zeros(2, dtype=torch.int32),
                     block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=4,
                     arange=torch.arange(4, dtype=torch.int32))
