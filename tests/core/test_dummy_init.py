# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``dummy_init.init_model_``: the same model for every tensor-parallel size.

The modules below stand in for vLLM's parallel layers by their public
attributes (``input_size``/``output_size``/``output_sizes``, ``org_vocab_size``,
``moe_config``) and a ``weight_loader`` that keeps rank ``r``'s shard, as
vLLM's loaders do; the real layers are exercised end to end by
tests/vllm/test_tensor_parallel.py (TP 2 vs TP 1 on vLLM's CPU build).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from vllm_dsv4_backend.vllm_compat import dummy_init


def _col_loader(rank: int, tp: int):
    def load(param, w, shard_id=None, *, sizes=None):
        if sizes is None:  # column parallel: rows of this rank
            n = param.shape[0]
            param.data.copy_(w[rank * n:(rank + 1) * n])
            return
        local = [s // tp for s in sizes]
        off = sum(local[:shard_id])
        param.data[off:off + local[shard_id]].copy_(
            w[rank * local[shard_id]:(rank + 1) * local[shard_id]]
        )

    return load


class Merged(nn.Module):
    def __init__(self, rank: int, tp: int) -> None:
        super().__init__()
        self.input_size, self.output_sizes = 6, [4, 8]
        self.output_size = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(self.output_size // tp, 6), requires_grad=False)
        load = _col_loader(rank, tp)
        self.weight.weight_loader = lambda p, w, i: load(p, w, i, sizes=self.output_sizes)


class Row(nn.Module):
    def __init__(self, rank: int, tp: int) -> None:
        super().__init__()
        self.input_size, self.output_size = 8, 4
        self.weight = nn.Parameter(torch.empty(4, 8 // tp), requires_grad=False)

        def load(p, w):
            n = p.shape[1]
            p.data.copy_(w[:, rank * n:(rank + 1) * n])

        self.weight.weight_loader = load


class Embed(nn.Module):
    def __init__(self, rank: int, tp: int) -> None:
        super().__init__()
        self.org_vocab_size, self.embedding_dim = 10, 4
        # vLLM's VocabParallelEmbedding has these too (padded vocab): not a linear layer
        self.input_size, self.output_size = 4, 64
        self.weight = nn.Parameter(torch.empty(10 // tp, 4), requires_grad=False)
        load = _col_loader(rank, tp)

        def checked(p, w):  # vLLM's loader asserts the unpadded vocab
            assert w.shape == (self.org_vocab_size, self.embedding_dim), w.shape
            load(p, w)

        self.weight.weight_loader = checked


class Experts(nn.Module):
    def __init__(self, rank: int, tp: int) -> None:
        super().__init__()
        self.moe_config = SimpleNamespace(num_logical_experts=4, hidden_dim=6, intermediate_size=2)
        n = 4 // tp
        self.w13_weight = nn.Parameter(torch.empty(n, 4, 6), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(n, 6, 2), requires_grad=False)

        def load(p, w, name, *, shard_id, expert_id, return_success):
            if not rank * n <= expert_id < (rank + 1) * n:
                return False
            e = expert_id - rank * n
            if shard_id == "w2":
                p.data[e].copy_(w)
            else:
                p.data[e, (0 if shard_id == "w1" else 2):][:2].copy_(w)
            return True

        self.w13_weight.weight_loader = load
        self.w2_weight.weight_loader = load


class Attn(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        # 8 heads, 8 // tp local, padded to 4 slots at TP 4 as FlashMLA-style padding would
        self.attn_sink = nn.Parameter(torch.full((max(8 // tp, 4),), -math.inf),
                                      requires_grad=False)
        self.norm = nn.Parameter(torch.empty(5), requires_grad=False)
        self.tid2eid = nn.Parameter(torch.zeros(7, 3, dtype=torch.int32), requires_grad=False)


def _model(rank: int, tp: int) -> nn.Module:
    m = nn.Module()
    m.merged, m.row, m.embed = Merged(rank, tp), Row(rank, tp), Embed(rank, tp)
    m.experts, m.attn = Experts(rank, tp), Attn(tp)
    return m


def _init(rank: int, tp: int) -> tuple[nn.Module, dict]:
    m = _model(rank, tp)
    stats = dummy_init.init_model_(m, seed=0, tp_rank=rank, tp_size=tp, num_heads=8,
                                   num_experts=4)
    return m, stats


def test_tp2_shards_reassemble_tp1() -> None:
    full, stats = _init(0, 1)
    assert stats == {"loaded": 5, "initialised": 3, "untouched": 0}
    ranks = [_init(r, 2)[0] for r in range(2)]
    w = [m.merged.weight for m in ranks]
    # merged: rank r holds [gate shard r; up shard r]
    gate = torch.cat([w[0][:2], w[1][:2]])
    up = torch.cat([w[0][2:], w[1][2:]])
    assert torch.equal(torch.cat([gate, up]), full.merged.weight)
    assert torch.equal(torch.cat([m.row.weight for m in ranks], 1), full.row.weight)
    assert torch.equal(torch.cat([m.embed.weight for m in ranks]), full.embed.weight)
    for p in ("w13_weight", "w2_weight"):
        assert torch.equal(torch.cat([getattr(m.experts, p) for m in ranks]),
                           getattr(full.experts, p))
    assert torch.equal(torch.cat([m.attn.attn_sink for m in ranks]), full.attn.attn_sink)
    for m in ranks:  # replicated
        assert torch.equal(m.attn.norm, full.attn.norm)
        assert torch.equal(m.attn.tid2eid, full.attn.tid2eid)
    t = full.attn.tid2eid
    assert int(t.min()) >= 0 and int(t.max()) < 4 and len(t.unique()) > 1


def test_fan_in_uses_the_full_input_and_padding_stays_inf() -> None:
    # Row parallel: rank 0 of 2 holds 2048 of 4096 input columns; fan_in stays 4096.
    m = _model(0, 2)
    m.row.input_size = 4096
    m.row.weight = nn.Parameter(torch.empty(4, 2048), requires_grad=False)
    m.row.weight.weight_loader = lambda p, w: p.data.copy_(w[:, :2048])
    dummy_init.init_model_(m, seed=0, tp_rank=0, tp_size=2, num_heads=8, num_experts=4)
    assert abs(m.row.weight.std().item() - 4096**-0.5) < 0.05 * 4096**-0.5
    sink4 = _init(0, 4)[0].attn.attn_sink  # 2 real heads, 2 padded slots
    assert torch.isfinite(sink4[:2]).all() and torch.isneginf(sink4[2:]).all()
    assert torch.equal(sink4[:2], _init(0, 1)[0].attn.attn_sink[:2])


def test_seed_changes_weights() -> None:
    a = dummy_init.init_model_(m1 := _model(0, 1), seed=0, num_heads=8, num_experts=4)
    dummy_init.init_model_(m2 := _model(0, 1), seed=1, num_heads=8, num_experts=4)
    assert a["loaded"] == 5
    assert not torch.equal(m1.merged.weight, m2.merged.weight)
