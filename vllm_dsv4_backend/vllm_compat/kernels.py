# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU patches that let vLLM 0.32's own DeepSeek-V4 CPU path run without Triton.

vLLM's CPU DeepSeek-V4 model (``models/deepseek_v4/cpu``) runs attention with
C++ kernels, but its metadata builders still launch Triton kernels that have
no CPU backend without triton-cpu (not on PyPI). Each entry of
:data:`KERNEL_PATCHES` swaps one module global for the matching torch port of
:mod:`vllm_dsv4_backend.ops.metadata` after checking that the global exists
and that its call signature is the one the port implements. The registry
(:mod:`.patches`, entries ``T1``…``T8`` and ``B1``) arms them; this module
holds the table and the install functions:

====  ==============================================================  =========
id    vLLM 0.32 global                                                 read on CPU
====  ==============================================================  =========
T1    ``v1.attention.ops.metadata.compute_token_to_req_indices``       yes
      (+ the by-name copy in ``mla.sparse_swa``)
T2    ``mla.compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL``         yes
T3    ``mla.indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL``             seq > 2051
T4    ``mla.sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL``          no
T5    ``mla.sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL``              no
T6    ``mla.sparse_swa._COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL``  DSpark only
T7    ``mla.indexer._PREPARE_UNIFORM_DECODE_KERNEL``                   not reached
T8    ``deepseek_v4.sparse_mla._BUILD_C128A_TOPK_METADATA_KERNEL``     not reached
====  ==============================================================  =========

(``mla`` = ``vllm.v1.attention.backends.mla``.) T4–T8 are ported rather than
stubbed so a future builder that does read them gets correct values; the
registry marks each port that vLLM 0.32's CPU path does not read
(``Patch.read_on_cpu``).

B1 (a vLLM 0.32 bug, hit with or without Triton):
``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`` returns only
the ``swaonly``/``c4a``/``c128a`` keys while the shared ``build()`` also reads
``c1a``/``c2a`` (``KeyError: 'c1a'`` on the first step). The patch returns
every ``_LAYER_TYPE_*`` key as ``None``; it is skipped if the installed method
already returns them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_dsv4_backend.vllm_compat import hooks

__all__ = [
    "B1_MODULE",
    "B1_SYMBOL",
    "KERNEL_PATCHES",
    "TorchKernel",
    "fix_b1_tile_scheduler",
    "install_kernel_port",
    "kernel_modules",
]

_MLA = "vllm.v1.attention.backends.mla"


class TorchKernel:
    """Stand-in for a ``VllmTritonJitKernel`` global that runs a torch port.

    Calls go to ``fn`` with the launcher's own arguments. ``register_warmup``
    (called by the attention layers when JIT warmup is on) is a no-op: torch
    code has nothing to compile.
    """

    def __init__(self, key: str, fn: Callable[..., Any], original: Any) -> None:
        self.key = key
        self.fn = fn
        self.__vllm_dsv4_original__ = original
        self.__name__ = getattr(fn, "__name__", key)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn  # inspect.signature() reports the port's signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def register_warmup(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"TorchKernel({self.key}: vllm_dsv4_backend.ops.metadata.{self.__name__})"


@dataclass(frozen=True)
class KernelPatch:
    """One module global to replace by a torch port."""

    key: str
    module: str
    attr: str
    port: str  # function name in vllm_dsv4_backend.ops.metadata
    params: tuple[str, ...]  # the original's call parameters (without self)
    wrap: bool = True  # wrap in TorchKernel (launcher objects) or bind the function


# The per-token request tables both SWA index kernels take, in their order.
_SWA_TABLES = (
    "query_start_loc",
    "seq_lens",
    "token_to_req_indices",
    "is_valid_token",
    "block_table",
    "block_size",
)
_SWA_PARAMS = (
    "swa_indices",
    "swa_lens",
    "window_size",
    "index_width",
    "left_visible",
    "right_visible",
    *_SWA_TABLES,
    "replay_start",
    "num_tokens",
    "token_offset",
    "has_image",
)
_T1_PARAMS = ("query_start_loc", "out", "num_mapped_tokens", "num_tokens")

