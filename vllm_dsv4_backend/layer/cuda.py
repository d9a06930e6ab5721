# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's DeepSeek-V4 layer on CUDA: vLLM 0.33's and 0.34's
``DeepseekV4FlashMLAAttention`` plus the workspace (one module for both: the
bodies the layer repeats are identical in the two; 0.34 changed three
fingerprinted bodies by one line each, removed ``_prepare_and_attn_eager``
(MRV1) and calls ``process_weights_after_loading()`` with no arguments).

The layer keeps vLLM's ``backend_cls`` (``DeepseekV4FlashMLABackend``: the KV
specs, metadata builders and JIT warm-up key on ``FLASHMLA_SPARSE_DSV4``),
vLLM's forward, its stream fan-out and its kernels (FlashMLA, DeepGEMM, the
CuTe DSL / Triton fused ops). What changes is where the outputs of the eager
region go:

==========================================  ====================================  ==========
buffer (vLLM 0.33 / 0.34 allocation)        now                                   stream
==========================================  ====================================  ==========
attention output ``_alloc_attn_out``        workspace ``q.out``                   default
indexer q values / MXFP4 scales / weights   workspace ``indexer_q`` through the   aux0
(``fused_indexer_q_rope_quant``)            kernel objects (``_INDEXER_Q_*`` or
                                            their Triton twins) that take outputs
C128 compressor fp32 scratch                workspace ``compressor`` through      aux0 (C128)
(``_SPARSE_ATTN_COMPRESS_C128_BLOCK8``)     ``compressed_kv=``
C4 decode global top-k indices and lengths  workspace ``topk.global``/``lens``    default
(``compute_global_topk_indices_and_lens``)  through
                                            ``_COMPUTE_GLOBAL_TOPK_INDICES_AND_
                                            LENS_KERNEL``
==========================================  ====================================  ==========

