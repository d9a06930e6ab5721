# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's DeepSeek-V4 attention layer: vLLM's layer with the eager
region rebuilt on :mod:`vllm_dsv4_backend.ops` and the per-layer workspace.

What the plugin owns, per step and layer (everything between the model's
projections and its output projection):

- the attention output buffer (workspace family ``q``, the padded
  ``[T, Hp, 512]`` bf16 rows vLLM allocated per layer and step),
- C4 layers: the lightning indexer's q RoPE + quantization (fp8 or MXFP4,
  family ``indexer_q``), its logits over the indexer K cache and the causal
  top-k, the local -> global slot mapping (family ``topk``), and, for the
  MXFP4 indexer cache, the indexer compressor's cache store (vLLM's CPU
  kernels only write the FP8 layout),
- sparse MLA over the SWA window + compressed entries, one softmax with the
  sink, through ``ops.sparse_mla_decode`` (FlashMLA, vLLM's C++ CPU kernel or
  the torch path; ``VLLM_DSV4_KERNEL`` forces one).

What stays vLLM's: the projections, q/kv norm + RoPE + SWA-cache insert
(``fused_qnorm_rope_kv_insert_cpu``), the main compressor, the output
projection and the MoE. Window and C128 slot tables come once per step from
the plugin's metadata builders (:mod:`vllm_dsv4_backend.backend`).

