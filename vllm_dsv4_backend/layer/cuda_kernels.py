# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA layer's device side that is not a layer: the graph-safe stream
backend of its workspace and vLLM's kernel objects that take caller-owned
outputs (:mod:`.cuda` re-exports both; tests swap :class:`VllmCudaKernels`
for torch doubles). Nothing here imports vLLM at import time: the kernel
modules are resolved at call time (the CuTe DSL ones import ``cutlass`` and
initialise the CUDA driver)."""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from vllm_dsv4_backend.workspace.streams import CudaStreamBackend

__all__ = ["KERNEL_SIGNATURES", "CudaKernels", "GraphSafeCudaStreamBackend", "VllmCudaKernels"]

_FP8_MAX = 448.0  # float8_e4m3fn (CUDA); e4m3fnuz is ROCm only


# --- streams -----------------------------------------------------------------------


class _Fence:
    __slots__ = ("event", "src")

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None
        self.src: Any = None


def _is_capturing(stream: Any) -> bool:
    with torch.cuda.stream(stream):
        return bool(torch.cuda.is_current_stream_capturing())


class GraphSafeCudaStreamBackend(CudaStreamBackend):
    """CUDA streams for the workspace, safe under CUDA-graph capture.

    The manager fences a hand-over by ``record(event, consumer)`` followed by
    ``wait(producer, event)``; this backend performs the record at the wait,
    when both streams are known, and drops the pair when the producer's
    stream is capturing and the earlier user's stream is not part of that
    capture. Such a user ran in an earlier graph segment, an eager break or
    before capture; at replay vLLM 0.33 joins every aux stream into the
    default stream before each segment or eager break returns
    (``execute_in_parallel`` / ``maybe_execute_in_parallel`` wait on their
    done events), and segments launch on the default stream in order, so the
    dependency holds without the event, which CUDA would reject anyway
    (a captured wait on an uncaptured record). ``dropped`` counts them.
    """

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        super().__init__(device)
        self.dropped = 0

    def new_event(self) -> Any:
        return _Fence()

    def record(self, event: Any, stream: Any) -> None:
        event.src = stream

    def wait(self, stream: Any, event: Any) -> None:
        src = event.src
        if src is None:
            return
        event.src = None
        if _is_capturing(stream) != _is_capturing(src):
            self.dropped += 1
            return
        if event.event is None:
            event.event = torch.cuda.Event(enable_timing=False)
        event.event.record(src)
        stream.wait_event(event.event)


# --- kernels -----------------------------------------------------------------------


# Kernel objects called with caller-owned outputs: (module, class.__call__,
# parameter names), checked against vLLM's source text by ``layer.cuda``'s
# ``check_kernel_signatures`` (no import: the CuTe DSL modules import cutlass),
# and bound call by call to the real signatures by the CUDA-graph harness's
# recording stand-ins (tools/cuda_graph/recording.py).
KERNEL_SIGNATURES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm.models.deepseek_v4.common.ops.cache_utils",
     "ComputeGlobalTopkIndicesAndLensKernel.__call__",
     ("global_topk_indices", "topk_lens", "topk_indices", "token_to_req_indices",
      "block_table", "block_size", "is_valid_token")),
    ("vllm.models.deepseek_v4.common.ops.fused_indexer_q",
     "FusedIndexerQRopeQuantTritonKernel.__call__",
     ("positions", "index_q", "index_q_cos_sin_cache", "index_weights",
      "index_weights_softmax_scale", "index_weights_head_scale", "index_q_fp8",
      "index_weights_out", "fp8_max", "use_fnuz")),
    ("vllm.models.deepseek_v4.common.ops.fused_indexer_q",
     "FusedIndexerQRopeMxFp4TritonKernel.__call__",
     ("positions", "index_q", "index_q_cos_sin_cache", "index_weights",
      "index_weights_softmax_scale", "index_weights_head_scale", "index_q_packed",
      "index_q_scale", "index_weights_out")),
    ("vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl",
     "IndexerQMxFp4Kernel.__call__",
     ("positions", "q", "cos_sin_cache", "weights", "weights_softmax_scale",
      "weights_head_scale", "q_packed", "q_scale", "weights_out")),
    ("vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl",
     "IndexerQFp8Kernel.__call__",
     ("positions", "q", "cos_sin_cache", "weights", "weights_softmax_scale",
      "weights_head_scale", "q_fp8", "weights_out")),
    ("vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl",
     "SparseAttnCompressC128Block8Kernel.__call__",
     ("state_cache", "num_actual", "token_to_req_indices", "positions", "slot_mapping",
      "block_table", "head_dim", "compressed_kv")),
    ("vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl",
     "SparseAttnNormRopeStoreKernel.__call__",
     ("compressed_kv", "positions", "slot_mapping", "rms_norm_weight", "rms_norm_eps",
      "cos_sin_cache", "kv_cache", "kv_slot_mapping", "compress_ratio", "head_dim",
      "rope_head_dim")),
)


@runtime_checkable
class CudaKernels(Protocol):
    """What the CUDA layer calls with caller-owned outputs: vLLM's kernel objects
    (:class:`VllmCudaKernels`, the one implementation serving and the graph
    harness run) and ``tests/cuda``'s recording doubles implement this one
    interface. Tensors: the shapes, dtypes and bytes of the vLLM kernel each
    method names (:data:`KERNEL_SIGNATURES`)."""

    def global_topk_indices_and_lens(self, global_topk_indices: torch.Tensor,
                                     topk_lens: torch.Tensor, topk_indices: torch.Tensor,
                                     token_to_req_indices: torch.Tensor,
                                     block_table: torch.Tensor, block_size: int,
                                     is_valid_token: torch.Tensor) -> None:
        """``_COMPUTE_GLOBAL_TOPK_INDICES_AND_LENS_KERNEL``: ``topk_indices``
        ``[T, topk]`` int32 local ids (-1: none) into ``global_topk_indices``
        ``[T, topk]`` int32 slot ids and ``topk_lens`` ``[T]`` int32."""
        ...

    def indexer_q_fp8(self, *, positions: torch.Tensor, q: torch.Tensor,
                      cos_sin_cache: torch.Tensor, weights: torch.Tensor,
                      weights_softmax_scale: float, weights_head_scale: float,
                      q_fp8: torch.Tensor, weights_out: torch.Tensor) -> None:
        """Index q ``[T, H, D]`` bf16 RoPE + FP8 into ``q_fp8`` ``[T, H, D]``
        e4m3fn (1 B each) and ``weights_out`` ``[T, H]`` fp32 (the q scale folded in)."""
        ...

    def indexer_q_mxfp4(self, *, positions: torch.Tensor, q: torch.Tensor,
                        cos_sin_cache: torch.Tensor, weights: torch.Tensor,
                        weights_softmax_scale: float, weights_head_scale: float,
                        q_packed: torch.Tensor, q_scale: torch.Tensor,
                        weights_out: torch.Tensor) -> None:
        """Index q RoPE + MXFP4 into ``q_packed`` ``[T, H, D/2]`` uint8, ``q_scale``
        ``[T, H, D/32]`` uint8 ue8m0 and ``weights_out`` ``[T, H]`` fp32."""
        ...

    def c128_state_block_size(self) -> int:
        """The state-cache block size the C128 compress kernel requires."""
        ...

    def c128_compress(self, *, state_cache: torch.Tensor, num_actual: int,
                      token_to_req_indices: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, block_table: torch.Tensor, head_dim: int,
                      compressed_kv: torch.Tensor) -> None:
        """``_SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL`` into ``compressed_kv``
        ``[num_actual, head_dim]`` fp32."""
        ...

    def c128_store(self, *, compressed_kv: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, rms_norm_weight: torch.Tensor,
                   rms_norm_eps: float, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                   kv_slot_mapping: torch.Tensor, compress_ratio: int, head_dim: int,
                   rope_head_dim: int) -> None:
        """``_SPARSE_ATTN_NORM_ROPE_STORE_KERNEL``: RMSNorm + RoPE of
        ``compressed_kv``, stored as fp8_ds_mla entries (584 B) in ``kv_cache``."""
        ...

    def flash_mla_with_kvcache(self, *, q: torch.Tensor, k_cache: torch.Tensor,
                               block_table: torch.Tensor | None, head_dim_v: int,
                               tile_scheduler_metadata: Any,
                               cache_seqlens: torch.Tensor | None, is_fp8_kvcache: bool,
                               indices: torch.Tensor, topk_length: torch.Tensor | None,
                               softmax_scale: float, attn_sink: torch.Tensor | None,
                               extra_k_cache: torch.Tensor | None,
                               extra_indices_in_kvcache: torch.Tensor | None,
                               extra_topk_length: torch.Tensor | None,
                               out: torch.Tensor) -> Any:
        """FlashMLA sparse decode: ``q`` ``[b, 1, H, 512]`` bf16 into ``out``
        (same shape and dtype, contiguous)."""
        ...


class VllmCudaKernels:
    """vLLM 0.33's / 0.34's CUDA kernel objects that accept caller-owned outputs.

    Resolved at call time (the CuTe DSL modules import ``cutlass`` and
    initialise the CUDA driver, so never at plugin load), with the dispatch
    of vLLM's wrappers: CuTe DSL when ``has_cutedsl()``, else the Triton
    twins. The CUDA-graph harness runs this class against recording
    stand-ins bound to the real signatures; ``tests/cuda`` replaces it with
    torch doubles of :class:`CudaKernels`.
    """

    def global_topk_indices_and_lens(
        self,
        global_topk_indices: torch.Tensor,
        topk_lens: torch.Tensor,
        topk_indices: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        is_valid_token: torch.Tensor,
    ) -> None:
        from vllm.models.deepseek_v4.common.ops.cache_utils import (
            _COMPUTE_GLOBAL_TOPK_INDICES_AND_LENS_KERNEL,
        )

        _COMPUTE_GLOBAL_TOPK_INDICES_AND_LENS_KERNEL(
            global_topk_indices, topk_lens, topk_indices, token_to_req_indices, block_table,
            block_size, is_valid_token,
        )

    def indexer_q_fp8(self, *, positions: torch.Tensor, q: torch.Tensor,
                      cos_sin_cache: torch.Tensor, weights: torch.Tensor,
                      weights_softmax_scale: float, weights_head_scale: float,
                      q_fp8: torch.Tensor, weights_out: torch.Tensor) -> None:
        inputs = _IndexerQInputs(positions, q, cos_sin_cache, weights, weights_softmax_scale,
                                 weights_head_scale)
        _indexer_q(
            "_INDEXER_Q_FP8_KERNEL", "_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL", inputs,
            dict(q_fp8=q_fp8.view(torch.uint8), weights_out=weights_out),
            (q_fp8, weights_out), dict(fp8_max=_FP8_MAX, use_fnuz=False),
        )

    def indexer_q_mxfp4(self, *, positions: torch.Tensor, q: torch.Tensor,
                        cos_sin_cache: torch.Tensor, weights: torch.Tensor,
                        weights_softmax_scale: float, weights_head_scale: float,
                        q_packed: torch.Tensor, q_scale: torch.Tensor,
                        weights_out: torch.Tensor) -> None:
        inputs = _IndexerQInputs(positions, q, cos_sin_cache, weights, weights_softmax_scale,
                                 weights_head_scale)
        _indexer_q(
            "_INDEXER_Q_MXFP4_KERNEL", "_FUSED_INDEXER_Q_ROPE_MXFP4_TRITON_KERNEL", inputs,
            dict(q_packed=q_packed, q_scale=q_scale, weights_out=weights_out),
            (q_packed, q_scale, weights_out), {},
        )

    def c128_state_block_size(self) -> int:
        from vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl import (
            _SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL,
        )

        return int(_SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL.state_block_size)

    def c128_compress(self, *, state_cache: torch.Tensor, num_actual: int,
                      token_to_req_indices: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, block_table: torch.Tensor, head_dim: int,
                      compressed_kv: torch.Tensor) -> None:
        from vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl import (
            _SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL,
        )

        _SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL(
            state_cache=state_cache, num_actual=num_actual,
            token_to_req_indices=token_to_req_indices, positions=positions,
            slot_mapping=slot_mapping, block_table=block_table, head_dim=head_dim,
            compressed_kv=compressed_kv,
        )

    def c128_store(self, *, compressed_kv: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, rms_norm_weight: torch.Tensor,
                   rms_norm_eps: float, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                   kv_slot_mapping: torch.Tensor, compress_ratio: int, head_dim: int,
                   rope_head_dim: int) -> None:
        from vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl import (
            _SPARSE_ATTN_NORM_ROPE_STORE_KERNEL,
        )

        _SPARSE_ATTN_NORM_ROPE_STORE_KERNEL(
            compressed_kv=compressed_kv, positions=positions, slot_mapping=slot_mapping,
            rms_norm_weight=rms_norm_weight, rms_norm_eps=rms_norm_eps,
            cos_sin_cache=cos_sin_cache, kv_cache=kv_cache, kv_slot_mapping=kv_slot_mapping,
            compress_ratio=compress_ratio, head_dim=head_dim, rope_head_dim=rope_head_dim,
        )

    def flash_mla_with_kvcache(self, *, q: torch.Tensor, k_cache: torch.Tensor,
                               block_table: torch.Tensor | None, head_dim_v: int,
                               tile_scheduler_metadata: Any,
                               cache_seqlens: torch.Tensor | None, is_fp8_kvcache: bool,
                               indices: torch.Tensor, topk_length: torch.Tensor | None,
                               softmax_scale: float, attn_sink: torch.Tensor | None,
                               extra_k_cache: torch.Tensor | None,
                               extra_indices_in_kvcache: torch.Tensor | None,
                               extra_topk_length: torch.Tensor | None,
                               out: torch.Tensor) -> Any:
        # The module global vLLM's layer calls (a RuntimeError stub without
        # FlashMLA's extensions).
        from vllm.models.deepseek_v4.nvidia import flashmla

        return flashmla.flash_mla_with_kvcache(
            q=q, k_cache=k_cache, block_table=block_table, head_dim_v=head_dim_v,
            tile_scheduler_metadata=tile_scheduler_metadata, cache_seqlens=cache_seqlens,
            is_fp8_kvcache=is_fp8_kvcache, indices=indices, topk_length=topk_length,
            softmax_scale=softmax_scale, attn_sink=attn_sink, extra_k_cache=extra_k_cache,
            extra_indices_in_kvcache=extra_indices_in_kvcache,
            extra_topk_length=extra_topk_length, out=out,
        )


class _IndexerQInputs(NamedTuple):
    """The indexer-q inputs, in the order of the Triton kernels' positional
    parameters; the CuTe DSL kernels take them by these names."""

    positions: torch.Tensor
    q: torch.Tensor
    cos_sin_cache: torch.Tensor
    weights: torch.Tensor
    weights_softmax_scale: float
    weights_head_scale: float


_INDEXER_Q_CUTEDSL = "vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl"
_INDEXER_Q_TRITON = "vllm.models.deepseek_v4.common.ops.fused_indexer_q"


def _indexer_q(cute: str, triton: str, inputs: _IndexerQInputs, cute_outs: dict[str, Any],
               triton_outs: tuple[torch.Tensor, ...], triton_kw: dict[str, Any]) -> None:
    """The choice vLLM's ``fused_indexer_q_rope_quant`` makes: the CuTe DSL kernel
    ``cute`` (keyword arguments) where ``has_cutedsl()``, else its Triton twin
    ``triton`` (positional inputs, then the outputs)."""
    from vllm.utils.import_utils import has_cutedsl

    if has_cutedsl():
        module = importlib.import_module(_INDEXER_Q_CUTEDSL)
        getattr(module, cute)(**inputs._asdict(), **cute_outs)
        return
    module = importlib.import_module(_INDEXER_Q_TRITON)
    getattr(module, triton)(*inputs, *triton_outs, **triton_kw)
