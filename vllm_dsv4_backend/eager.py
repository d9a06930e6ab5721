# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the plugin's layers share of the DeepSeek-V4 attention eager region (torch only).

:class:`Region` holds one layer's workspace leases of one pass through its eager
region (both layers);
:func:`select_topk_c4` is the CPU layer's C4 top-k into leased buffers. Every output goes
into caller-owned buffers (workspace leases); nothing here allocates a buffer that outlives
the call.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_dsv4_backend.formats.fp8_ds_mla import BYTES_PER_TOKEN as ENTRY_BYTES
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.workspace.lease import WorkspaceLeaseError


class Region:
    """One layer's pass through its eager region (one micro-batch): the leases
    it takes, released together.

    Built per layer and forward (workspace, layer name, token count,
    micro-batch); the layer's hooks call :meth:`lease` for a family when they
    first need it, and leaving the ``with`` block releases every lease still
    held, whether the region returned or raised, so an exception inside the
    indexer cannot leave a slot "still leased" for the next model step.
    :meth:`release` hands a family back early (after its last consumer),
    which lets another layer's producer take the slot sooner.
    """

    __slots__ = ("workspace", "layer_name", "num_tokens", "ubatch", "_leases")

    def __init__(self, workspace: Any, layer_name: str, num_tokens: int, ubatch: int = 0) -> None:
        self.workspace = workspace
        self.layer_name = layer_name
        self.num_tokens = num_tokens
        self.ubatch = ubatch
        self._leases: dict[str, Any] = {}

    def lease(self, family: str) -> Any:
        """The region's lease of ``family`` (taken on first use, then reused)."""
        lease = self._leases.get(family)
        if lease is None:
            lease = self.workspace.lease(self.layer_name, family, self.num_tokens,
                                         ubatch=self.ubatch)
            self._leases[family] = lease
        return lease

    def held(self) -> tuple[str, ...]:
        """Families leased and not yet released."""
        return tuple(self._leases)

    def release(self, family: str) -> None:
        lease = self._leases.pop(family, None)
        if lease is not None:
            lease.release()

    def close(self) -> None:
        # Release in reverse order of taking; keep going if one release fails
        # so no slot stays held, then re-raise the first error.
        first: BaseException | None = None
        while self._leases:
            _, lease = self._leases.popitem()
            try:
                lease.release()
            except BaseException as e:  # noqa: BLE001
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class NoRegion:
    """No region is open for this layer and micro-batch: what a layer's region
    lookup returns outside its forward (a dummy or profile run; a piecewise graph
    replay, which runs only the eager break, not the forward that opens the region).

    Falsy, so a hook tests ``if not region`` and takes vLLM's path; a lease or
    a release asked of it is refused with the reason (a region taken from the
    wrong step), not an ``AttributeError`` on ``None``.
    """

    __slots__ = ("layer_name", "ubatch")
    num_tokens = 0

    def __init__(self, layer_name: str, ubatch: int) -> None:
        self.layer_name = layer_name
        self.ubatch = ubatch

    def __bool__(self) -> bool:
        return False

    def _refuse(self, what: str, family: str) -> WorkspaceLeaseError:
        return WorkspaceLeaseError(
            f"layer {self.layer_name!r} (micro-batch {self.ubatch}) has no open region to "
            f"{what} {family!r} from: this code runs outside the layer's forward (at a "
            "piecewise graph replay only the eager break runs); open an eager.Region there"
        )

    def lease(self, family: str) -> Any:
        raise self._refuse("lease", family)

    def release(self, family: str) -> None:
        raise self._refuse("release", family)


def block_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[num_blocks, block_size, 584]`` view of a paged fp8_ds_mla cache
    whose per-block bytes may be padded (vLLM aligns blocks to 576 B)."""
    if cache.dim() == 3 and cache.shape[1] == block_size and cache.shape[2] == ENTRY_BYTES:
        return cache
    flat = cache.view(cache.shape[0], -1)
    return flat[:, : block_size * ENTRY_BYTES].view(cache.shape[0], block_size, ENTRY_BYTES)


def select_topk_c4(
    *,
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    compressed_block_table: torch.Tensor,
    entries_per_block: int,
    index_topk: int,
    out_local: torch.Tensor,
    out_global: torch.Tensor,
    out_lens: torch.Tensor,
    arange: torch.Tensor,
    minus_one: torch.Tensor,
    index_q: torch.Tensor | None = None,
    index_q_scale: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
    indexer_k_cache: torch.Tensor | None = None,
    indexer_block_table: torch.Tensor | None = None,
    indexer_kv_dtype: str = "fp8",
    max_compressed: int | None = None,
    compress_ratio: int = 4,
) -> None:
    """C4 layers: the lightning indexer's causal top-k as global slots.

    Entry ``j`` is visible to position ``p`` iff ``j < (p + 1) // 4``. With
    ``index_q=None`` every visible entry is taken (vLLM's short-context rule,
    valid when no row sees more than ``index_topk`` entries); otherwise
    indexer logits over the paged indexer K cache pick the ``index_topk`` best.

    Args:
        positions, token_to_req: ``[T]``.
        compressed_block_table: ``[R, max_blocks]`` blocks of the 584 B
            compressed cache; ``entries_per_block`` entries each.
        out_local / out_global: ``[T, index_topk]`` int32, written (local
            entry ids, then global slot ids; -1 pads).
        out_lens: ``[T]`` int32, written: valid entries per row.
        arange: ``[index_topk]`` int32 ``0..K-1``; ``minus_one``: int32 scalar
            tensor (both persistent, so the short-context fill allocates
            nothing).
        index_q / index_q_scale / index_weights: from
            ``ops.indexer.indexer_q_rope_quant``.
        indexer_k_cache, indexer_block_table: the paged indexer K cache and
            its block table (``[R, max_blocks]``).
    """
    visible = torch.div(positions + 1, compress_ratio, rounding_mode="floor")
    if index_q is None:
        torch.where(arange.unsqueeze(0) < visible.unsqueeze(1), arange.unsqueeze(0), minus_one,
                    out=out_local)
    else:
        if index_weights is None or indexer_k_cache is None or indexer_block_table is None:
            raise ValueError(
                "select_topk_c4: index_q needs index_weights, indexer_k_cache and "
                "indexer_block_table"
            )
        logits = indexer_ops.indexer_logits(
            index_q,
            index_q_scale,
            index_weights,
            indexer_k_cache,
            visible,
            indexer_block_table,
            dtype=indexer_kv_dtype,
            token_to_req=token_to_req,
            max_seq_len=max_compressed,
        )
        indexer_ops.indexer_topk(logits, None, index_topk, seq_lens=visible, out=out_local)
    indexer_ops.local_to_global(
        out_local,
        token_to_req,
        compressed_block_table,
        entries_per_block,
        out_indices=out_global,
        out_lens=out_lens,
    )
