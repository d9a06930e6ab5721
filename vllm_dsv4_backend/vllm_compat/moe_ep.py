# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Expert parallel on vLLM 0.32's CPU build: local expert ids for ``cpu_fused_moe``.

With ``--enable-expert-parallel`` each rank holds only its experts
(``w13/w2: [local_experts, ...]``), and the router's ``topk_ids`` are global
expert ids. vLLM hands the experts kernel an ``expert_map`` (global id ->
local slot, -1 for another rank's expert), but
``CPUUnquantizedExperts.apply`` ignores it and calls ``cpu_fused_moe`` with
the global ids, which index past the local weights: the worker dies with
SIGSEGV on the first request (the seed's command line, TP 2 + EP).

:func:`local_expert_ids` maps the ids the way every other vLLM backend reads
``expert_map``: another rank's expert keeps a valid local slot (0) with
weight 0, so it adds nothing here, and the TP all-reduce that follows sums
each expert's contribution from the one rank that holds it. Torch only.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["local_expert_ids", "wrap_apply"]


def local_expert_ids(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local_ids, weights)`` for this rank.

    Args:
        topk_ids: ``[T, k]`` int global expert ids.
        topk_weights: ``[T, k]`` float router weights.
        expert_map: ``[global_experts]`` int: local slot, or -1 if another
            rank holds the expert.

    Returns:
        ``local_ids`` (``topk_ids``' dtype, every entry a valid local slot) and
        ``weights`` (0 where the expert is another rank's).

    Raises:
        ValueError: an id outside ``[0, global_experts)``.
    """
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= len(expert_map)):
        raise ValueError(
            f"topk_ids: expected global expert ids in [0, {len(expert_map)}), got "
            f"[{int(topk_ids.min())}, {int(topk_ids.max())}]"
        )
    local = expert_map[topk_ids.long()]
    remote = local < 0
    weights = topk_weights.masked_fill(remote, 0.0)
    return local.clamp(min=0).to(topk_ids.dtype), weights


def wrap_apply(original: Any) -> Any:
    """``CPUUnquantizedExperts.apply`` that honours ``expert_map``."""

    def apply(self: Any, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: Any, global_num_experts: int, expert_map: torch.Tensor | None,
              *args: Any, **kwargs: Any) -> None:
        if expert_map is not None:
            topk_ids, topk_weights = local_expert_ids(topk_ids, topk_weights, expert_map)
            # cpu_fused_moe reads routing tensors as contiguous float32/int32.
            topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
        return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                        activation, global_num_experts, expert_map, *args, **kwargs)

    apply.__wrapped__ = original  # type: ignore[attr-defined]
    return apply