Where vLLM has **no output variant**, the allocation stays vLLM's and
is not reimplemented here: the fused q-norm/RoPE/KV-insert
(``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` returns the padded
q), DeepGEMM's MQA logits (``fp8_fp4_mqa_logits`` / ``..._paged_...``) and
their fp32 upcast, FlashMLA's ``lse`` / ``max_logits`` / tile-scheduler
metadata / split accumulators, the ``wq_b`` GEMM outputs, ``row_ends`` and
``seq_lens // ratio``. The README's CUDA section lists them.

Graphs and streams (see ``docs/workspace.md`` and the reference reading of
vLLM 0.33):

* Every lease of a step belongs to an :class:`vllm_dsv4_backend.eager.Step`
  keyed by ``dbo_current_ubatch_id()``. The eager break
  (``_sparse_indexer_and_attn``, decorated again here) takes its own leases
  (the top-k family) and releases them before it returns, because at
  piecewise-graph replay only its body runs; leases of the captured region
  are taken at capture time and their addresses are frozen there, which the
  workspace allows because it never grows or frees after load.
* Dummy and profile runs (``attn_metadata`` not a dict) reserve the
  workspace (so vLLM's memory profiler sees it) and take no lease: vLLM's
  own code runs and nothing is written into the workspace.
* Producers on aux streams lease on the stream they run on (the current
  stream inside vLLM's ``execute_in_parallel``) and declare the default
  stream as consumer; the manager's fences order every reuse.
  :class:`GraphSafeCudaStreamBackend` drops a fence whose earlier user is
  outside the capture that the new producer is in: at replay that user ran
  in an earlier graph segment or eager break, which vLLM joins into the
  default stream before the next segment launches (an event wait across a
  capture boundary would be illegal, and is never needed).

The vLLM bodies the overrides repeat are fingerprinted
(:data:`COPIED_VLLM_BODIES`, checked by :func:`layer_cls`); the kernel
objects' signatures are checked the same way (from source text for the CuTe
DSL modules, which cannot be imported without ``cutlass``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.models.deepseek_v4.attention import DeepseekV4Indexer
from vllm.models.deepseek_v4.compressor import DeepseekCompressor
from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

from vllm_dsv4_backend import attention_config, eager, envs, testing
from vllm_dsv4_backend.layer import core
from vllm_dsv4_backend.layer.core import make_workspace, num_ubatches
from vllm_dsv4_backend.layer.cuda_kernels import GraphSafeCudaStreamBackend, VllmCudaKernels
from vllm_dsv4_backend.vllm_compat.fingerprints import source_fingerprint, source_params
from vllm_dsv4_backend.workspace import WorkspaceManager

logger = init_logger(__name__)

__all__ = [
    "COPIED_VLLM_BODIES",
    "KERNEL_SIGNATURES",
    "SOURCE_BODIES",
    "DSV4CudaCompressor",
    "DSV4CudaIndexer",
    "DSV4FlashMLAAttention",
    "GraphSafeCudaStreamBackend",
    "VllmCudaKernels",
    "layer_cls",
    "make_workspace",
    "num_ubatches",
    "workspace_manager_for",
]

# The vLLM minor versions this module was read against.
SUPPORTED_VLLM: tuple[tuple[int, int], ...] = ((0, 33), (0, 34))

# vLLM methods whose body an override here repeats with only the output
# buffers (and the kernel indirection) changed, or whose behaviour an override
# relies on: "module:qualname", fingerprinted in vllm_compat/fingerprints.py.
COPIED_VLLM_BODIES: tuple[str, ...] = (
    # forward() wraps it: relies on it calling _alloc_attn_out and _o_proj.
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention.forward",
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._alloc_attn_out",
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._sparse_indexer_and_attn",
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._prepare_and_attn",
    "vllm.models.deepseek_v4.attention:DeepseekV4Indexer._q_rope_quant",
    "vllm.models.deepseek_v4.attention:DeepseekV4Indexer.forward",
    "vllm.models.deepseek_v4.common.ops.fused_indexer_q:fused_indexer_q_rope_quant",
    "vllm.models.deepseek_v4.common.ops.cache_utils:compute_global_topk_indices_and_lens",
    "vllm.models.deepseek_v4.compressor:DeepseekCompressor._compress_norm_rope_store",
    "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention._forward_decode",
    "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention.forward_mqa",
)

# vLLM control flow the workspace fences' soundness rests on (not repeated
# here, but relied on: the aux-stream fork/join that orders every hand-over
# at graph replay, the eager break and the breakable capture, the
# compressor's stream choice and the parallel input projections; see
# docs/workspace.md), per vLLM minor version: fingerprinted so a change is
# a loud refusal instead of a silent race.
_FENCE_CONTROL_FLOW_COMMON = (
    "vllm.utils.multi_stream_utils:execute_in_parallel",
    "vllm.utils.multi_stream_utils:maybe_execute_in_parallel",
    "vllm.compilation.breakable_cudagraph:eager_break_during_capture",
    "vllm.compilation.breakable_cudagraph:BreakableCUDAGraphCapture",
    "vllm.models.deepseek_v4.compressor:DeepseekCompressor.forward",
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._run_parallel_input_projections",
)
FENCE_CONTROL_FLOW: dict[str, tuple[str, ...]] = {
    "0.33": (*_FENCE_CONTROL_FLOW_COMMON,
             "vllm.models.deepseek_v4.attention:DeepseekV4Attention._prepare_and_attn_eager"),
    "0.34": _FENCE_CONTROL_FLOW_COMMON,
}

# vLLM methods decorated with eager_break_during_capture, per minor version
# (0.34 removed MRV1 and with it _prepare_and_attn_eager).
DECORATED: dict[str, tuple[str, ...]] = {
    "0.33": ("_sparse_indexer_and_attn", "_prepare_and_attn_eager"),
    "0.34": ("_sparse_indexer_and_attn",),
}

# Kernel objects called with caller-owned outputs: (module, class.__call__,
# parameter names). Checked from the module's source text (no import).
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

# Bodies mirrored from modules that import ``cutlass`` (no import on CPU):
# (module, qualname) -> fingerprint of the source text, vLLM 0.33.0 and 0.34.0
# (the file is byte-identical in both).
SOURCE_BODIES: dict[tuple[str, str], str] = {
    # DSV4CudaCompressor._compress_norm_rope_store repeats its C128 branch.
    ("vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl",
     "SparseAttnCompressorCuteDSL.__call__"): "1aed2b6b14e57d54",
}

# --- workspace ---------------------------------------------------------------------


def _graph_safe_streams(device: torch.device) -> Any:
    return GraphSafeCudaStreamBackend(device) if device.type == "cuda" else None


def workspace_manager_for(
    vllm_config: Any,
    layer: DSV4FlashMLAAttention,
    model_key: object,
) -> WorkspaceManager:
    """The workspace of one model (main model, MTP drafter or DSpark draft:
    each has its own aux streams and top-k buffer, ``model_key``), created by
    its first attention layer (:func:`.core.manager_for`, graph-safe CUDA
    streams); reserved when the layers' weights are loaded."""
    return core.manager_for(vllm_config, layer, "cuda", model_key,
                            streams=_graph_safe_streams)


def _owner(module: Any) -> DSV4FlashMLAAttention | None:
    ref = getattr(module, "_dsv4_owner_ref", None)
    return ref() if ref is not None else None


def _set_owner(module: Any, owner: DSV4FlashMLAAttention) -> None:
    # A plain attribute: nn.Module.__setattr__ would register the parent
    # layer as a submodule of its own child.
    object.__setattr__(module, "_dsv4_owner_ref", weakref.ref(owner))


# --- the indexer and the C128 compressor -------------------------------------------


class DSV4CudaIndexer(DeepseekV4Indexer):
    """vLLM's indexer with the quantized index q written into the step's
    ``indexer_q`` lease by vLLM's kernel objects (on aux0 in vLLM's fan-out:
    the lease is taken on the stream the call runs on, and the default
    stream, where ``indexer_op`` reads it, is declared as consumer)."""

    def _q_rope_quant(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        rotary_emb: torch.nn.Module,
        indexer_weights: torch.Tensor,
    ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        owner = _owner(self)
        step = owner._dsv4_current_step() if owner is not None else None
        if (
            step is None
            or positions.shape[0] != step.num_tokens
            or (not self.use_fp4_kv and _platform_fp8_dtype() != torch.float8_e4m3fn)
        ):
            # Dummy/profile run, or a shape the workspace was not sized for.
            return super()._q_rope_quant(positions, q, rotary_emb, indexer_weights)
        lease = step.lease("indexer_q")
        home = owner._dsv4_home_stream()
        if home is not None:
            lease.used_on(home)
        kernels = owner._dsv4_kernels
        common = dict(
            positions=positions,
            q=q,
            cos_sin_cache=rotary_emb.cos_sin_cache,
            weights=indexer_weights,
            weights_softmax_scale=self.softmax_scale,
            weights_head_scale=self.n_head**-0.5,
        )
        weights_out = lease["weights"]
        if self.use_fp4_kv:
            q_packed, q_scale = lease["q"], lease["scales"]
            kernels.indexer_q_mxfp4(**common, q_packed=q_packed, q_scale=q_scale,
                                    weights_out=weights_out)
            # As vLLM's wrapper: 4 ue8m0 bytes per (token, head) as one int32.
            return (q_packed, q_scale.view(torch.int32).squeeze(-1)), weights_out
        q_fp8 = lease["q"]
        kernels.indexer_q_fp8(**common, q_fp8=q_fp8, weights_out=weights_out)
        return q_fp8, weights_out


def _platform_fp8_dtype() -> torch.dtype:
    from vllm.platforms import current_platform

    try:
        return current_platform.fp8_dtype()
    except Exception:  # noqa: BLE001 - an unspecified platform (CPU CI)
        return torch.float8_e4m3fn


class DSV4CudaCompressor(DeepseekCompressor):
    """vLLM's MLA compressor of a C128 layer with its fp32 scratch
    (``compressed_kv``) leased from the workspace: vLLM's CuTe DSL wrapper
    allocates it per call; its two kernels take it as an argument. C4 and
    the plain-row (bf16/fp8 full-cache) layouts allocate nothing here or have
    no scratch argument, and run vLLM's code unchanged."""

    def _compress_norm_rope_store(
        self,
        state_metadata: Any,
        state_cache: torch.Tensor,
        state_width: int,
        positions: torch.Tensor,
        rotary_emb: Any,
        attn_metadata: dict[str, Any],
        pdl_kwargs: dict,
    ) -> None:
        owner = _owner(self)
        step = owner._dsv4_current_step() if owner is not None else None
        k_cache_layer = self._static_forward_context[self.k_cache_prefix]
        kv_cache = k_cache_layer.kv_cache
        slot_mapping = state_metadata.slot_mapping
        num_actual = slot_mapping.shape[0]
        if (
            step is None
            or self.compress_ratio != 128
            or self.head_dim != 512
            or kv_cache.dtype != torch.uint8
            or num_actual > step.num_tokens
        ):
            super()._compress_norm_rope_store(
                state_metadata, state_cache, state_width, positions, rotary_emb,
                attn_metadata, pdl_kwargs,
            )
            return
        # vLLM's SparseAttnCompressorCuteDSL.__call__, C128 fp8_ds_mla branch.
        if positions.numel() == 0:
            return
        if kv_cache.ndim != 3:
            raise ValueError(
                "CuTe DSL sparse-attn compressor expects the real DeepSeek V4 "
                f"3D kv_cache layout, got ndim={kv_cache.ndim}.",
            )
        kernels = owner._dsv4_kernels
        block_size = state_metadata.block_size
        state_block_size = kernels.c128_state_block_size()
        if block_size != state_block_size:
            raise ValueError(
                "CuTe DSL C128 sparse-attn compressor requires state-cache "
                f"block_size={state_block_size}, got {block_size}."
            )
        k_cache_metadata = attn_metadata[self.k_cache_prefix]
        lease = step.lease("compressor")
        compressed_kv = lease["scratch"][:num_actual]
        kernels.c128_compress(
            state_cache=state_cache,
            num_actual=num_actual,
            token_to_req_indices=state_metadata.token_to_req_indices,
            positions=positions,
            slot_mapping=slot_mapping,
            block_table=state_metadata.block_table,
            head_dim=self.head_dim,
            compressed_kv=compressed_kv,
        )
        kernels.c128_store(
            compressed_kv=compressed_kv,
            positions=positions,
            slot_mapping=slot_mapping,
            rms_norm_weight=self.norm.weight,
            rms_norm_eps=self.rms_norm_eps,
            cos_sin_cache=rotary_emb.cos_sin_cache,
            kv_cache=kv_cache,
            kv_slot_mapping=k_cache_metadata.slot_mapping,
            compress_ratio=self.compress_ratio,
            head_dim=self.head_dim,
            rope_head_dim=self.rope_head_dim,
        )
        # Producer and consumer share this stream: hand the slot back now.
        step.release("compressor")


# --- the layer ---------------------------------------------------------------------


class DSV4FlashMLAAttention(DeepseekV4FlashMLAAttention):
    """DeepSeek-V4 attention served by the plugin (CUDA build of vLLM 0.33 / 0.34)."""

    # backend_cls / swa_backend_cls: vLLM's, inherited on purpose.

    def _get_indexer_cls(self, vllm_config: Any) -> type[DeepseekV4Indexer]:
        return DSV4CudaIndexer

    def __init__(
        self,
        vllm_config: Any,
        prefix: str,
        topk_indices_buffer: torch.Tensor | None = None,
        aux_stream_list: list[torch.cuda.Stream] | None = None,
    ) -> None:
        check_kernel_setting()
        check_mxfp4_arch(vllm_config)
        super().__init__(vllm_config, prefix, topk_indices_buffer, aux_stream_list)
        model_key = aux_stream_list if aux_stream_list is not None else topk_indices_buffer
        self._dsv4_attach(workspace_manager_for(vllm_config, self, model_key))
        cache_config = getattr(vllm_config, "cache_config", None)
        self._dsv4_memory_utilization = getattr(cache_config, "gpu_memory_utilization", None)

    def _dsv4_attach(
        self, workspace: WorkspaceManager, kernels: VllmCudaKernels | None = None
    ) -> None:
        """Register this layer with ``workspace`` and wire its indexer and
        C128 compressor to it (``__init__`` does this; tests call it on
        layers built without a ``VllmConfig``)."""
        self._workspace = workspace
        self._dsv4_kernels = kernels if kernels is not None else VllmCudaKernels()
        self._dsv4_steps = core.StepHolder(workspace, self.prefix, always_lookup=True,
                                           platform="CUDA")
        self._dsv4_logged = False
        self._dsv4_memory_utilization: float | None = None
        workspace.add_layer(self.prefix, self.compress_ratio)
        if self.indexer is not None:
            if not isinstance(self.indexer, DSV4CudaIndexer):
                self.indexer.__class__ = DSV4CudaIndexer
            _set_owner(self.indexer, self)
        if self.compressor is not None and self.compress_ratio == 128:
            # Built directly as DeepseekCompressor (no factory hook in 0.33);
            # the subclass adds no state.
            self.compressor.__class__ = DSV4CudaCompressor
            _set_owner(self.compressor, self)

    # --- step state (per micro-batch) ----------------------------------------------

    def _dsv4_current_step(self) -> eager.Step | None:
        return self._dsv4_steps.current()

    def _dsv4_home_stream(self) -> Any:
        return self._dsv4_steps.home()

    def dsv4_step(self, num_tokens: int) -> contextlib.AbstractContextManager[eager.Step]:
        """One forward's leases of this layer and micro-batch, released on
        exit; the current stream is the step's home (default) stream."""
        return self._dsv4_steps.open(num_tokens)

    def _dsv4_reserve(self) -> None:
        # `private` is refused here, with the bytes and the budget, when one
        # set of buffers per layer does not fit next to vLLM's share of memory.
        core.reserve_and_report(self._workspace, "CUDA", self._dsv4_memory_utilization)

    def process_weights_after_loading(self, act_dtype: torch.dtype | None = None) -> None:
        # vLLM 0.33's loader calls this with the model dtype, 0.34's
        # (finalize_model_weights) with no arguments. Neither version's base
        # class has the hook; a future one's gets the arguments it takes.
        parent = getattr(super(), "process_weights_after_loading", None)
        if callable(parent):
            if act_dtype is None:
                parent()
            else:
                parent(act_dtype)
        # All of this model's layers exist by now: reserve before vLLM
        # profiles memory (and before any CUDA graph is captured).
        self._dsv4_reserve()
        testing.after_layer_loaded(self)

    # --- forward ---------------------------------------------------------------------

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        llama_4_scaling: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # vLLM's forward unchanged; the overridden hooks below lease from the
        # step opened here.
        self._dsv4_reserve()
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            # Dummy / profile run: vLLM's code, nothing leased or written.
            return super().forward(positions, hidden_states, llama_4_scaling)
        with self.dsv4_step(hidden_states.shape[0]):
            out = super().forward(positions, hidden_states, llama_4_scaling)
        if not self._dsv4_logged:
            self._dsv4_logged = True
            testing.record_layer(self, f"ratio{self.compress_ratio}", "vllm_cuda")
        testing.after_layer_forward(self, self._workspace)
        return out

    @property
    def indexer_kv_dtype(self) -> str:
        return self._workspace.config.indexer_kv_dtype

    def _alloc_attn_out(self, num_tokens: int, hidden_states: torch.Tensor) -> Any:
        step = self._dsv4_current_step()
        if (
            step is None
            or num_tokens != step.num_tokens
            or hidden_states.dtype != torch.bfloat16
        ):
            return super()._alloc_attn_out(num_tokens, hidden_states)
        # Consumed by _o_proj on this (default) stream, after the eager break.
        return step.lease("q")["out"]

    @eager_break_during_capture
    def _sparse_indexer_and_attn(
        self,
        hidden_states: torch.Tensor,
        index_q: torch.Tensor | None,
        index_q_scale: torch.Tensor | None,
        index_weights: torch.Tensor | None,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        out: Any,
    ) -> None:
        # vLLM's body, plus the early hand-back of the indexer q.
        if self.indexer is not None and index_q is not None:
            assert index_weights is not None
            q_quant = (index_q, index_q_scale) if index_q_scale is not None else index_q
            self.indexer.indexer_op(
                hidden_states,
                q_quant,
                None,
                index_weights,
            )
            # Its last consumer is enqueued. At piecewise-graph replay only this
            # body runs (no step): the lease was taken and returned at capture.
            step = self._dsv4_current_step()
            if step is not None:
                step.release("indexer_q")

        # MLA attention writes into the pre-allocated `out` buffer
        # (see _alloc_attn_out).
        self.forward_mqa(q, kv, positions, out)

    def _forward_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor | None,
        swa_metadata: Any,
        attn_metadata: Any,
        swa_only: bool,
        output: torch.Tensor,
    ) -> None:
        # vLLM 0.33's body; C4 global top-k into the workspace, through the
        # kernel object (its wrapper allocates both outputs per call).
        num_decodes = swa_metadata.num_decodes
        num_decode_tokens = swa_metadata.num_decode_tokens
        kernels = self._dsv4_kernels
        ws = self._workspace

        with contextlib.ExitStack() as stack:
            topk_indices = None
            topk_lens = None
            if not swa_only:
                assert attn_metadata is not None
                assert swa_metadata.is_valid_token is not None
                block_size = attn_metadata.block_size // self.compress_ratio
                is_valid = swa_metadata.is_valid_token[:num_decode_tokens]
                if self.compress_ratio == 4:
                    # C4A: local indices differ per layer (filled by Indexer).
                    assert self.topk_indices_buffer is not None
                    local = self.topk_indices_buffer[:num_decode_tokens]
                    if ws.reserved and local.shape[-1] == ws.config.index_topk:
                        # Its own step: at graph replay this eager body runs
                        # without the forward's.
                        step = stack.enter_context(
                            eager.Step(ws, self.prefix, num_decode_tokens, core.ubatch_id())
                        )
                        lease = step.lease("topk")
                        global_indices, topk_lens = lease["global"], lease["lens"]
                        kernels.global_topk_indices_and_lens(
                            global_indices,
                            topk_lens,
                            local,
                            swa_metadata.token_to_req_indices,
                            attn_metadata.block_table[:num_decodes],
                            block_size,
                            is_valid,
                        )
                    else:
                        from vllm.models.deepseek_v4.common.ops import (
                            compute_global_topk_indices_and_lens,
                        )

                        global_indices, topk_lens = compute_global_topk_indices_and_lens(
                            local,
                            swa_metadata.token_to_req_indices,
                            attn_metadata.block_table[:num_decodes],
                            block_size,
                            is_valid,
                        )
                    topk_indices = global_indices.view(num_decode_tokens, 1, -1)
                else:
                    # C128A: pre-computed during metadata build.
                    topk_indices = attn_metadata.c128a_global_decode_topk_indices
                    topk_lens = attn_metadata.c128a_decode_topk_lens

            swa_indices = swa_metadata.decode_swa_indices
            swa_lens = swa_metadata.decode_swa_lens
            q = q.unsqueeze(1)
            swa_cache = self.swa_cache_layer.kv_cache.unsqueeze(-2)
            if kv_cache is not None:
                kv_cache = kv_cache.unsqueeze(-2)

            if self.compress_ratio <= 1:
                tile_metadata = swa_metadata.tile_sched_swaonly
            elif self.compress_ratio == 4:
                tile_metadata = swa_metadata.tile_sched_c4a
            elif self.compress_ratio == 128:
                tile_metadata = swa_metadata.tile_sched_c128a
            else:
                raise ValueError(
                    f"Unsupported compress_ratio={self.compress_ratio}; "
                    "expected 1, 4, or 128."
                )
            assert tile_metadata is not None, (
                "swa_metadata missing tile_sched entry for "
                f"compress_ratio={self.compress_ratio}; "
                "DeepseekSparseSWAMetadataBuilder.build_tile_scheduler did not "
                "allocate one for this layer type."
            )

            kernels.flash_mla_with_kvcache(
                q=q,
                k_cache=swa_cache,
                block_table=None,
                head_dim_v=512,
                tile_scheduler_metadata=tile_metadata,
                cache_seqlens=None,
                is_fp8_kvcache=True,
                indices=swa_indices,
                topk_length=swa_lens,
                softmax_scale=self.scale,
                attn_sink=self.attn_sink,
                extra_k_cache=kv_cache if not swa_only else None,
                extra_indices_in_kvcache=topk_indices,
                extra_topk_length=topk_lens,
                out=output.unsqueeze(1),
            )
            # Leaving the block hands the top-k lease back: its consumer
            # (FlashMLA, this stream) is enqueued.


# --- checks and the factory ----------------------------------------------------------


def check_kernel_setting() -> None:
    """Refuse a ``VLLM_DSV4_KERNEL`` the CUDA layer cannot honour rather than ignore
    it: ``torch`` and ``vllm_cpu`` are the CPU layer's sparse-MLA paths, and this
    layer always runs vLLM's FlashMLA kernels."""
    kernel = envs.VLLM_DSV4_KERNEL
    if kernel != "auto":
        raise ValueError(
            f"VLLM_DSV4_KERNEL={kernel} selects a sparse-MLA path of the CPU layer; the "
            "CUDA layer always runs vLLM's FlashMLA kernels. Supported on CUDA: ['auto'] "
            "(unset VLLM_DSV4_KERNEL)"
        )


def check_mxfp4_arch(vllm_config: Any) -> None:
    """Refuse the MXFP4 indexer cache below SM100 at layer construction,
    naming the GPU and the supported values (vLLM's own check, later, names
    neither the GPU nor the FP8 alternative)."""
    if core.indexer_kv_dtype(vllm_config) != "mxfp4":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    capability = current_platform.get_device_capability()
    name = current_platform.get_device_name()
    message = attention_config.mxfp4_arch_error(
        capability.major * 10 + capability.minor if capability is not None else None, name
    )
    if message is not None:
        raise ValueError(message)


def check_kernel_signatures() -> None:
    """Raise ``PatchError`` unless every kernel object the layer calls has the
    parameters it was written against."""
    from vllm_dsv4_backend.vllm_compat import hooks

    for module_name, qualname, want in KERNEL_SIGNATURES:
        got = source_params(module_name, qualname)
        if got is None:
            raise hooks.fail(f"{module_name}.{qualname}", "not found in vLLM's source")
        if tuple(got) != want:
            raise hooks.fail(
                f"{module_name}.{qualname}",
                f"signature is ({', '.join(got)}), expected ({', '.join(want)})",
            )


@functools.cache
def _checked() -> type:
    import vllm

    from vllm_dsv4_backend.vllm_compat import fingerprints, hooks, version

    key = version.parse_version(str(vllm.__version__))
    if key not in SUPPORTED_VLLM:
        raise NotImplementedError(
            "vllm_dsv4_backend's CUDA layer is written against vLLM "
            + " and ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
            + f"; this is vLLM {vllm.__version__}"
        )
    minor = f"{key[0]}.{key[1]}"
    fingerprints.check(COPIED_VLLM_BODIES, minor)
    fingerprints.check(FENCE_CONTROL_FLOW[minor], minor)
    check_kernel_signatures()
    for (module_name, qualname), want in SOURCE_BODIES.items():
        got = source_fingerprint(module_name, qualname)
        if got != want:
            raise hooks.fail(
                f"{module_name}.{qualname}",
                f"its source changed (fingerprint {got}, the plugin's copy was written "
                f"against {want}); the plugin's copy of this body must be re-read",
            )
    for name in DECORATED[minor]:
        base = getattr(DeepseekV4FlashMLAAttention, name, None)
        if not hasattr(base, "__wrapped__"):
            raise hooks.fail(
                f"DeepseekV4Attention.{name}",
                "is missing or no longer decorated with eager_break_during_capture",
            )
    return DSV4FlashMLAAttention


def layer_cls() -> type:
    """The CUDA layer, after checking the vLLM version (0.33.x or 0.34.x), the
    vLLM bodies it repeats, the control flow its fences rely on and the kernel
    signatures it calls.

    Raises:
        NotImplementedError: another vLLM version.
        PatchError: a copied body, the fenced control flow or a kernel
            signature changed.
    """
    return _checked()
