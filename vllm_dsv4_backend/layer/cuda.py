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
region go: the attention output (``_alloc_attn_out``) into the workspace's
``q.out``, the indexer q (``fused_indexer_q_rope_quant``) into ``indexer_q``
through vLLM's kernel objects, the C128 compressor's fp32 scratch into
``compressor`` and the C4 decode global top-k indices and lengths
(``compute_global_topk_indices_and_lens``) into ``topk``; the table, with
the stream of each, is ``docs/workspace.md`` ("What each layer leases").

Where vLLM has **no output variant**, the allocation stays vLLM's and
is not reimplemented here: the fused q-norm/RoPE/KV-insert
(``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` returns the padded
q), DeepGEMM's MQA logits (``fp8_fp4_mqa_logits`` / ``..._paged_...``) and
their fp32 upcast, FlashMLA's ``lse`` / ``max_logits`` / tile-scheduler
metadata / split accumulators, the ``wq_b`` GEMM outputs, ``row_ends`` and
``seq_lens // ratio``. The README's CUDA section lists them.

Graphs and streams (see ``docs/workspace.md`` and the reference reading of
vLLM 0.33):

* Every lease belongs to an :class:`vllm_dsv4_backend.eager.Region`
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

The vLLM bodies the overrides repeat, the control flow the fences rely on
and the methods vLLM decorates are fingerprinted in one drift table
(:data:`VLLM_DRIFT`, checked by :func:`layer_cls`); the kernel objects'
signatures are checked the same way (from source text for the CuTe DSL
modules, which cannot be imported without ``cutlass``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.models.deepseek_v4.attention import DeepseekV4Indexer
from vllm.models.deepseek_v4.compressor import DeepseekCompressor
from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

from vllm_dsv4_backend import eager, envs, testing
from vllm_dsv4_backend.layer import core
from vllm_dsv4_backend.layer.core import make_workspace, num_ubatches
from vllm_dsv4_backend.layer.cuda_kernels import (
    KERNEL_SIGNATURES,
    GraphSafeCudaStreamBackend,
    VllmCudaKernels,
)
from vllm_dsv4_backend.vllm_compat import attention_config
from vllm_dsv4_backend.vllm_compat.fingerprints import source_params
from vllm_dsv4_backend.workspace import WorkspaceManager

logger = init_logger(__name__)

__all__ = [
    "KERNEL_SIGNATURES",
    "VLLM_DRIFT",
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


# --- the layer ---------------------------------------------------------------------


class DSV4FlashMLAAttention(DeepseekV4FlashMLAAttention, core.WorkspaceLayer):
    """DeepSeek-V4 attention served by the plugin (CUDA build of vLLM 0.33 / 0.34);
    the workspace bookkeeping is :class:`.core.WorkspaceLayer`'s."""

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
        self._dsv4_kernels = kernels if kernels is not None else VllmCudaKernels()
        self._dsv4_logged = False
        # Every micro-batch id is asked of vLLM: one beyond the reservation is refused.
        self._dsv4_attach_workspace(workspace, "CUDA", always_lookup=True)
        if self.indexer is not None:
            self._dsv4_adopt(self.indexer, DSV4CudaIndexer)
        if self.compressor is not None and self.compress_ratio == 128:
            # Built directly as DeepseekCompressor (no factory hook in 0.33).
            self._dsv4_adopt(self.compressor, DSV4CudaCompressor)

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
        # region opened here.
        self._dsv4_reserve()
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            # Dummy / profile run: vLLM's code, nothing leased or written.
            return super().forward(positions, hidden_states, llama_4_scaling)
        with self.dsv4_region(hidden_states.shape[0]):
            out = super().forward(positions, hidden_states, llama_4_scaling)
        if not self._dsv4_logged:
            self._dsv4_logged = True
            testing.record_layer(self, f"ratio{self.compress_ratio}", "vllm_cuda")
        testing.after_layer_forward(self, self._workspace)
        return out

    def _alloc_attn_out(self, num_tokens: int, hidden_states: torch.Tensor) -> Any:
        region = self._dsv4_current_region()
        if not region:
            # Dummy/profile run: vLLM's code, nothing leased.
            return super()._alloc_attn_out(num_tokens, hidden_states)
        if num_tokens != region.num_tokens or hidden_states.dtype != torch.bfloat16:
            # A size or dtype the workspace was not sized for: vLLM allocates.
            self._workspace.count_fallback(self.prefix, "q")
            return super()._alloc_attn_out(num_tokens, hidden_states)
        # Consumed by _o_proj on this (default) stream, after the eager break.
        return region.lease("q")["out"]

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
            # body runs (no region): the lease was taken and returned at capture.
            region = self._dsv4_current_region()
            if region:
                region.release("indexer_q")

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
                    if ws.reserved and local.shape[-1] == ws.config.params["index_topk"]:
                        # Its own region: at graph replay this eager body runs
                        # without the forward's.
                        region = stack.enter_context(
                            eager.Region(ws, self.prefix, num_decode_tokens, core.ubatch_id())
                        )
                        lease = region.lease("topk")
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
                        # Not reserved, or a top-k width the workspace was not
                        # sized for: vLLM's wrapper allocates both outputs.
                        ws.count_fallback(self.prefix, "topk")
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


# --- the indexer and the C128 compressor -------------------------------------------


class DSV4CudaIndexer(DeepseekV4Indexer):
    """vLLM's indexer with the quantized index q written into the region's
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
        owner = core.owner_of(self)
        region = owner._dsv4_current_region() if owner is not None else None
        if not region:
            # Dummy/profile run: vLLM's code, nothing leased.
            return super()._q_rope_quant(positions, q, rotary_emb, indexer_weights)
        if positions.shape[0] != region.num_tokens or (
            not self.use_fp4_kv and _platform_fp8_dtype() != torch.float8_e4m3fn
        ):
            # A shape or an FP8 dtype the workspace was not sized for: vLLM allocates.
            owner._workspace.count_fallback(owner.prefix, "indexer_q")
            return super()._q_rope_quant(positions, q, rotary_emb, indexer_weights)
        lease = region.lease("indexer_q")
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
        owner = core.owner_of(self)
        region = owner._dsv4_current_region() if owner is not None else None
        k_cache_layer = self._static_forward_context[self.k_cache_prefix]
        kv_cache = k_cache_layer.kv_cache
        slot_mapping = state_metadata.slot_mapping
        num_actual = slot_mapping.shape[0]
        if (
            not region
            or self.compress_ratio != 128
            or self.head_dim != 512
            or kv_cache.dtype != torch.uint8
            or num_actual > region.num_tokens
        ):
            if region and self.compress_ratio == 128 and positions.numel():
                # Served, but a layout (plain-row cache) or a size the scratch
                # lease does not cover: vLLM's wrapper allocates its scratch.
                owner._workspace.count_fallback(owner.prefix, "compressor")
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
        lease = region.lease("compressor")
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
        region.release("compressor")


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


# --- checks and the factory ----------------------------------------------------------


# The vLLM minor versions this module was read against.
SUPPORTED_VLLM: tuple[tuple[int, int], ...] = ((0, 33), (0, 34))

# The drift table: every vLLM symbol this layer depends on, one entry each,
# "module:qualname" -> (roles, {vLLM minor: fingerprint}); checked by
# layer_cls() (vllm_compat/fingerprints.py: the roles, the normalisation, the
# messages). Roles: "copied" (an override here repeats the body with only the
# output buffers and the kernel indirection changed, or relies on what it
# calls), "fenced" (vLLM control flow the workspace fences' soundness rests on,
# not repeated: the aux-stream fork/join that orders every hand-over at graph
# replay, the eager break and the breakable capture, the compressor's stream
# choice and the parallel input projections; see docs/workspace.md),
# "decorated" (vLLM decorates it with eager_break_during_capture; checked on
# DeepseekV4FlashMLAAttention), "source" (read from the source text: the
# module imports cutlass). None: absent in that minor (checked). Copying one
# more vLLM body = one more entry, with a fingerprint per supported minor
# (`python -m vllm_dsv4_backend.vllm_compat.fingerprints --layer cuda` prints
# them). Keep it a literal: tools/cuda_graph/build_stub.py reads it from this
# file's text (it cuts the "copied"/"fenced" bodies of the modules it stubs).
VLLM_DRIFT: dict[str, tuple[str, dict[str, str | None]]] = {
    # forward() wraps it: relies on it calling _alloc_attn_out and _o_proj.
    # 0.34: `_prepare_and_attn_fn(` -> `_prepare_and_attn(`.
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention.forward":
        ("copied", {"0.33": "f6cb1b89b5a9524e", "0.34": "f3dd00fb7c177bbb"}),
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._alloc_attn_out":
        ("copied", {"0.33": "849d7b8129de8176", "0.34": "849d7b8129de8176"}),
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._sparse_indexer_and_attn":
        ("copied decorated", {"0.33": "6cbd97b346291a0e", "0.34": "6cbd97b346291a0e"}),
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._prepare_and_attn":
        ("copied", {"0.33": "286b9609633989d6", "0.34": "286b9609633989d6"}),
    "vllm.models.deepseek_v4.attention:DeepseekV4Indexer._q_rope_quant":
        ("copied", {"0.33": "fb2555cb2fb4264a", "0.34": "fb2555cb2fb4264a"}),
    # 0.34: `_fill_short_context_topk_indices` made public.
    "vllm.models.deepseek_v4.attention:DeepseekV4Indexer.forward":
        ("copied", {"0.33": "5107191d0d64dabc", "0.34": "67606356967df910"}),
    # 0.34: its CPU branch imports `vllm._cpu_ops`.
    "vllm.models.deepseek_v4.common.ops.fused_indexer_q:fused_indexer_q_rope_quant":
        ("copied", {"0.33": "ba22a863327681be", "0.34": "351c53c1351daaae"}),
    "vllm.models.deepseek_v4.common.ops.cache_utils:compute_global_topk_indices_and_lens":
        ("copied", {"0.33": "d1d3086ee9a8f9d2", "0.34": "d1d3086ee9a8f9d2"}),
    "vllm.models.deepseek_v4.compressor:DeepseekCompressor._compress_norm_rope_store":
        ("copied", {"0.33": "45873ded08c4b0e9", "0.34": "45873ded08c4b0e9"}),
    "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention._forward_decode":
        ("copied", {"0.33": "6caed9c89e317811", "0.34": "6caed9c89e317811"}),
    "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention.forward_mqa":
        ("copied", {"0.33": "6b62ae5fa919f811", "0.34": "6b62ae5fa919f811"}),
    # DSV4CudaCompressor._compress_norm_rope_store repeats its C128 branch (the
    # file is byte-identical in 0.33.0 and 0.34.0).
    "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl:"
    "SparseAttnCompressorCuteDSL.__call__":
        ("copied source", {"0.33": "1aed2b6b14e57d54", "0.34": "1aed2b6b14e57d54"}),
    # --- the control flow the fences rely on ---
    "vllm.utils.multi_stream_utils:execute_in_parallel":
        ("fenced", {"0.33": "2640fdf87dd37260", "0.34": "2640fdf87dd37260"}),
    "vllm.utils.multi_stream_utils:maybe_execute_in_parallel":
        ("fenced", {"0.33": "73fdf282243c4653", "0.34": "73fdf282243c4653"}),
    "vllm.compilation.breakable_cudagraph:eager_break_during_capture":
        ("fenced", {"0.33": "2c704948c5b1c76d", "0.34": "2c704948c5b1c76d"}),
    "vllm.compilation.breakable_cudagraph:BreakableCUDAGraphCapture":
        ("fenced", {"0.33": "8269becd5503697e", "0.34": "8269becd5503697e"}),
    "vllm.models.deepseek_v4.compressor:DeepseekCompressor.forward":
        ("fenced", {"0.33": "2d960f098ef54037", "0.34": "2d960f098ef54037"}),
    # 0.34: the compressors' `torch.mm(out_dtype=f32)` became their
    # `fused_wkv_wgate` module, same streams.
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._run_parallel_input_projections":
        ("fenced", {"0.33": "c12534fd255ef740", "0.34": "5cbce5f307abc0fc"}),
    # MRV1's eager path, removed in 0.34.
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._prepare_and_attn_eager":
        ("fenced decorated", {"0.33": "9fef557e90c02951", "0.34": None}),
}


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

    from vllm_dsv4_backend.vllm_compat import fingerprints, version

    key = version.parse_version(str(vllm.__version__))
    if key not in SUPPORTED_VLLM:
        raise NotImplementedError(
            "vllm_dsv4_backend's CUDA layer is written against vLLM "
            + " and ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
            + f"; this is vLLM {vllm.__version__}"
        )
    minor = f"{key[0]}.{key[1]}"
    # Copied bodies, fenced control flow, decorated methods: one table.
    fingerprints.check(VLLM_DRIFT, minor, decorated_on=DeepseekV4FlashMLAAttention)
    check_kernel_signatures()
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
