# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's DeepSeek-V4 layer on CPU: vLLM 0.32's ``DeepseekV4CPUAttention``
plus the workspace.

The layer calls the ``torch.ops._C`` ops vLLM's CPU layer calls, in its order,
on the same inputs: vLLM's real C++ kernels where the loaded library has them
(AVX512-BF16/AMX builds), the plugin's registered torch fallbacks
(:mod:`vllm_dsv4_backend.vllm_compat.cpu_ops`) where it does not. So on every
machine its output is vLLM's layer's output, bit for bit. What differs is
where the outputs go:

========================================  ===========================================
op (vLLM's order)                         output
========================================  ===========================================
``fused_qnorm_rope_kv_insert_cpu``        returned by the kernel (no output argument)
``fused_indexer_q_rope_quant_cpu``        workspace ``indexer_q`` (``q``, ``weights``)
``save_partial_states_cpu`` / stores      the paged caches (vLLM's)
``fp8_paged_mqa_logits_cpu``              returned by the kernel (no output argument)
``topk_transform_512_cpu``                vLLM's persistent top-k buffer + workspace
                                          ``topk.global`` (the page ids vLLM discards)
``flash_mla_with_kvcache_cpu``            workspace ``q.out`` (the padded attention
                                          output vLLM allocated per layer and step)
``inverse_gptj_rope_o_proj_cpu``          returned by the kernel (no output argument)
``bmm_cpu`` (``wo_a``)                    the inverse-RoPE result's memory (dead by
                                          then); its group-major input, and ``wo_b``'s
                                          token-major input after it, in ``q.out``
========================================  ===========================================

The MXFP4 indexer cache has no vLLM CPU op (vLLM's CPU path is FP8 only), so
there the plugin's torch ops quantize the indexer q into the ``indexer_q``
lease, store the indexer compressor's entries and compute logits + top-k.
``VLLM_DSV4_KERNEL=torch`` swaps ``flash_mla_with_kvcache_cpu`` for the
plugin's torch sparse MLA (for comparison); everything else stays vLLM's.

Every lease belongs to one :class:`vllm_dsv4_backend.eager.Region` per layer
and forward, released together on exit, exception or not.

The index tables vLLM's layer rebuilds in every layer depend only on the
step's positions and one KV cache group's metadata: the sliding-window slot
table, C128's and short-context C4's compressed slot tables, the compressors'
gather tables (:class:`DSV4Compressor`) and the short-context top-k rows
(:class:`DSV4Indexer`). The plugin builds each once per step and cache group
(:mod:`.cpu_tables`), with fewer ops and the same values, and every layer
reads it from there; the kernels get the same inputs.

The workspace bookkeeping (region, region holder, owner link, the model
step's start, the reservation) is :class:`.core.WorkspaceLayer`'s, shared
with the CUDA layer.

The methods whose bodies are vLLM's with only the buffers and the step's
tables changed are listed, with a fingerprint of vLLM's source, in the
layer's drift table :data:`VLLM_DRIFT`; :func:`layer_cls` checks them
(:mod:`vllm_dsv4_backend.vllm_compat.fingerprints`) when the layer is
installed.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import _custom_ops as vllm_ops
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.models.deepseek_v4.cpu import cpu_compressor as vllm_cpu_compressor
from vllm.models.deepseek_v4.cpu.cpu_compressor import DeepseekV4CPUCompressor
from vllm.models.deepseek_v4.cpu.cpu_sparse import (
    DeepseekV4CPUAttention,
    DeepseekV4CPUIndexer,
)
from vllm.utils.torch_utils import _encode_layer_name

from vllm_dsv4_backend import eager, envs, testing
from vllm_dsv4_backend.backend import DSV4FlashMLASparseBackend, DSV4SWABackend
from vllm_dsv4_backend.layer import core, cpu_tables
from vllm_dsv4_backend.layer.core import layer_kind
from vllm_dsv4_backend.ops import compressor as compressor_ops
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.vllm_compat import cpu_ops
from vllm_dsv4_backend.workspace import WorkspaceManager

logger = init_logger(__name__)

__all__ = ["VLLM_DRIFT", "DSV4CPUAttention", "layer_cls"]

# The drift table: vLLM functions whose body the plugin's override repeats
# with only the output buffers and the step's tables changed, or whose values
# a plugin function reproduces in fewer ops, one entry each: "module:qualname"
# -> (roles, {vLLM minor: fingerprint}) (roles and the check:
# vllm_compat/fingerprints.py). Checked by layer_cls() at install. Copying one
# more vLLM body = one more entry (`python -m
# vllm_dsv4_backend.vllm_compat.fingerprints --layer cpu` prints the values).
VLLM_DRIFT: dict[str, tuple[str, dict[str, str | None]]] = {
    "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention.forward":
        ("copied", {"0.32": "bad87d88271dd6de"}),
    "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention.forward_mqa":
        ("copied", {"0.32": "896634ba1fb6875f"}),
    "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention._sparse_indexer_and_attn":
        ("copied", {"0.32": "000c0a04b27111ae"}),
    "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention._o_proj":
        ("copied", {"0.32": "0790aa1a21f7f064"}),
    "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUIndexer.forward":
        ("copied", {"0.32": "00ccbabde569ae9a"}),
    "vllm.models.deepseek_v4.cpu.cpu_sparse:_fused_indexer_q_rope_quant_cpu":
        ("copied", {"0.32": "b0e50b53066c094b"}),
    "vllm.models.deepseek_v4.cpu.cpu_compressor:DeepseekV4CPUCompressor.forward":
        ("copied", {"0.32": "fdb4c92a793e7a23"}),
    "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUIndexer._fill_short_context_topk":
        ("copied", {"0.32": "3360905bf28beb17"}),
    "vllm.models.deepseek_v4.cpu.cpu_utils:map_local_to_global_slots_cpu":
        ("copied", {"0.32": "048fa28e5e24680a"}),
    "vllm.model_executor.layers.sparse_attn_indexer:SparseAttnIndexer.forward_cpu":
        ("copied", {"0.32": "bf2fb77b5fa5bdf2"}),
}

_ROPE_DIM = 64  # vLLM's cpu_sparse._ROPE_DIM: the rotated tail of each head
_logged_kinds: set[str] = set()


def workspace_manager_for(vllm_config: Any, layer: DSV4CPUAttention) -> WorkspaceManager:
    """The model's workspace manager (one per model per process,
    :func:`.core.manager_for`), created by its first attention layer; every
    layer registers itself before load ends."""
    return core.manager_for(vllm_config, layer, "cpu")


def _sparse_mla_path(kernel: str) -> str:
    """The layer's sparse-MLA path for ``VLLM_DSV4_KERNEL``: ``"torch"`` (the
    plugin's), or ``"vllm_cpu"`` (the op vLLM's layer calls: the real C++
    kernel, or the plugin's registered fallback where the library lacks it)."""
    if kernel == "torch":
        return "torch"
    if kernel == "vllm_cpu" and cpu_ops.is_fallback("flash_mla_with_kvcache_cpu"):
        raise RuntimeError(
            "VLLM_DSV4_KERNEL=vllm_cpu, but vLLM's C++ flash_mla_with_kvcache_cpu is not "
            "loaded on this CPU (it exists only in vLLM's AVX512-BF16/AMX library; the "
            "plugin registered its torch fallback); use auto or torch"
        )
    return "vllm_cpu"


class DSV4Compressor(DeepseekV4CPUCompressor):
    """vLLM's CPU compressor (``DeepseekV4CPUCompressor.forward``: the same ops
    on the same arguments, in its order) with two changes:

    * its gather table (each token's compression window as global state-cache
      slots) is one of the step's tables: it depends only on the step's
      positions, the window and the state cache group's metadata, so the
      group's first layer builds it and its other layers reuse it (vLLM
      builds it in every compressor), in fewer ops with the same int64 values;
    * an MXFP4 indexer cache stores with the plugin's 68 B writer, because
      vLLM's ``compress_norm_rope_store_indexer_cpu`` writes only the FP8
      (132 B) layout.

    The ops are looked up in vLLM's module at call time, as vLLM's body does.
    """

    # Set by DSV4CPUAttention (plain attributes, with object.__setattr__).
    _dsv4_tables: cpu_tables.StepTables
    _dsv4_mxfp4_store: bool

    def forward(self, kv_score: torch.Tensor, positions: torch.Tensor, rotary_emb) -> None:
        kv, score = kv_score.split(
            [self.coff * self.head_dim, self.coff * self.head_dim], dim=-1
        )
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return
        state_md = attn_metadata[self.state_cache.prefix]
        state_cache = self.state_cache.kv_cache
        ops = vllm_cpu_compressor
        ops.save_partial_states_cpu(
            kv, score, self.ape, positions, state_cache, state_md.slot_mapping
        )
        k_cache_md = attn_metadata[self.k_cache_prefix]
        kv_cache = self._static_forward_context[self.k_cache_prefix].kv_cache
        window = (1 + self.overlap) * self.compress_ratio
        gather_slots = self._dsv4_tables.get(
            f"gather{window}", state_md, positions,
            lambda: cpu_tables.gather_slots(self, state_md, positions, window),
        )
        if self.head_dim == 512:
            store = ops.compress_norm_rope_store_cpu
        elif self._dsv4_mxfp4_store:
            store = _mxfp4_indexer_store
        else:
            store = ops.compress_norm_rope_store_indexer_cpu
        store(
            state_cache,
            gather_slots,
            positions,
            k_cache_md.slot_mapping,
            self._norm_weight_fp32,
            self.rms_norm_eps,
            rotary_emb.cos_sin_cache,
            kv_cache.view(kv_cache.shape[0], -1),
            kv_cache.shape[1],
            self.compress_ratio,
        )


def _mxfp4_indexer_store(*args: Any) -> None:
    compressor_ops.compress_norm_rope_store_indexer(*args, indexer_kv_dtype="mxfp4")


class DSV4Indexer(DeepseekV4CPUIndexer):
    """vLLM's CPU indexer with its quantized q written into the layer region's
    ``indexer_q`` lease (FP8: vLLM's ``fused_indexer_q_rope_quant_cpu``;
    MXFP4: the plugin's torch quantizer). Everything else is vLLM's
    ``forward``: the short-context fill of vLLM's top-k buffer, the order
    q-quant then compressor. Its layer (:func:`.core.owner_of`) holds the
    region and the indexer cache dtype."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        qr: torch.Tensor,
        compressed_kv_score: torch.Tensor | None,
        indexer_weights: torch.Tensor,
        positions: torch.Tensor,
        rotary_emb: Any,
        qr_scale: torch.Tensor | None = None,
        skip_compressor: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        attn_metadata = get_forward_context().attn_metadata
        if isinstance(attn_metadata, dict):
            md = attn_metadata[self.k_cache.prefix]
            if cpu_tables.short_context(md, self.compress_ratio, self.topk_tokens):
                self.compressor(compressed_kv_score, positions, rotary_emb)
                num_tokens = md.num_decode_tokens + md.num_prefill_tokens
                if num_tokens > 0:
                    self._fill_short_context_topk(positions, num_tokens)
                return None, None, None

        owner = core.owner_of(self)
        lease = owner._dsv4_current_region().lease("indexer_q")
        num_tokens = positions.shape[0]
        q = self._wq_b_proj(qr, qr_scale).view(-1, self.n_head, self.head_dim)
        if owner.indexer_kv_dtype == "fp8":
            q_out, w_out = lease["q"][:num_tokens], lease["weights"][:num_tokens]
            torch.ops._C.fused_indexer_q_rope_quant_cpu(
                positions,
                q.to(torch.float32),
                rotary_emb.cos_sin_cache,
                q_out,
                indexer_weights.to(torch.float32),
                self.softmax_scale,
                self.n_head**-0.5,
                w_out,
            )
            q_scale = None
        else:
            out = indexer_ops.indexer_q_rope_quant(
                q[:num_tokens],
                positions[:num_tokens],
                rotary_emb.cos_sin_cache,
                indexer_weights[:num_tokens],
                softmax_scale=self.softmax_scale,
                head_scale=self.n_head**-0.5,
                dtype="mxfp4",
                out=(lease["q"], lease["scales"], lease["weights"]),
            )
            q_out, q_scale, w_out = out.q, out.q_scale, out.weights
        self.compressor(compressed_kv_score, positions, rotary_emb)
        return q_out, q_scale, w_out

    def _fill_short_context_topk(self, positions: torch.Tensor, num_tokens: int) -> None:
        """vLLM's fill of the model-wide top-k buffer with every visible entry
        (``-1`` past ``(p + 1) // compress_ratio``). The rows depend only on the
        step's positions, so they are one of the step's tables: built by the
        step's first C4 layer, copied in by every C4 layer (each still writes
        the buffer, as vLLM's does)."""
        md = get_forward_context().attn_metadata[self.k_cache.prefix]
        rows = core.owner_of(self)._tables.get(
            "c4_fill", md, positions, lambda: cpu_tables.visible_rows(self, positions, num_tokens)
        )
        self.topk_indices_buffer[:num_tokens, : self.topk_tokens] = rows


class DSV4CPUAttention(DeepseekV4CPUAttention, core.WorkspaceLayer):
    """DeepSeek-V4 attention served by the plugin (CPU build of vLLM 0.32); the
    workspace bookkeeping is :class:`.core.WorkspaceLayer`'s."""

    backend_cls = DSV4FlashMLASparseBackend
    swa_backend_cls = DSV4SWABackend

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        # As asked (not clamped): an indexer dtype the backend cannot serve is
        # refused here, naming it; once accepted it is the workspace's
        # (self.indexer_kv_dtype).
        reasons = DSV4FlashMLASparseBackend.unsupported_reasons(
            head_size=self.head_dim,
            dtype=vllm_config.model_config.dtype,
            kv_cache_dtype=vllm_config.cache_config.cache_dtype,
            indexer_kv_dtype=core.indexer_kv_dtype(vllm_config),
        )
        if reasons:
            raise ValueError(
                "FLASHMLA_SPARSE_DSV4 (vllm_dsv4_backend) cannot serve this model: "
                + "; ".join(reasons)
            )
        self.layer_kind = layer_kind(self.compress_ratio)
        workspace = workspace_manager_for(vllm_config, self)
        self._tables = cpu_tables.tables_for(workspace)
        # The model's first attention layer begins each step: the step tables clear.
        self._dsv4_attach_workspace(workspace, "CPU", on_step=self._tables.clear)
        if self.indexer is not None:
            self._dsv4_adopt(self.indexer, DSV4Indexer)
        for compressor in (self.compressor, getattr(self.indexer, "compressor", None)):
            if compressor is not None:
                compressor.__class__ = DSV4Compressor
                object.__setattr__(compressor, "_dsv4_tables", self._tables)
                object.__setattr__(compressor, "_dsv4_mxfp4_store",
                                   compressor is not self.compressor
                                   and self.indexer_kv_dtype == "mxfp4")
        self.index_topk = int(vllm_config.model_config.hf_config.index_topk)
        # "torch" forces the plugin's torch sparse MLA; anything else calls
        # the op vLLM's layer calls (the real C++ kernel, or its registered
        # fallback on CPUs without AVX512-BF16).
        self._sparse_mla = _sparse_mla_path(envs.VLLM_DSV4_KERNEL)
        self._path_logged = False
        # Resolved once: the forward path reads no setting and imports nothing.
        self._layer_name_arg = _encode_layer_name(self.prefix)
        self._markers = envs.VLLM_DSV4_MARKER_DIR is not None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        # All layers exist by now: reserve once, before vLLM profiles memory;
        # private (a set of buffers per layer) is refused here, with the
        # alternatives, when it exceeds the memory available now.
        self._dsv4_reserve()
        testing.after_layer_loaded(self)

    # --- the eager region ------------------------------------------------------------

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        llama_4_scaling: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # vLLM's forward, with o_padded leased instead of a torch.empty per
        # layer and step.
        num_tokens = hidden_states.shape[0]
        with self.dsv4_region(num_tokens) as region:
            try:
                o_padded = region.lease("q")["out"]
                qr_kv = self._fused_wqa_wkv_gemm(hidden_states)
                kv_score = None
                if self.compressor is not None:
                    kv_score = self.compressor.fused_wkv_wgate(hidden_states).to(torch.float32)
                    if self.compress_ratio == 4:
                        testing.note_compressor_scratch(kv_score)  # test only; off: returns
                indexer_weights = indexer_kv_score = None
                if self.indexer is not None:
                    indexer_weights, _ = self.indexer.weights_proj(hidden_states)
                    indexer_kv_score = self.indexer.compressor.fused_wkv_wgate(
                        hidden_states
                    ).to(torch.float32)
                qr, qr_scale, kv = self._split_qkv_and_norm(qr_kv)
                return torch.ops.vllm.deepseek_v4_cpu_prepare_and_attn(
                    hidden_states,
                    qr,
                    kv,
                    qr_scale,
                    kv_score,
                    indexer_kv_score,
                    indexer_weights,
                    positions,
                    o_padded,
                    self._layer_name_arg,
                )
            finally:
                if self._markers:
                    testing.after_layer_forward(self, self._workspace)

    def _sparse_indexer_and_attn(
        self,
        hidden_states: torch.Tensor,
        index_q: torch.Tensor | None,
        index_q_scale: torch.Tensor | None,
        index_weights: torch.Tensor | None,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        if self.indexer is not None and index_q is not None:
            assert index_weights is not None
            # A step without metadata (an idle data-parallel rank's dummy step, run
            # to keep the MoE collectives in step, or a profile run) selects
            # nothing: vLLM's SparseAttnIndexer.forward_cpu returns at once there.
            if not isinstance(get_forward_context().attn_metadata, dict):
                pass
            elif self.indexer_kv_dtype == "fp8":
                self._indexer_topk_fp8(index_q, index_weights, hidden_states.shape[0])
            else:
                self._indexer_topk_mxfp4(index_q, index_q_scale, index_weights, positions)
            # The indexer q's last consumer has run.
            self._dsv4_current_region().release("indexer_q")
        if self.compress_ratio == 4:
            # Test only (the oracle's negative controls); returns at once when off.
            n = q.shape[0]
            testing.oracle_fault_topk(self.topk_indices_buffer[:n, : self.index_topk],
                                      positions[:n], self.compress_ratio)
        self.forward_mqa(q, kv, positions, out)
        if not self._path_logged:
            self._log_path()

    def _indexer_topk_fp8(
        self, q_fp8: torch.Tensor, weights: torch.Tensor, num_rows: int
    ) -> None:
        """vLLM's ``SparseAttnIndexer.forward_cpu`` (same kernels, same
        arguments) with the page ids ``topk_transform_512_cpu`` must write
        going into the region's ``topk.global`` instead of a fresh buffer."""
        indexer = self.indexer
        md = get_forward_context().attn_metadata[indexer.k_cache.prefix]
        kv_cache = indexer.k_cache.kv_cache
        kv_view = kv_cache.view(kv_cache.shape[0], -1)
        block_size = kv_cache.shape[1]
        topk_tokens = indexer.topk_tokens
        buf = indexer.topk_indices_buffer
        page_scratch = self._dsv4_current_region().lease("topk")["global"]
        buf[:num_rows] = -1
        if md.num_prefills > 0:
            if topk_tokens != 512:
                raise ValueError(
                    f"topk_transform_512_cpu only supports index_topk == 512, got {topk_tokens}"
                )
            chunk = md.prefill.chunks[0]
            if len(md.prefill.chunks) != 1:
                raise RuntimeError("the CPU indexer builder must produce one prefill chunk")
            topk = buf[chunk.token_start : chunk.token_end, :topk_tokens]
            if chunk.local_total_seq_lens == 0:
                topk.fill_(-1)
            else:
                local_seq_lens = chunk.cu_seqlen_ke - chunk.cu_seqlen_ks
                req_idx = torch.searchsorted(chunk.local_cu_seq_lens, chunk.cu_seqlen_ks,
                                             right=True) - 1
                page_table = chunk.block_table[req_idx]
                logits = torch.ops._C.fp8_paged_mqa_logits_cpu(
                    q_fp8[chunk.token_start : chunk.token_end],
                    kv_view,
                    weights[chunk.token_start : chunk.token_end],
                    local_seq_lens,
                    page_table,
                    block_size,
                    int(local_seq_lens.max().item()),
                )
                torch.ops._C.topk_transform_512_cpu(
                    logits, local_seq_lens, page_table,
                    page_scratch[: chunk.token_end - chunk.token_start], block_size, topk,
                )
        if md.num_decodes > 0:
            dmd = md.decode
            if dmd.requires_padding:
                raise NotImplementedError(
                    "the CPU indexer decode path does not support speculative decoding"
                )
            batch = dmd.decode_lens.shape[0]
            if batch > 0:
                if md.num_decode_tokens != batch:
                    raise RuntimeError("CPU indexer decode expects one query token per request")
                seq_lens = dmd.seq_lens
                seq_lens = seq_lens[:, -1].contiguous() if seq_lens.ndim == 2 else seq_lens
                block_table = dmd.block_table[:batch]
                logits = torch.ops._C.fp8_paged_mqa_logits_cpu(
                    q_fp8[: md.num_decode_tokens], kv_view, weights[: md.num_decode_tokens],
                    seq_lens, block_table, block_size, md.max_seq_len,
                )
                torch.ops._C.topk_transform_512_cpu(
                    logits, seq_lens, block_table, page_scratch[:batch], block_size,
                    buf[: md.num_decode_tokens, :topk_tokens],
                )

    def _indexer_topk_mxfp4(
        self,
        index_q: torch.Tensor,
        index_q_scale: torch.Tensor | None,
        index_weights: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """MXFP4 indexer cache (no vLLM CPU op): the plugin's torch logits and
        causal top-k, written into vLLM's top-k buffer as local entry ids like
        the FP8 path, so ``forward_mqa`` maps them the same way."""
        attn_metadata = get_forward_context().attn_metadata
        indexer = self.indexer
        swa_md = attn_metadata[self.swa_cache_layer.prefix]
        flash_md = attn_metadata[self.prefix]
        ind_md = attn_metadata[indexer.k_cache.prefix]
        num_tokens = ind_md.num_decode_tokens + ind_md.num_prefill_tokens
        topk = self._dsv4_current_region().lease("topk")
        eager.select_topk_c4(
            positions=positions[:num_tokens],
            token_to_req=swa_md.token_to_req_indices[:num_tokens],
            compressed_block_table=flash_md.block_table,
            entries_per_block=flash_md.block_size // self.compress_ratio,
            index_topk=self.index_topk,
            out_local=indexer.topk_indices_buffer[:num_tokens, : self.index_topk],
            out_global=topk["global"][:num_tokens],
            out_lens=topk["lens"][:num_tokens],
            arange=None,
            minus_one=None,
            index_q=index_q,
            index_q_scale=index_q_scale,
            index_weights=index_weights,
            indexer_k_cache=indexer.k_cache.kv_cache,
            indexer_block_table=ind_md.block_table,
            indexer_kv_dtype="mxfp4",
            max_compressed=ind_md.max_seq_len // self.compress_ratio,
        )

    def forward_mqa(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        # vLLM's forward_mqa: the same slot tables, then its sparse MLA op
        # (or, with VLLM_DSV4_KERNEL=torch, the plugin's) into the lease.
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            output.zero_()
            return
        swa_md = attn_metadata.get(self.swa_cache_layer.prefix)
        tables = self._tables
        # The window table and C128's "every visible entry" table depend only on
        # the step's positions and the layer's cache group: built by the group's
        # first layer, reused by its others (vLLM builds them in every layer).
        window_slots = tables.get(
            "window", swa_md, positions, lambda: cpu_tables.window_slots(self, swa_md, positions)
        )
        # Test only (a negative control: a stale read); the same table when off.
        window_slots = testing.oracle_fault_window(window_slots, positions,
                                                   swa_md.token_to_req_indices)
        swa_cache = self.swa_cache_layer.kv_cache
        window_cache_2d = swa_cache.view(swa_cache.shape[0], -1)
        if self.compress_ratio <= 1:
            compressed_slots = tables.get(
                "none", swa_md, positions, lambda: window_slots.new_full((q.shape[0], 0), -1)
            )
            compressed_cache_2d = window_cache_2d
            compressed_block_size = 1
        else:
            flash_md = attn_metadata.get(self.prefix)
            compressed_block_size = flash_md.block_size // self.compress_ratio
            if self.compress_ratio == 4:
                def c4_slots() -> torch.Tensor:
                    return cpu_tables.map_slots(
                        self.topk_indices_buffer[: q.shape[0]], swa_md.token_to_req_indices,
                        flash_md.block_table, compressed_block_size,
                    )

                # Short context: the indexer filled the model-wide top-k buffer
                # with "every visible entry", the same for every C4 layer of
                # the step, so the mapped table is shared like the others.
                ind_md = attn_metadata[self.indexer.k_cache.prefix]
                short = cpu_tables.short_context(ind_md, self.compress_ratio,
                                                 self.indexer.topk_tokens)
                compressed_slots = (
                    tables.get("c4_short", flash_md, positions, c4_slots)
                    if short else c4_slots()
                )
            else:
                compressed_slots = tables.get(
                    f"c{self.compress_ratio}", flash_md, positions,
                    lambda: cpu_tables.dense_compressed_slots(self, swa_md, flash_md, positions),
                )
            compressed_cache_2d = self.kv_cache.view(self.kv_cache.shape[0], -1)

        # VLLM_DSV4_KERNEL=torch: the plugin's torch sparse MLA with the C++ op's
        # call convention (the fallback cpu_ops registers where the op is missing).
        sparse_mla = (cpu_ops.flash_mla_with_kvcache_cpu if self._sparse_mla == "torch"
                      else torch.ops._C.flash_mla_with_kvcache_cpu)
        sparse_mla(
            output,
            q,
            window_cache_2d,
            window_slots,
            swa_md.block_size,
            compressed_cache_2d,
            compressed_slots,
            compressed_block_size,
            self.attn_sink,
            self.scale,
        )

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """vLLM's ``_o_proj`` (inverse RoPE, grouped ``wo_a`` bmm, ``wo_b``)
        with its three hand-over buffers in memory the step already holds:
        the group-major bf16 ``wo_a`` input and then ``wo_b``'s token-major
        input in the ``q.out`` lease (free once the inverse RoPE has read
        ``o``), the bmm output in the fp32 inverse-RoPE result (dead once
        copied). The same casts and copies in the same order: the same bytes.
        Where vLLM's ``flatten`` is a view (one token), so is the plugin's."""
        region = self._dsv4_current_region()
        num_tokens, num_heads, head_dim = o.shape
        groups, rank = self.n_local_groups, self.o_lora_rank
        if not region or get_forward_context().attn_metadata is None:
            return super()._o_proj(o, positions)  # dummy / profile run: nothing leased
        if o.dtype != torch.bfloat16 or groups * rank > num_heads * head_dim:
            # Hand-over buffers the q.out lease cannot hold: vLLM allocates them.
            self._workspace.count_fallback(self.prefix, "q")
            return super()._o_proj(o, positions)
        o_derot = vllm_ops.inverse_gptj_rope_o_proj_cpu(
            o, positions, self.rotary_emb.cos_sin_cache, _ROPE_DIM
        )
        width = num_heads // groups * head_dim
        scratch = region.lease("q")["out"].view(-1)
        x = scratch[: groups * num_tokens * width].view(groups, num_tokens, width)
        x.copy_(o_derot.view(num_tokens, groups, width).transpose(0, 1))
        z = o_derot.view(-1).view(torch.bfloat16)[: groups * num_tokens * rank]
        z = z.view(groups, num_tokens, rank)
        assert self._wo_a_packed is not None
        vllm_ops.bmm_cpu(z, x, self._wo_a_packed, True, None)
        z_tokens = z.transpose(0, 1)
        # One token (or one group): the token-major view is already contiguous
        # and vLLM's flatten copies nothing either.
        if not z_tokens.is_contiguous():
            z_tokens = scratch[: num_tokens * groups * rank].view(
                num_tokens, groups, rank).copy_(z_tokens)
        return self.wo_b(z_tokens.reshape(num_tokens, groups * rank))

    def _log_path(self) -> None:
        self._path_logged = True
        kind = self.layer_kind
        if self._sparse_mla == "torch":
            path = "torch"
        elif cpu_ops.is_fallback("flash_mla_with_kvcache_cpu"):
            path = "vllm_cpu (plugin's torch fallback: no AVX512-BF16 library)"
        else:
            path = "vllm_cpu"
        testing.record_layer(self, kind, path)
        if kind in _logged_kinds:
            return
        _logged_kinds.add(kind)
        logger.info(
            "vllm_dsv4_backend: %s layers run sparse MLA on the %s kernel path, workspace "
            "policy %s, indexer cache %s",
            kind,
            path,
            self._workspace.policy,
            self.indexer_kv_dtype if self.indexer is not None else "-",
        )


def layer_cls() -> type:
    """The CPU layer, after checking that the vLLM bodies it repeats are the
    ones it was written against and lifting vLLM's MXFP4 architecture check."""
    import vllm

    from vllm_dsv4_backend.vllm_compat import fingerprints, patches

    minor = ".".join(str(vllm.__version__).split(".")[:2])
    fingerprints.check(VLLM_DRIFT, minor)
    patches.apply("mxfp4_indexer_cache")
    return DSV4CPUAttention
