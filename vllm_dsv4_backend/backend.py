# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FLASHMLA_SPARSE_DSV4 attention backend for DeepSeek-V4 (vLLM glue).

One file, in vLLM's order: the capability class
(:class:`DSV4FlashMLASparseBackend`), the per-step metadata
(:class:`DSV4SparseMetadata`), the Triton-free metadata builders for the
compressed caches and for the sliding-window cache, then the window-cache
backend that carries the SWA builder.

DeepSeek-V4 never instantiates an ``AttentionImpl``: the model's attention
layer (:mod:`vllm_dsv4_backend.layer`) runs the eager region itself and asks
the layer's ``backend_cls`` only for capabilities and the metadata builder.

Everything the builders compute is plain vectorized torch written into
buffers allocated once at construction (sized by ``max_num_batched_tokens``
and ``max_model_len``), so a step allocates nothing and addresses are stable
across steps. This module imports vLLM; it is loaded only by the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.models.deepseek_v4.sparse_mla import (
    DeepseekV4FlashMLAMetadata,
    DeepseekV4SparseMLABackend,
    DeepseekV4SparseMLAMetadataBuilder,
)
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.mla.sparse_swa import (
    DeepseekSparseSWABackend,
    DeepseekSparseSWAMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_dsv4_backend.formats import constants
from vllm_dsv4_backend.ops import slots as slot_ops

logger = init_logger(__name__)

# NOTE: FlashMLA's sparse decode wants every top-k width a multiple of 64 (128
# with an extra cache on newer builds); vLLM pads C128 widths to 128 with -1
# and caps them with topk_length. We do the same so both kernel paths see the
# same shapes.
TOPK_ALIGNMENT = 128
SUPPORTED_KV_CACHE_DTYPES = constants.KV_CACHE_DTYPES
SUPPORTED_INDEXER_KV_DTYPES = constants.INDEXER_KV_DTYPES
SUPPORTED_HEAD_SIZES = (512,)
KERNEL_BLOCK_SIZE = constants.KERNEL_BLOCK_SIZE


def _round_up(x: int, m: int) -> int:
    return cdiv(x, m) * m


class DSV4FlashMLASparseBackend(DeepseekV4SparseMLABackend):
    """Capabilities of the plugin's FLASHMLA_SPARSE_DSV4 backend.

    The name is the existing enum member: a new member registered at run
    time does not survive the pickled config of a spawned engine process.
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "FLASHMLA_SPARSE_DSV4"

    @staticmethod
    def get_builder_cls() -> type[DSV4SparseMetadataBuilder]:
        return DSV4SparseMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[Any]:
        # 256 tokens per page: 64 C4 entries or 2 C128 entries per
        # compressed block, 64 tokens per SWA block (vLLM's packing).
        return [KERNEL_BLOCK_SIZE]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # FlashMLA's DeepSeek-V4 kernels exist for sm90a and sm100f; the torch
        # path has no architecture limit (selected with VLLM_DSV4_KERNEL=torch).
        from vllm_dsv4_backend import envs

        if envs.VLLM_DSV4_KERNEL == "torch":
            return True
        return capability.major in (9, 10)

    @classmethod
    def unsupported_reasons(
        cls,
        *,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None = None,
        indexer_kv_dtype: str = "fp8",
        device_capability: DeviceCapability | None = None,
    ) -> list[str]:
        """Why a configuration cannot run, each reason naming what is supported.

        An empty list means supported. Used by the layer at construction so a
        bad setup fails at startup with every problem listed at once.
        """
        reasons: list[str] = []
        if head_size not in SUPPORTED_HEAD_SIZES:
            reasons.append(
                f"head_size {head_size} is not supported; supported head sizes are "
                f"{list(SUPPORTED_HEAD_SIZES)} (448 NoPE + 64 RoPE)"
            )
        if dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {dtype} is not supported; supported dtypes are "
                f"{cls.supported_dtypes}"
            )
        if kv_cache_dtype is not None and kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            reasons.append(
                f"kv_cache_dtype {kv_cache_dtype!r} is not supported; supported "
                f"kv-cache dtypes are {list(SUPPORTED_KV_CACHE_DTYPES)} (all use the "
                "584-byte fp8_ds_mla layout)"
            )
        if block_size is not None and block_size % KERNEL_BLOCK_SIZE != 0:
            reasons.append(
                f"block_size {block_size} is not supported; use a multiple of "
                f"{KERNEL_BLOCK_SIZE}"
            )
        if indexer_kv_dtype not in SUPPORTED_INDEXER_KV_DTYPES:
            reasons.append(
                f"indexer_kv_dtype {indexer_kv_dtype!r} is not supported; supported "
                f"indexer cache dtypes are {list(SUPPORTED_INDEXER_KV_DTYPES)}"
            )
        if device_capability is not None and not cls.supports_compute_capability(
            device_capability
        ):
            reasons.append(
                f"compute capability {device_capability.major}.{device_capability.minor}"
                " has no FlashMLA DeepSeek-V4 kernel (supported: 9.x, 10.x); set "
                "VLLM_DSV4_KERNEL=torch to run the PyTorch path instead"
            )
        return reasons


@dataclass
class DSV4SparseMetadata(DeepseekV4FlashMLAMetadata):
    """Per-step metadata of one compressed-cache group (C4 or C128 layers).

    Extends vLLM's dataclass (so vLLM code reading it keeps working) with:

    - ``positions``: ``[T]`` int64, absolute position of each scheduled token.
    - ``num_decode_tokens`` / ``num_prefill_tokens``: decodes come first.
    - ``c128_indices``: ``[T, W]`` int32 global compressed slot ids
      (``block * entries_per_block + offset``) of every entry
      ``j < (pos + 1) // 128``, valid ids first, then -1; ``W`` is a multiple
      of 128. Only for ratio-128 groups, else ``None``.
    - ``c128_lens``: ``[T]`` int32 number of valid ids per row.
    """

    positions: torch.Tensor | None = None
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    c128_indices: torch.Tensor | None = None
    c128_lens: torch.Tensor | None = None


class DSV4SparseMetadataBuilder(DeepseekV4SparseMLAMetadataBuilder):
    """Triton-free builder for the compressed caches (C4 and C128 groups).

    Decodes come first (``reorder_batch_threshold = 1`` with speculative
    tokens counted as decode, set by the base class). All outputs are views of
    buffers allocated here, once.
    """

    # Our torch path is eager; FlashMLA is graph-safe once every input lives in
    # a persistent buffer, which is what this builder guarantees.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.entries_per_block = self.kv_cache_spec.block_size // self.compress_ratio
        if self.compress_ratio == 128:
            self.c128_max_width = _round_up(
                cdiv(self.model_config.max_model_len, 128), TOPK_ALIGNMENT
            )
            mnbt = vllm_config.scheduler_config.max_num_batched_tokens
            self.c128_indices_buffer = torch.empty(
                (mnbt, self.c128_max_width), dtype=torch.int32, device=device
            )
            self.c128_lens_buffer = torch.empty((mnbt,), dtype=torch.int32, device=device)
            self.c128_arange = torch.arange(
                self.c128_max_width, dtype=torch.int32, device=device
            )

    def _build_c128a_metadata(
        self, cm: CommonAttentionMetadata, req_id_per_token: torch.Tensor
    ) -> dict[str, torch.Tensor | None]:
        # vLLM's version launches a Triton kernel; ours is built in build().
        return {}

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DSV4SparseMetadata:
        cm = common_attn_metadata
        # The base fills token->request and the compressed slot mapping into
        # its persistent buffers; the plugin routes both helpers to torch
        # (vllm_compat), so no Triton runs here.
        base = super().build(common_prefix_len, cm, fast_build)
        num_tokens = cm.num_actual_tokens
        _, _, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold or 1
        )
        positions = cm.positions[:num_tokens] if cm.positions is not None else None

        c128_indices = c128_lens = None
        if self.compress_ratio == 128 and num_tokens > 0:
            assert positions is not None, "C128 metadata needs positions"
            # Adaptive width: the widest row this step needs, rounded to the
            # kernel alignment, so short contexts do not scan max_model_len.
            width = min(
                _round_up(max(cm.max_seq_len // 128, 1), TOPK_ALIGNMENT),
                self.c128_max_width,
            )
            c128_indices = self.c128_indices_buffer[:num_tokens, :width]
            c128_lens = self.c128_lens_buffer[:num_tokens]
            slot_ops.all_visible_compressed_slots(
                c128_indices,
                c128_lens,
                positions=positions,
                token_to_req=base.req_id_per_token[:num_tokens],
                block_table=base.block_table,
                block_size=self.entries_per_block,
                compress_ratio=128,
                arange=self.c128_arange[:width],
            )

        fields = {f: getattr(base, f) for f in DeepseekV4FlashMLAMetadata.__dataclass_fields__}
        return DSV4SparseMetadata(
            **fields,
            positions=positions,
            num_decode_tokens=num_decode_tokens,
            num_prefill_tokens=num_prefill_tokens,
            c128_indices=c128_indices,
            c128_lens=c128_lens,
        )


def _swa_builder_base() -> type:
    """vLLM's SWA builder for this platform (the CPU one skips the FlashMLA
    tile planner, which is a CUDA concern)."""
    if current_platform.is_cpu():
        from vllm.models.deepseek_v4.cpu.cpu_mla import (
            DeepseekV4CPUSparseSWAMetadataBuilder,
        )

        return DeepseekV4CPUSparseSWAMetadataBuilder
    return DeepseekSparseSWABackend.get_builder_cls()


@dataclass
class DSV4SWAMetadata(DeepseekSparseSWAMetadata):
    """vLLM's SWA metadata plus the plugin's window indices.

    - ``window_indices``: ``[T, window]`` int32 global SWA-cache slot ids of
      positions ``max(0, p - window + 1) .. p`` in ascending order, then -1.
    - ``window_lens``: ``[T]`` int32, ``min(window, p + 1)``.
    - ``positions``: ``[T]`` int64.
    """

    window_indices: torch.Tensor | None = None
    window_lens: torch.Tensor | None = None
    positions: torch.Tensor | None = None


_SWA_BUILDER_CLS: type | None = None


def get_swa_builder_cls() -> type:
    """Build (once) the SWA metadata builder on top of the platform's one."""
    global _SWA_BUILDER_CLS
    if _SWA_BUILDER_CLS is not None:
        return _SWA_BUILDER_CLS
    base = _swa_builder_base()

    class DSV4SWAMetadataBuilder(base):  # type: ignore[misc, valid-type]
        """Adds the sliding-window slot ids, computed once per step for every
        layer (all DeepSeek-V4 layers share one window geometry)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            hf_config = self.vllm_config.model_config.hf_config
            self.window_size = int(hf_config.sliding_window)
            mnbt = self.max_num_batched_tokens
            self.window_indices_buffer = torch.empty(
                (mnbt, self.window_size), dtype=torch.int32, device=self.device
            )
            self.window_lens_buffer = torch.empty((mnbt,), dtype=torch.int32, device=self.device)
            self.window_arange = torch.arange(
                self.window_size, dtype=torch.int32, device=self.device
            )

        def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build=False):
            base_md = super().build(common_prefix_len, common_attn_metadata, fast_build)
            cm = common_attn_metadata
            num_tokens = cm.num_actual_tokens
            t2r = base_md.token_to_req_indices
            if t2r is None:
                t2r = self.window_lens_buffer.new_empty(0)
            indices = self.window_indices_buffer[:num_tokens]
            lens = self.window_lens_buffer[:num_tokens]
            positions = cm.positions[:num_tokens]
            slot_ops.window_slots(
                indices,
                lens,
                positions=positions,
                token_to_req=t2r[:num_tokens],
                block_table=base_md.block_table,
                block_size=base_md.block_size,
                arange=self.window_arange,
            )
            fields = {f: getattr(base_md, f) for f in base_md.__dataclass_fields__}
            return DSV4SWAMetadata(
                **fields, window_indices=indices, window_lens=lens, positions=positions
            )

    _SWA_BUILDER_CLS = DSV4SWAMetadataBuilder
    return DSV4SWAMetadataBuilder


class DSV4SWABackend(DeepseekSparseSWABackend):
    """The sliding-window cache's backend: vLLM's, with the plugin's builder."""

    @staticmethod
    def get_builder_cls() -> type:
        return get_swa_builder_cls()
