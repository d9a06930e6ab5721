# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Data parallel on vLLM 0.32's CPU build: the two variable-size collectives of the MoE.

Under ``--data-parallel-size N`` vLLM runs DeepSeek-V4's MoE across the DP
ranks (``naive_dp_ep`` prepare/finalize over the ``allgather_reducescatter``
all2all manager, the only one vLLM's CPU communicator has): each rank's
tokens are gathered with ``all_gatherv`` before the experts and their partial
outputs summed back with ``reduce_scatterv``, both with per-rank token counts
(``sizes``). ``CpuCommunicator`` inherits both from
``DeviceCommunicatorBase``, where they raise ``NotImplementedError``: the
server starts and every request returns HTTP 500.

:func:`all_gatherv` and :func:`reduce_scatterv` implement them on the
communicator's ``device_group`` (gloo on CPU) with collectives gloo has:
``all_gather`` of each rank's rows padded to the largest count (then the
padding dropped), and ``all_reduce`` of the whole input (then this rank's
rows kept) -- ``N`` times a reduce-scatter's traffic, which on one machine's
shared memory is the price of not needing gloo's missing reduce-scatter. The
sum is gloo's, the same on every rank. Torch only; nothing here imports
vLLM. Registered as ``dp_collectives`` in :mod:`.patches`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from vllm_dsv4_backend.vllm_compat import hooks

__all__ = [
    "COMM_MODULE",
    "all_gatherv",
    "install",
    "reduce_scatterv",
]

COMM_MODULE = "vllm.distributed.device_communicators.base_device_communicator"
_BASE = "DeviceCommunicatorBase"


def _sizes(sizes: list[int] | None, rows: int, world: int, what: str) -> list[int]:
    if sizes is None:
        return [rows] * world
    out = [int(s) for s in sizes]
    if len(out) != world or any(s < 0 for s in out):
        raise ValueError(f"{what}: expected {world} non-negative sizes, got {sizes}")
    return out


def all_gatherv(input_: torch.Tensor | list[torch.Tensor], sizes: list[int] | None,
                group: Any, world: int, rank: int) -> torch.Tensor | list[torch.Tensor]:
    """Concatenate, in rank order along dim 0, every rank's rows of ``input_``
    (a tensor or a list of tensors, each gathered on its own): rank ``r``
    contributes ``sizes[r]`` rows (``None``: every rank the same as this one).

    Raises:
        ValueError: ``input_`` has not ``sizes[rank]`` rows.
    """

    def one(t: torch.Tensor) -> torch.Tensor:
        n = _sizes(sizes, t.shape[0], world, "all_gatherv")
        if t.shape[0] != n[rank]:
            raise ValueError(f"all_gatherv: rank {rank} has {t.shape[0]} rows, sizes say "
                             f"{n[rank]}")
        most = max(n)
        t = t.contiguous()
        if t.shape[0] != most:
            # gloo's all_gather needs one shape on every rank: pad, gather, cut.
            padded = t.new_zeros((most, *t.shape[1:]))
            padded[: t.shape[0]].copy_(t)
            t = padded
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, group=group)
        return torch.cat([p[:k] for p, k in zip(parts, n, strict=True)], dim=0)

    if isinstance(input_, torch.Tensor):
        return one(input_)
    return [one(t) for t in input_]


def reduce_scatterv(input_: torch.Tensor, dim: int, sizes: list[int] | None, group: Any,
                    world: int, rank: int) -> torch.Tensor:
    """Sum ``input_`` over the ranks and keep this rank's rows: rank ``r`` gets
    ``sizes[r]`` rows (``None``: an equal share) of the sum, in rank order
    along ``dim`` (moved to the front and back as vLLM's own implementations
    do)."""
    if dim < 0:
        dim += input_.dim()
    # A private copy: all_reduce works in place and the caller keeps its input.
    x = input_.movedim(0, dim).contiguous().clone()
    if sizes is None:
        if x.shape[0] % world:
            raise ValueError(f"reduce_scatterv: {x.shape[0]} rows do not split over {world} "
                             "ranks")
        n = [x.shape[0] // world] * world
    else:
        n = _sizes(sizes, 0, world, "reduce_scatterv")
        if sum(n) != x.shape[0]:
            raise ValueError(f"reduce_scatterv: {x.shape[0]} rows, sizes {n} sum to {sum(n)}")
    dist.all_reduce(x, group=group)
    start = sum(n[:rank])
    return x[start:start + n[rank]].movedim(0, dim).contiguous()


def install(module: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """Give ``DeviceCommunicatorBase`` working ``all_gatherv`` / ``reduce_scatterv``
    (checked signatures, ``hooks.mark_port`` marker); False if already done.

    Only the base class's two methods change, and they raise
    ``NotImplementedError`` in vLLM: communicators with their own (CUDA, ROCm,
    XPU) keep theirs, and nothing that worked before behaves differently.
    """
    changed = False
    for name, params in (("all_gatherv", ("input_", "dim", "sizes")),
                         ("reduce_scatterv", ("input_", "dim", "sizes"))):
        symbol = f"{_BASE}.{name}"
        _, _, original = hooks.resolve(module, symbol)
        if hooks.is_port(original):
            continue
        make = _gatherv_method if name == "all_gatherv" else _scatterv_method
        replacement = make(original)
        changed |= hooks.replace_attr(module, symbol, replacement, expected_params=params)
    if changed:
        on_applied(f"dp:{COMM_MODULE}.{_BASE}.all_gatherv/reduce_scatterv on gloo")
    return changed


def _gatherv_method(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
               sizes: list[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
        if dim != 0:
            # vLLM's CUDA communicator refuses the same (its MoE gathers dim 0).
            raise NotImplementedError("only dim 0 all-gatherv is supported")
        return all_gatherv(input_, sizes, self.device_group, self.world_size,
                           self.rank_in_group)

    return method


def _scatterv_method(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, input_: torch.Tensor, dim: int = -1,
               sizes: list[int] | None = None) -> torch.Tensor:
        return reduce_scatterv(input_, dim, sizes, self.device_group, self.world_size,
                               self.rank_in_group)

    return method
