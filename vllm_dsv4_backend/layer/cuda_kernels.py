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
from typing import Any, Protocol, runtime_checkable

import torch

from vllm_dsv4_backend.workspace.streams import CudaStreamBackend

__all__ = ["CudaKernels", "GraphSafeCudaStreamBackend", "VllmCudaKernels"]

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


@runtime_checkable
class CudaKernels(Protocol):
    """What the CUDA layer calls with caller-owned outputs: vLLM's kernel objects
    (:class:`VllmCudaKernels`) and the torch stand-ins that replace them on CPU
    (``tests/cuda``'s recording doubles, the graph harness's ``HarnessKernels``)
    implement this one interface."""

    def global_topk_indices_and_lens(self, global_topk_indices: torch.Tensor,
                                     topk_lens: torch.Tensor, topk_indices: torch.Tensor,
                                     token_to_req_indices: torch.Tensor,
                                     block_table: torch.Tensor, block_size: int,
                                     is_valid_token: torch.Tensor) -> None: ...

    def indexer_q_fp8(self, **kwargs: Any) -> None: ...

    def indexer_q_mxfp4(self, **kwargs: Any) -> None: ...

    def c128_state_block_size(self) -> int: ...

    def c128_compress(self, **kwargs: Any) -> None: ...

    def c128_store(self, **kwargs: Any) -> None: ...

    def flash_mla_with_kvcache(self, **kwargs: Any) -> Any: ...


class VllmCudaKernels:
    """vLLM 0.33's CUDA kernel objects that accept caller-owned outputs.

    Resolved at call time (the CuTe DSL modules import ``cutlass`` and
    initialise the CUDA driver, so never at plugin load), with the dispatch
    of vLLM's wrappers: CuTe DSL when ``has_cutedsl()``, else the Triton
    twins. Tests replace the whole object with torch ops (a test double).
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

    def indexer_q_fp8(self, *, q_fp8: torch.Tensor, weights_out: torch.Tensor,
                      **inputs: Any) -> None:
        """vLLM's indexer q RoPE + FP8 quant into ``q_fp8`` / ``weights_out``;
        ``inputs``: positions, q, cos_sin_cache, weights, weights_softmax_scale,
        weights_head_scale."""
        _indexer_q(
            "_INDEXER_Q_FP8_KERNEL", "_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL", inputs,
            dict(q_fp8=q_fp8.view(torch.uint8), weights_out=weights_out),
            (q_fp8, weights_out), dict(fp8_max=_FP8_MAX, use_fnuz=False),
        )

    def indexer_q_mxfp4(self, *, q_packed: torch.Tensor, q_scale: torch.Tensor,
                        weights_out: torch.Tensor, **inputs: Any) -> None:
        """vLLM's indexer q RoPE + MXFP4 quant into ``q_packed`` / ``q_scale`` /
        ``weights_out``; ``inputs`` as :meth:`indexer_q_fp8`'s."""
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

    def c128_compress(self, **kwargs: Any) -> None:
        from vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl import (
            _SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL,
        )

        _SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL(**kwargs)

    def c128_store(self, **kwargs: Any) -> None:
        from vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl import (
            _SPARSE_ATTN_NORM_ROPE_STORE_KERNEL,
        )

        _SPARSE_ATTN_NORM_ROPE_STORE_KERNEL(**kwargs)

    def flash_mla_with_kvcache(self, **kwargs: Any) -> Any:
        # The module global vLLM's layer calls (a RuntimeError stub without
        # FlashMLA's extensions).
        from vllm.models.deepseek_v4.nvidia import flashmla

        return flashmla.flash_mla_with_kvcache(**kwargs)


_INDEXER_Q_CUTEDSL = "vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl"
_INDEXER_Q_TRITON = "vllm.models.deepseek_v4.common.ops.fused_indexer_q"
# The indexer-q inputs, in the order of the Triton kernels' positional parameters.
_INDEXER_Q_INPUTS = ("positions", "q", "cos_sin_cache", "weights", "weights_softmax_scale",
                     "weights_head_scale")


def _indexer_q(cute: str, triton: str, inputs: dict[str, Any], cute_outs: dict[str, Any],
               triton_outs: tuple[Any, ...], triton_kw: dict[str, Any]) -> None:
    """The choice vLLM's ``fused_indexer_q_rope_quant`` makes: the CuTe DSL kernel
    ``cute`` (keyword arguments) where ``has_cutedsl()``, else its Triton twin
    ``triton`` (positional inputs, then the outputs)."""
    from vllm.utils.import_utils import has_cutedsl

    if has_cutedsl():
        module = importlib.import_module(_INDEXER_Q_CUTEDSL)
        getattr(module, cute)(**inputs, **cute_outs)
        return
    module = importlib.import_module(_INDEXER_Q_TRITON)
    getattr(module, triton)(*(inputs[k] for k in _INDEXER_Q_INPUTS), *triton_outs, **triton_kw)