KERNEL_PATCHES: tuple[KernelPatch, ...] = (
    KernelPatch(
        "T1",
        "vllm.v1.attention.ops.metadata",
        "compute_token_to_req_indices",
        "compute_token_to_req_indices",
        _T1_PARAMS,
        wrap=False,
    ),
    KernelPatch(
        "T1",
        f"{_MLA}.sparse_swa",
        "compute_token_to_req_indices",
        "compute_token_to_req_indices",
        _T1_PARAMS,
        wrap=False,
    ),
    KernelPatch(
        "T2",
        f"{_MLA}.compressor_utils",
        "_COMPRESSED_SLOT_MAPPING_KERNEL",
        "compressed_slot_mapping",
        (
            "compressed_slot_mapping",
            "slot_mapping",
            "query_start_loc",
            "seq_lens",
            "block_table",
            "block_size",
            "compress_ratio",
            "dcp_world_size",
            "cp_interleave",
        ),
    ),
    KernelPatch(
        "T3",
        f"{_MLA}.indexer",
        "_BUILD_PREFILL_CHUNK_METADATA_KERNEL",
        "build_prefill_chunk_metadata",
        (
            "query_start_loc",
            "uncompressed_seq_lens",
            "cu_compressed_seq_lens",
            "row_start_cu_compressed_seq_lens",
            "token_to_seq",
            "cu_compressed_seq_len_ks",
            "cu_compressed_seq_len_ke",
            "query_slice_start",
            "query_slice_stop",
            "DCP_RANK",
            "DCP_WORLD",
            "DCP_INTERLEAVE",
            "num_reqs",
            "COMPRESS_RATIO",
        ),
    ),
    KernelPatch(
        "T4",
        f"{_MLA}.sparse_swa",
        "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
        "swa_indices_and_lens",
        _SWA_PARAMS,
    ),
    KernelPatch(
        "T5",
        f"{_MLA}.sparse_swa",
        "_COMPUTE_PREFILL_METADATA_KERNEL",
        "prefill_gather_lens",
        (
            "prefill_gather_lens",
            "seq_lens",
            "query_start_loc",
            "replay_start",
            "num_prefills",
            "num_decodes",
            "window_size",
        ),
    ),
    KernelPatch(
        "T6",
        f"{_MLA}.sparse_swa",
        "_COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL",
        "dspark_noncausal_swa_indices",
        (
            "swa_indices",
            "swa_lens",
            "window_size",
            "index_width",
            *_SWA_TABLES,
            "num_tokens",
            "token_offset",
        ),
    ),
    KernelPatch(
        "T7",
        f"{_MLA}.indexer",
        "_PREPARE_UNIFORM_DECODE_KERNEL",
        "prepare_uniform_decode",
        (
            "seq_lens",
            "decode_seq_lens",
            "block_table",
            "expanded_block_table",
            "decode_lens",
            "num_decode_tokens",
            "max_decode_len",
        ),
    ),
    KernelPatch(
        "T8",
        "vllm.models.deepseek_v4.sparse_mla",
        "_BUILD_C128A_TOPK_METADATA_KERNEL",
        "build_c128a_topk_metadata",
        (
            "global_decode_buffer",
            "decode_lens_buffer",
            "prefill_buffer",
            "positions",
            "compress_ratio",
            "max_compressed_tokens",
            "num_decode_tokens",
            "token_to_req_indices",
            "block_table",
            "block_size",
            "slot_mapping",
        ),
    ),
)

B1_MODULE = "vllm.models.deepseek_v4.cpu.cpu_mla"
B1_SYMBOL = "DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler"


def kernel_rows(key: str) -> tuple[KernelPatch, ...]:
    """The table rows of port ``key`` (``T1`` has two: the global and its by-name copy)."""
    rows = tuple(p for p in KERNEL_PATCHES if p.key == key)
    if not rows:
        raise ValueError(f"key: expected one of {sorted({p.key for p in KERNEL_PATCHES})}, "
                         f"got {key!r}")
    return rows


def install_kernel_port(key: str, module: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """Replace the global of port ``key`` in ``module`` (checked signature,
    ``hooks.mark_port`` marker); False if it already holds the port."""
    from vllm_dsv4_backend.ops import metadata as ports

    changed = False
    for patch in kernel_rows(key):
        if patch.module != module.__name__:
            continue
        fn = getattr(ports, patch.port)
        _, _, current = hooks.resolve(module, patch.attr)
        if hooks.is_port(current):
            continue
        replacement: Any = TorchKernel(patch.key, fn, current) if patch.wrap else _bind(fn)
        if hooks.replace_attr(module, patch.attr, replacement, expected_params=patch.params):
            on_applied(f"{patch.key}:{module.__name__}.{patch.attr}")
            changed = True
    return changed


def _bind(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A fresh function object per patched module (so each can be tagged)."""

    def port(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    port.__name__ = fn.__name__
    port.__doc__ = fn.__doc__
    port.__wrapped__ = fn  # type: ignore[attr-defined]
    return port


def fix_b1_tile_scheduler(module: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """Patch B1 (see module docstring) in ``vllm.models.deepseek_v4.cpu.cpu_mla``;
    False if already patched or fixed upstream."""
    import vllm.v1.attention.backends.mla.sparse_swa as sparse_swa

    owner, attr, current = hooks.resolve(module, B1_SYMBOL)
    if hooks.is_port(current):
        return False
    hooks.check_signature(f"{B1_MODULE}.{B1_SYMBOL}", current, ("num_decode_tokens",))
    keys = tuple(
        getattr(sparse_swa, name)
        for name in sorted(dir(sparse_swa))
        if name.startswith("_LAYER_TYPE_")
    )
    if not keys:
        raise hooks.fail(f"{_MLA}.sparse_swa._LAYER_TYPE_*", "no layer-type constants found")
    try:
        returned = current(None, 0)
    except Exception as e:  # the 0.32 body never touches self
        raise hooks.fail(f"{B1_MODULE}.{B1_SYMBOL}", f"probe call failed ({e!r})") from e
    if not isinstance(returned, dict):
        raise hooks.fail(f"{B1_MODULE}.{B1_SYMBOL}", f"returned {type(returned).__name__}")
    if set(keys) <= set(returned):
        return False  # fixed upstream

    def build_tile_scheduler(self, num_decode_tokens: int) -> dict[str, None]:
        """CPU never plans FlashMLA tiles: every layer type maps to ``None``."""
        return dict.fromkeys(keys)

    hooks.replace_attr(owner, attr, build_tile_scheduler)
    on_applied(f"B1:{B1_MODULE}.{B1_SYMBOL}")
    return True


def kernel_modules() -> list[str]:
    """Every module a CPU patch targets (import order does not matter)."""
    return sorted({p.module for p in KERNEL_PATCHES} | {B1_MODULE})