Prefill and decode tokens take the same path: every token's window and
compressed entries are already in the paged caches when attention runs
(vLLM's CPU layer does the same), so no bf16 gather of the KV is needed.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.models.deepseek_v4.cpu.cpu_compressor import DeepseekV4CPUCompressor
from vllm.models.deepseek_v4.cpu.cpu_sparse import (
    DeepseekV4CPUAttention,
    DeepseekV4CPUIndexer,
)
from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu
from vllm.utils.math_utils import cdiv
from vllm.utils.math_utils import round_up as _round_up

from vllm_dsv4_backend import eager, envs, ops
from vllm_dsv4_backend.backend import (
    DSV4FlashMLASparseBackend,
    DSV4SWABackend,
)
from vllm_dsv4_backend.ops import compressor as compressor_ops
from vllm_dsv4_backend.ops import indexer as indexer_ops
from vllm_dsv4_backend.ops import rope as rope_ops
from vllm_dsv4_backend.workspace import WorkspaceConfig, WorkspaceManager

logger = init_logger(__name__)

# Test-only: shift layer 0's attention sink by this much after loading, the
# negative control of the parity test (a comparison that cannot fail proves
# nothing). Read once per process; unset in production.
PERTURB_SINK_ENV = "VLLM_DSV4_TEST_PERTURB_SINK"

_managers: dict[int, WorkspaceManager] = {}
_scratches: dict[int, torch.Tensor] = {}
_managers_lock = threading.Lock()
_logged_kinds: set[str] = set()
_marked: set[str] = set()


def _layer_kind(ratio: int) -> str:
    return {1: "swa", 4: "c4", 128: "c128"}.get(ratio, f"c{ratio}")


def _ubatch_id() -> int:
    try:
        from vllm.v1.worker.ubatching import dbo_current_ubatch_id
    except ImportError:
        return 0
    return int(dbo_current_ubatch_id())


def _num_ubatches(vllm_config: Any) -> int:
    return 2 if getattr(vllm_config.parallel_config, "use_ubatching", False) else 1


def workspace_manager_for(vllm_config: Any, layer: DSV4CPUAttention) -> WorkspaceManager:
    """The model's workspace manager (one per model per process), created by
    its first attention layer; every layer registers itself before load ends."""
    key = id(vllm_config)
    with _managers_lock:
        manager = _managers.get(key)
        if manager is None:
            config = WorkspaceConfig.from_hf_config(
                vllm_config.model_config.hf_config,
                max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                indexer_kv_dtype=layer.indexer_kv_dtype,
                num_ubatches=_num_ubatches(vllm_config),
                padded_heads=layer.padded_heads,
                # The attention output lives in the workspace too (vLLM
                # allocated it per layer and step).
                include_attn_out=True,
            )
            no_fences = envs.VLLM_DSV4_TEST_UNSAFE_NO_FENCES
            if no_fences:
                logger.warning("VLLM_DSV4_TEST_UNSAFE_NO_FENCES=1: the workspace skips its "
                               "cross-stream fences (test only)")
            manager = WorkspaceManager(
                config, layers=[], device=vllm_config.device_config.device,
                _unsafe_disable_fences_for_tests=no_fences,
            )
            _managers[key] = manager
        return manager


def _write_marker(kind: str, layer: DSV4CPUAttention, path: str) -> None:
    """With VLLM_DSV4_MARKER_DIR set, record from inside the process that the
    plugin's layer really ran (the registration tests read it)."""
    marker_dir = envs.VLLM_DSV4_MARKER_DIR
    if marker_dir is None or kind in _marked:
        return
    _marked.add(kind)
    # A subdirectory: the plugin's per-process markers live in marker_dir itself.
    marker_dir = os.path.join(marker_dir, "layers")
    os.makedirs(marker_dir, exist_ok=True)
    import multiprocessing

    record = {
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "layer_kind": kind,
        "layer_cls": type(layer).__qualname__,
        "backend": layer.backend_cls.get_name(),
        "kernel_path": path,
        "workspace_policy": layer._workspace.policy,
        "indexer_kv_dtype": layer.indexer_kv_dtype,
    }
    with open(os.path.join(marker_dir, f"layer-{kind}-{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


_WORKSPACE_MARKER_KEYS = (
    "policy", "fences_enabled", "num_layers", "reserved_bytes_total", "leases_total",
    "fence_waits_total", "allocations_total", "peak_leased_bytes",
)
_forwards = 0


def _write_workspace_marker(manager: WorkspaceManager, marker_dir: str) -> None:
    """Rewrite this process's workspace counters under VLLM_DSV4_MARKER_DIR (tests only;
    called after every layer forward, the load test reads them before and after its
    traffic)."""
    global _forwards
    _forwards += 1
    stats = manager.stats()
    record = {k: stats[k] for k in _WORKSPACE_MARKER_KEYS}
    record.update(pid=os.getpid(), forwards=_forwards)
    marker_dir = os.path.join(marker_dir, "layers")
    os.makedirs(marker_dir, exist_ok=True)
    path = os.path.join(marker_dir, f"workspace-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


class DSV4Compressor(DeepseekV4CPUCompressor):
    """vLLM's compressor with the state update and cache store in torch.

    Main branch (head dim 512): the 584 B fp8_ds_mla store. Indexer branch
    (head dim 128): the FP8 (132 B) or MXFP4 (68 B) indexer cache, which
    vLLM's CPU kernels cannot write (FP8 only, and only on AVX-512 builds).
    """

    _dsv4_indexer_dtype: str = "fp8"

    def forward(self, kv_score: torch.Tensor, positions: torch.Tensor, rotary_emb) -> None:
        from vllm.models.deepseek_v4.compressor import CompressorMetadata

        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return
        kv, score = kv_score.split([self.coff * self.head_dim, self.coff * self.head_dim], dim=-1)
        state_md = attn_metadata[self.state_cache.prefix]
        assert isinstance(state_md, CompressorMetadata)
        slot_mapping = state_md.slot_mapping
        num_actual = slot_mapping.shape[0]
        state_cache = self.state_cache.kv_cache
        pos = positions[:num_actual]
        compressor_ops.save_partial_states(
            kv[:num_actual], score[:num_actual], self.ape, pos, state_cache, slot_mapping
        )
        window = (1 + self.overlap) * self.compress_ratio
        win_local = pos.unsqueeze(-1) - window + 1 + torch.arange(window, device=pos.device)
        gather_slots = map_local_to_global_slots_cpu(
            win_local,
            state_md.token_to_req_indices[:num_actual],
            state_md.block_table,
            state_md.block_size,
        )
        k_cache = self._static_forward_context[self.k_cache_prefix].kv_cache
        args = (
            state_cache,
            gather_slots,
            pos,
            attn_metadata[self.k_cache_prefix].slot_mapping,
            self._norm_weight_fp32,
            self.rms_norm_eps,
            rotary_emb.cos_sin_cache,
            k_cache.view(k_cache.shape[0], -1),
            k_cache.shape[1],
            self.compress_ratio,
        )
        if self.head_dim == 512:
            compressor_ops.compress_norm_rope_store_main(*args)
        else:
            compressor_ops.compress_norm_rope_store_indexer(
                *args, indexer_kv_dtype=self._dsv4_indexer_dtype
            )


class DSV4Indexer(DeepseekV4CPUIndexer):
    """The lightning indexer's q side on the plugin's ops and workspace.

    ``forward`` runs the indexer compressor (writing the indexer K cache),
    then RoPE + quantizes q into the layer's ``indexer_q`` lease. The logits
    and top-k run in the attention layer, which releases the lease.
    Returns ``(q, q_scale, weights)`` views of the lease, or ``None``s when
    every visible entry is selected anyway (vLLM's short-context rule).
    """

    # Set by DSV4CPUAttention (plain attributes: the indexer must not
    # register its parent as a submodule).
    _dsv4_dtype: str
    _dsv4_lease: Any = None

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
        self.compressor(compressed_kv_score, positions, rotary_emb)
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return None, None, None
        md = attn_metadata[self.k_cache.prefix]
        if md.max_seq_len // self.compress_ratio <= self.topk_tokens:
            return None, None, None
        num_tokens = md.num_decode_tokens + md.num_prefill_tokens
        lease = self._dsv4_workspace.lease(self._dsv4_layer, "indexer_q", num_tokens,
                                           ubatch=_ubatch_id())
        self._dsv4_lease = lease
        q = self._wq_b_proj(qr, qr_scale).view(-1, self.n_head, self.head_dim)
        fp4 = self._dsv4_dtype == "mxfp4"
        out = indexer_ops.indexer_q_rope_quant(
            q[:num_tokens],
            positions[:num_tokens],
            rotary_emb.cos_sin_cache,
            indexer_weights[:num_tokens],
            softmax_scale=self.softmax_scale,
            head_scale=self.n_head**-0.5,
            dtype=self._dsv4_dtype,
            out=(lease["q"], lease["scales"] if fp4 else None, lease["weights"]),
        )
        return out.q, out.q_scale, out.weights


class DSV4CPUAttention(DeepseekV4CPUAttention):
    """DeepSeek-V4 attention served by the plugin (CPU build of vLLM 0.32)."""

    backend_cls = DSV4FlashMLASparseBackend
    swa_backend_cls = DSV4SWABackend

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        attn_cfg = vllm_config.attention_config
        self.indexer_kv_dtype = attn_cfg.resolve_indexer_kv_dtype("fp8")
        reasons = DSV4FlashMLASparseBackend.unsupported_reasons(
            head_size=self.head_dim,
            dtype=vllm_config.model_config.dtype,
            kv_cache_dtype=vllm_config.cache_config.cache_dtype,
            indexer_kv_dtype=self.indexer_kv_dtype,
        )
        if reasons:
            raise ValueError(
                "FLASHMLA_SPARSE_DSV4 (vllm_dsv4_backend) cannot serve this model: "
                + "; ".join(reasons)
            )
        self.layer_kind = _layer_kind(self.compress_ratio)
        self._workspace = workspace_manager_for(vllm_config, self)
        self._workspace.add_layer(self.prefix, self.compress_ratio)
        if self.indexer is not None:
            self.indexer.__class__ = DSV4Indexer
            self.indexer._dsv4_dtype = self.indexer_kv_dtype
            self.indexer._dsv4_layer = self.prefix
            self.indexer._dsv4_workspace = self._workspace
            self.indexer.compressor.__class__ = DSV4Compressor
            self.indexer.compressor._dsv4_indexer_dtype = self.indexer_kv_dtype
        if self.compressor is not None:
            self.compressor.__class__ = DSV4Compressor
        self.index_topk = int(vllm_config.model_config.hf_config.index_topk)
        self._topk_arange = torch.arange(
            self.index_topk if self.indexer is not None else 1,
            dtype=torch.int32,
            device=vllm_config.device_config.device,
        )
        self._minus_one = torch.tensor(-1, dtype=torch.int32,
                                       device=vllm_config.device_config.device)
        self._kernel_path: str | None = None
        # Read once: the per-forward counters file exists only for tests.
        self._marker_dir = envs.VLLM_DSV4_MARKER_DIR

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        # All layers exist by now: reserve once, before vLLM profiles memory.
        if not self._workspace.reserved:
            self._workspace.reserve()
            self._reserve_attention_scratch()
            stats = self._workspace.stats()
            logger.info(
                "vllm_dsv4_backend workspace: policy %s, %.1f MiB reserved for %d layers",
                self._workspace.policy,
                stats.get("reserved_bytes_total", 0) / 2**20,
                len(self._workspace.layers),
            )
        delta = os.environ.get(PERTURB_SINK_ENV)
        if delta and self.prefix.endswith("layers.0.attn"):
            logger.warning("%s=%s: shifting %s's sink (test only)", PERTURB_SINK_ENV,
                           delta, self.prefix)
            self.attn_sink.data += float(delta)

    def _reserve_attention_scratch(self) -> None:
        """One uint8 scratch for the torch sparse-MLA path, shared by the
        model's layers (they run one after another on one stream), sized for
        the widest row at max_num_batched_tokens and reserved with the
        workspace so a step allocates nothing."""
        cfg = self._workspace.config
        widest_compressed = max(self.index_topk, cdiv(self.max_model_len, 128))
        nbytes = ops.decode_scratch_nbytes(
            cfg.max_num_batched_tokens, 1, self.padded_heads, self.window_size,
            _round_up(widest_compressed, 128),
        )
        _scratches[id(self._workspace)] = torch.empty(
            nbytes, dtype=torch.uint8, device=self.attn_sink.device
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        llama_4_scaling: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Same as vLLM's CPU forward, with o_padded leased from the workspace
        # instead of a fresh torch.empty per layer and step.
        num_tokens = hidden_states.shape[0]
        lease = self._workspace.lease(self.prefix, "q", num_tokens, ubatch=_ubatch_id())
        self._q_lease = lease
        try:
            o_padded = lease["out"]
            qr_kv = self._fused_wqa_wkv_gemm(hidden_states)
            kv_score = None
            if self.compressor is not None:
                kv_score = self.compressor.fused_wkv_wgate(hidden_states).to(torch.float32)
            indexer_weights = indexer_kv_score = None
            if self.indexer is not None:
                indexer_weights, _ = self.indexer.weights_proj(hidden_states)
                indexer_kv_score = self.indexer.compressor.fused_wkv_wgate(hidden_states).to(
                    torch.float32
                )
            qr, qr_scale, kv = self._split_qkv_and_norm(qr_kv)
            from vllm.utils.torch_utils import _encode_layer_name

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
                _encode_layer_name(self.prefix),
            )
        finally:
            self._q_lease = None
            lease.release()
            if self._marker_dir is not None:
                _write_workspace_marker(self._workspace, self._marker_dir)

    def _fused_qnorm_rope_kv_insert(
        self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        if not isinstance(attn_metadata, dict):
            return super()._fused_qnorm_rope_kv_insert(q, kv, positions, attn_metadata)
        swa_md = attn_metadata[self.swa_cache_layer.prefix]
        return rope_ops.qnorm_rope_kv_insert(
            q,
            kv,
            positions,
            eager.block_view(self.swa_cache_layer.kv_cache, swa_md.block_size),
            swa_md.slot_mapping,
            self.rotary_emb.cos_sin_cache,
            self.eps,
            out_q=self._q_lease["q"],
        )

    def _wrap_wo_a_process_weights_after_loading(self) -> None:
        # vLLM packs wo_a for its C++ bmm (absent from non-AVX-512 builds);
        # we keep a dense [groups, o_lora_rank, k] copy for torch.
        wo_a = self.wo_a
        quant_method = wo_a.quant_method
        orig_pwal = quant_method.process_weights_after_loading
        k_dim = self.n_local_heads // self.n_local_groups * self.head_dim

        def capture(layer: torch.nn.Module) -> None:
            from vllm.models.deepseek_v4.cpu.cpu_sparse import _dequant_linear_weight

            # fp32: bf16 matmuls are ~20x slower on CPUs without AVX512-BF16,
            # and the weight values are bf16-exact either way.
            self._wo_a_dense = (
                _dequant_linear_weight(layer)
                .to(torch.bfloat16)
                .float()
                .view(self.n_local_groups, self.o_lora_rank, k_dim)
                .contiguous()
            )
            orig_pwal(layer)

        quant_method.process_weights_after_loading = capture

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if get_forward_context().attn_metadata is None:
            return torch.zeros((o.shape[0], self.hidden_size), dtype=o.dtype, device=o.device)
        num_tokens, num_heads, _ = o.shape
        o_derot = rope_ops.inverse_rope_(o, positions, self.rotary_emb.cos_sin_cache)
        # Round o to bf16 first: vLLM's kernels feed wo_a a bf16 activation.
        grouped = o_derot.to(torch.bfloat16).float().view(num_tokens, self.n_local_groups, -1)
        z = torch.bmm(grouped.transpose(0, 1), self._wo_a_dense.transpose(1, 2))
        return self.wo_b(z.transpose(0, 1).flatten(1).to(o.dtype))

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
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            # Profile / warm-up run: no caches to read.
            out.zero_()
            return
        swa_md = attn_metadata[self.swa_cache_layer.prefix]
        num_tokens = swa_md.window_indices.shape[0]
        if out.shape[0] > num_tokens:
            out[num_tokens:].zero_()
        if num_tokens == 0:
            return

        extra_cache = extra_indices = extra_lens = None
        topk_lease = None
        try:
            if self.compress_ratio > 1:
                flash_md = attn_metadata[self.prefix]
                entries_per_block = flash_md.block_size // self.compress_ratio
                extra_cache = eager.block_view(self.kv_cache, entries_per_block)
                if self.indexer is not None:
                    topk_lease = self._select_topk(
                        attn_metadata, flash_md, swa_md, positions, num_tokens,
                        index_q, index_q_scale, index_weights,
                    )
                    extra_indices, extra_lens = topk_lease["global"], topk_lease["lens"]
                else:
                    extra_indices, extra_lens = flash_md.c128_indices, flash_md.c128_lens

            if self._kernel_path is None:
                self._kernel_path = ops.kernel_path(q.device, "decode", need_lse=False)
                self._log_path(self._kernel_path)
            eager.attend(
                q[:num_tokens],
                eager.block_view(self.swa_cache_layer.kv_cache, swa_md.block_size),
                swa_md.window_indices,
                swa_md.window_lens,
                self.attn_sink,
                self.scale,
                out[:num_tokens],
                extra_cache,
                extra_indices,
                extra_lens,
                scratch=_scratches.get(id(self._workspace)),
            )
        finally:
            if topk_lease is not None:
                topk_lease.release()

    def _select_topk(
        self,
        attn_metadata: dict,
        flash_md: Any,
        swa_md: Any,
        positions: torch.Tensor,
        num_tokens: int,
        index_q: torch.Tensor | None,
        index_q_scale: torch.Tensor | None,
        index_weights: torch.Tensor | None,
    ) -> Any:
        """C4: causal top-k of the indexer, mapped to global compressed slots."""
        indexer = self.indexer
        lease = self._workspace.lease(self.prefix, "topk", num_tokens, ubatch=_ubatch_id())
        ind_md = attn_metadata[indexer.k_cache.prefix]
        try:
            eager.select_topk_c4(
                positions=positions[:num_tokens],
                token_to_req=swa_md.token_to_req_indices[:num_tokens],
                compressed_block_table=flash_md.block_table,
                entries_per_block=flash_md.block_size // self.compress_ratio,
                index_topk=self.index_topk,
                out_local=lease["local"],
                out_global=lease["global"],
                out_lens=lease["lens"],
                arange=self._topk_arange,
                minus_one=self._minus_one,
                index_q=index_q,
                index_q_scale=index_q_scale,
                index_weights=index_weights,
                indexer_k_cache=indexer.k_cache.kv_cache,
                indexer_block_table=ind_md.block_table,
                indexer_kv_dtype=self.indexer_kv_dtype,
                max_compressed=ind_md.max_seq_len // self.compress_ratio,
            )
        finally:
            if indexer._dsv4_lease is not None:
                indexer._dsv4_lease.release()
                indexer._dsv4_lease = None
        return lease

    def _log_path(self, path: str) -> None:
        kind = self.layer_kind
        _write_marker(kind, self, path)
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


def _allow_mxfp4_indexer_cache() -> None:
    """vLLM refuses ``indexer_kv_dtype="mxfp4"`` off Blackwell ("requires
    Blackwell datacenter GPUs") because its MXFP4 indexer kernels are
    DeepGEMM's; the plugin's layer computes MXFP4 logits in torch, so lift the
    architecture check for the model it builds (the layer and the indexer
    metadata builder both ask). Other validation (unknown dtypes) stays vLLM's."""
    import vllm.models.deepseek_v4.attention as dsv4_attention
    import vllm.v1.attention.backends.mla.indexer as mla_indexer

    original = mla_indexer.dsa_indexer_uses_fp4
    if getattr(original, "_dsv4_patched", False):
        return

    def dsa_indexer_uses_fp4(vllm_config: Any) -> bool:
        kv_dtype = vllm_config.attention_config.resolve_indexer_kv_dtype("fp8")
        if kv_dtype == "mxfp4":
            return True
        return original(vllm_config)

    dsa_indexer_uses_fp4._dsv4_patched = True  # type: ignore[attr-defined]
    mla_indexer.dsa_indexer_uses_fp4 = dsa_indexer_uses_fp4
    dsv4_attention.dsa_indexer_uses_fp4 = dsa_indexer_uses_fp4


def get_attention_layer_cls(platform: str) -> type:
    """The plugin's DeepSeek-V4 attention layer for ``platform`` (vllm_compat
    installs it as the model's attention class)."""
    if platform == "cpu":
        _allow_mxfp4_indexer_cache()
        return DSV4CPUAttention
    raise NotImplementedError(
        f"vllm_dsv4_backend has no DeepSeek-V4 attention layer for platform {platform!r} "
        "yet (supported: cpu); set VLLM_DSV4_ATTN_IMPL=vllm to use vLLM's own layer"
    )
