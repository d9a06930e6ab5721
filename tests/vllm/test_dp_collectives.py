# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``dp_collectives`` patch's ``all_gatherv`` / ``reduce_scatterv`` against
``torch.distributed`` on gloo (what vLLM's CPU communicator's ``device_group``
is), in two real processes, and through vLLM's own ``DeviceCommunicatorBase``
once the registry patched it.

Each rank builds every rank's inputs from the same seed, so each can check its
result against the reference computed locally: the gather is the rank-order
concatenation (uneven sizes, an empty rank, a list of tensors of mixed dtypes:
bf16 hidden states, fp32 weights, int32 ids, as the MoE dispatch sends), the
scatter is this rank's rows of the elementwise sum (gloo's sum of two bf16
values is one rounding: equal to ``a + b`` in torch). This file is also the
worker script (``python test_dp_collectives.py RANK WORLD PORT OUT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import worker_env
from vllm_dsv4_backend.run.server import find_free_port

WORLD = 2
# (sizes per rank) cases: uneven, one rank empty, even (sizes=None path).
CASES: list[list[int] | None] = [[3, 5], [0, 4], [4, 4], None]


def _inputs(sizes: list[int], seed: int) -> list[list[torch.Tensor]]:
    """Every rank's ``[hidden bf16, weights fp32, ids int32]``, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, 16, generator=g).to(torch.bfloat16),
             torch.rand(n, 6, generator=g),
             torch.randint(0, 64, (n, 6), generator=g, dtype=torch.int32)] for n in sizes]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from vllm_dsv4_backend.vllm_compat import collectives

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    results: dict[str, bool] = {}
    for i, case in enumerate(CASES):
        sizes = case if case is not None else [4] * world
        ins = _inputs(sizes, seed=i)
        got = collectives.all_gatherv(ins[rank], case, group, world, rank)
        want = [torch.cat([ins[r][k] for r in range(world)]) for k in range(3)]
        results[f"gather{i}"] = all(g.dtype == w.dtype and torch.equal(g, w)
                                    for g, w in zip(got, want, strict=True))
        single = collectives.all_gatherv(ins[rank][0], case, group, world, rank)
        results[f"gather_single{i}"] = torch.equal(single, want[0])
        # reduce_scatterv: every rank holds sum(sizes) rows; each keeps its own of the sum.
        g = torch.Generator().manual_seed(100 + i)
        full = [torch.randn(sum(sizes), 16, generator=g).to(torch.bfloat16)
                for _ in range(world)]
        before = full[rank].clone()
        mine = collectives.reduce_scatterv(full[rank], 0, case, group, world, rank)
        start = sum(sizes[:rank])
        want_rs = (full[0] + full[1])[start:start + sizes[rank]]
        results[f"scatter{i}"] = torch.equal(mine, want_rs)
        results[f"input_kept{i}"] = torch.equal(full[rank], before)
    # dim 1 (vLLM moves it to the front and back) with even shares.
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(3, 2 * world, generator=g) for _ in range(world)]
    mine = collectives.reduce_scatterv(full[rank], 1, None, group, world, rank)
    results["scatter_dim1"] = torch.equal(mine, (full[0] + full[1])[:, 2 * rank:2 * rank + 2])
    # Through vLLM's own class, patched by the registry entry.
    from vllm.distributed.device_communicators import base_device_communicator as base

    from vllm_dsv4_backend.vllm_compat import patches

    patches.apply("dp_collectives", lambda _d: None)
    comm = base.DeviceCommunicatorBase.__new__(base.DeviceCommunicatorBase)
    comm.device_group, comm.world_size, comm.rank_in_group = group, world, rank
    ins = _inputs([2, 3], seed=11)
    got = comm.all_gatherv(ins[rank], dim=0, sizes=[2, 3])
    results["vllm_class_gather"] = all(
        torch.equal(gt, torch.cat([ins[r][k] for r in range(world)]))
        for k, gt in enumerate(got))
    x = torch.full((5, 4), float(rank + 1))
    results["vllm_class_scatter"] = torch.equal(
        comm.reduce_scatterv(x, dim=0, sizes=[2, 3]), torch.full(([2, 3][rank], 4), 3.0))
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(results))


@pytest.mark.vllm
def test_collectives_match_torch_distributed_on_gloo(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    port = find_free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(WORLD)]
    env = worker_env({**os.environ, "OMP_NUM_THREADS": "1"})
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(WORLD), str(port),
                               str(outs[r])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0 and outs[r].exists(), f"rank {r}:\n{log[-3000:]}"
        results = json.loads(outs[r].read_text())
        failed = [k for k, ok in results.items() if not ok]
        assert results and not failed, f"rank {r}: {failed}"


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
