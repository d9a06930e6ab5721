# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FLASHMLA_SPARSE_DSV4 attention backend for DeepSeek-V4 (vLLM glue).

One file, in vLLM's order: the capability class
(:class:`DSV4FlashMLASparseBackend`), the metadata builders, then the
window-cache backend that carries the SWA builder.

DeepSeek-V4 never instantiates an ``AttentionImpl``: the model's attention
layer (:mod:`vllm_dsv4_backend.layer`) runs the eager region itself and asks
the layer's ``backend_cls`` only for capabilities and the metadata builder.
Only the CPU layer uses these classes (the CUDA layer keeps vLLM's), so the
builders are vLLM's CPU builders: the compressed caches' as is, the
sliding-window cache's without the two kernels whose outputs no CPU layer reads
(:func:`get_swa_builder_cls`). The metadata is vLLM's dataclasses; every field
a CPU layer reads is computed by vLLM's code. This module imports vLLM; it is
loaded only by the plugin.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.mla.sparse_swa import (
    DeepseekSparseSWABackend,
    DeepseekSparseSWAMetadata,
)

from vllm_dsv4_backend.formats import constants

SUPPORTED_KV_CACHE_DTYPES = constants.KV_CACHE_DTYPES
SUPPORTED_INDEXER_KV_DTYPES = constants.INDEXER_KV_DTYPES
SUPPORTED_HEAD_SIZES = (512,)
KERNEL_BLOCK_SIZE = constants.KERNEL_BLOCK_SIZE


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
    def get_builder_cls() -> type:
        return _compressed_builder_cls()

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
        # The CUDA layer runs vLLM's FlashMLA DeepSeek-V4 kernels, built for sm90a
        # and sm100f only.
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
                " has no FlashMLA DeepSeek-V4 kernel (supported: 9.x, 10.x)"
            )
        return reasons


def _compressed_builder_cls() -> type:
    """vLLM's builder for the compressed caches on this platform: on CPU the one that
    skips the C128A top-k tables (``DeepseekV4CPUAttention.forward_mqa`` recomputes them
    from the positions), elsewhere the shared one."""
    if current_platform.is_cpu():
        from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUFlashMLAMetadataBuilder

        return DeepseekV4CPUFlashMLAMetadataBuilder
    return DeepseekV4SparseMLABackend.get_builder_cls()


# vLLM's SWA-builder kernels whose outputs no CPU DeepSeek-V4 layer reads (the
# plugin's and vLLM's build their window tables from the positions in
# forward_mqa), and the metadata fields they fill.
_UNREAD_ON_CPU_KERNELS = ("_COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
                          "_COMPUTE_PREFILL_METADATA_KERNEL")
_UNREAD_ON_CPU_FIELDS = ("decode_swa_indices", "decode_swa_lens", "prefill_swa_indices",
                         "prefill_swa_lens", "prefill_gather_lens")


def _skipped_kernel(*args: Any, **kwargs: Any) -> None:
    return None


_SWA_BUILDER_CLS: type | None = None


def get_swa_builder_cls() -> type:
    """The sliding-window cache's builder: vLLM's for this platform; on CPU without the
    window index tables no CPU layer reads (built once, on first use).

    The registry entry ``swa_unread_kernels``: if building the CPU one fails (a vLLM
    whose ``sparse_swa`` moved), vLLM's own CPU builder serves, after one ERROR line
    naming the entry (a startup error under ``VLLM_DSV4_ATTN_IMPL=plugin``).
    """
    global _SWA_BUILDER_CLS
    if _SWA_BUILDER_CLS is not None:
        return _SWA_BUILDER_CLS
    if not current_platform.is_cpu():
        _SWA_BUILDER_CLS = DeepseekSparseSWABackend.get_builder_cls()
        return _SWA_BUILDER_CLS
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder

    from vllm_dsv4_backend import envs
    from vllm_dsv4_backend.vllm_compat import hooks

    try:
        _SWA_BUILDER_CLS = _cpu_swa_builder_cls(DeepseekV4CPUSparseSWAMetadataBuilder)
    except Exception as e:  # noqa: BLE001 - vLLM's builder computes the same fields and more
        strict = envs.VLLM_DSV4_ATTN_IMPL == "plugin"
        err = hooks.patch_failed("swa_unread_kernels", "vllm.v1.attention.backends.mla."
                                 "sparse_swa", e, strict=strict,
                                 kept="vLLM's CPU SWA metadata builder used")
        if strict:
            raise err from e
        _SWA_BUILDER_CLS = DeepseekV4CPUSparseSWAMetadataBuilder
    return _SWA_BUILDER_CLS


def _cpu_swa_builder_cls(vllm_builder: type) -> type:
    """vLLM's CPU SWA builder ``vllm_builder`` minus the kernels no CPU layer reads."""
    from vllm.v1.attention.backends.mla import sparse_swa

    from vllm_dsv4_backend.vllm_compat import hooks

    missing = [k for k in _UNREAD_ON_CPU_KERNELS if not hasattr(sparse_swa, k)]
    missing += [f for f in _UNREAD_ON_CPU_FIELDS
                if f not in DeepseekSparseSWAMetadata.__dataclass_fields__]
    if missing:
        raise hooks.fail("vllm.v1.attention.backends.mla.sparse_swa",
                         f"no longer has {missing}, which the plugin's CPU SWA builder skips")

    class DSV4CPUSWAMetadataBuilder(vllm_builder):  # type: ignore[valid-type,misc]
        """vLLM's CPU SWA builder minus two of its kernels: the decode / prefill
        window index tables and the prefill gather lengths, which only the GPU layers
        read (the CPU layers build their window tables from the positions). Their
        fields are ``None`` so a reader that appears later fails loudly instead of
        reading stale buffers. Every field the CPU layers read (block table, slot
        mapping, token to request, block size, counts) is vLLM's, computed by vLLM's
        code."""

        def build(self, common_prefix_len: int, common_attn_metadata: Any,
                  fast_build: bool = False, **kwargs: Any) -> DeepseekSparseSWAMetadata:
            # Registry entry swa_unread_kernels (vllm_compat.patches). The kernels
            # are module globals read at call time; builds run on the
            # engine's one model-runner thread.
            saved = {k: getattr(sparse_swa, k) for k in _UNREAD_ON_CPU_KERNELS}
            for k in _UNREAD_ON_CPU_KERNELS:
                setattr(sparse_swa, k, _skipped_kernel)
            try:
                md = super().build(common_prefix_len, common_attn_metadata, fast_build,
                                   **kwargs)
            finally:
                for k, v in saved.items():
                    setattr(sparse_swa, k, v)
            for f in _UNREAD_ON_CPU_FIELDS:
                setattr(md, f, None)
            return md

    return DSV4CPUSWAMetadataBuilder


class DSV4SWABackend(DeepseekSparseSWABackend):
    """The sliding-window cache's backend: vLLM's, with the plugin's builder."""

    @staticmethod
    def get_builder_cls() -> type:
        return get_swa_builder_cls()
