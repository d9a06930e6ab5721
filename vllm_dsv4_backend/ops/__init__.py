# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA ops for DeepSeek-V4, one interface over three kernel paths (torch only).

Public API (shaped like FlashMLA's ``flash_mla_with_kvcache`` / ``flash_mla_sparse_fwd``):

- :func:`sparse_mla_decode`: sparse decode over one or two ``fp8_ds_mla`` paged caches;
- :func:`sparse_mla_prefill`: sparse prefill over a dequantized bf16 KV buffer;
- :func:`kernel_path` / :func:`last_path`: which path a call takes / took;
- :func:`decode_scratch_nbytes` / :func:`prefill_scratch_nbytes`: scratch sizing for
  allocation-free torch-path calls.

Kernel paths, chosen per call by the ``kernel`` argument; ``kernel=None`` (the default) means
the ``VLLM_DSV4_KERNEL`` setting, read through :mod:`vllm_dsv4_backend.envs` at each call
(the one reader of every setting, so a bad value raises the same error here as everywhere):

``auto`` (default)
    CUDA: FlashMLA (``flashmla``) when a build for the device exists, else ``torch`` (with a
    one-time warning). CPU decode that does not need the lse: vLLM's C++ kernel
    (``vllm_cpu``) when this machine can run it, else ``torch``. Everything else: ``torch``.
``torch`` | ``vllm_cpu`` | ``flashmla``
    Force a path. A forced path that cannot serve the call raises ``RuntimeError`` saying
    why; it never falls back silently.

Both ops are also registered as ``torch.ops.vllm_dsv4.sparse_mla_decode`` and
``torch.ops.vllm_dsv4.sparse_mla_prefill`` (``torch.library.custom_op``, outputs passed as
mutated arguments, fake impls for ``torch.compile``). Eager calls of the Python functions
run the implementation directly (going through the op dispatcher would add ~40 us per call
on a 2-core CPU, about 1% of a batch-1 decode call); under ``torch.compile`` the functions
route through the custom ops.

This package never imports vLLM at module level; the ``vllm_cpu`` and ``flashmla`` paths look
up vLLM's compiled kernels lazily and guarded.
"""

from __future__ import annotations

import logging

import torch

from vllm_dsv4_backend import envs
from vllm_dsv4_backend.ops import checks, flashmla, torch_sparse_mla, vllm_cpu
from vllm_dsv4_backend.ops.torch_sparse_mla import decode_scratch_nbytes, prefill_scratch_nbytes

__all__ = [
    "KERNEL_CHOICES",
    "KERNEL_ENV",
    "KERNEL_PATHS",
    "decode_scratch_nbytes",
    "kernel_path",
    "last_path",
    "prefill_scratch_nbytes",
    "requested_kernel",
    "sparse_mla_decode",
    "sparse_mla_prefill",
]

# The setting's name, for messages (envs.py is its only reader).
KERNEL_ENV = "VLLM_DSV4_KERNEL"
KERNEL_PATHS = ("torch", "vllm_cpu", "flashmla")
# What ``kernel=`` (and the setting) accepts: a path, or ``auto``.
KERNEL_CHOICES = ("auto", *KERNEL_PATHS)

logger = logging.getLogger(__name__)
_last: dict[str, str] = {}
_logged: set[tuple[str, str]] = set()


def requested_kernel(kernel: str | None = None) -> str:
    """The requested path: ``kernel`` if given, else the ``VLLM_DSV4_KERNEL`` setting.

    Returns ``auto``, ``torch``, ``vllm_cpu`` or ``flashmla``.

    Raises:
        ValueError: ``kernel`` (or the setting, with the error of
            :mod:`vllm_dsv4_backend.envs`) is any other value.
    """
    if kernel is None:
        return envs.VLLM_DSV4_KERNEL
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel: expected one of {list(KERNEL_CHOICES)}, got {kernel!r}")
    return kernel


def kernel_path(
    device: torch.device | str,
    op: str = "decode",
    *,
    need_lse: bool = True,
    kernel: str | None = None,
) -> str:
    """The kernel path a call of ``op`` (``"decode"`` or ``"prefill"``) on ``device`` takes.

    Args:
        device: the device of ``q``.
        op: ``"decode"`` or ``"prefill"``.
        need_lse: decode only: whether the caller wants the lse (vLLM's C++ CPU kernel does
            not produce it, so ``auto`` uses it only when this is False).
        kernel: ``auto``, ``torch``, ``vllm_cpu`` or ``flashmla``; None (default) means the
            ``VLLM_DSV4_KERNEL`` setting.

    Raises:
        ValueError: unknown ``op`` or ``kernel`` / ``VLLM_DSV4_KERNEL`` value.
        RuntimeError: the forced path cannot serve this call (the message says why).
    """
    dev = torch.device(device)
    if op not in ("decode", "prefill"):
        raise ValueError(f"op: expected 'decode' or 'prefill', got {op!r}")
    req = requested_kernel(kernel)
    # Name what forced the path, so the message points at the right knob.
    forced = f"{KERNEL_ENV}={req}" if kernel is None else f"kernel={req!r}"
    if req == "torch":
        return "torch"
    if req == "flashmla":
        ok, why = flashmla.available(dev)
        if not ok:
            raise RuntimeError(f"{forced}, but FlashMLA cannot run here: {why}")
        return "flashmla"
    if req == "vllm_cpu":
        if op == "prefill":
            raise RuntimeError(
                f"{forced}: vLLM's C++ CPU kernels have no sparse prefill over a "
                "bf16 KV buffer (flash_mla_sparse_fwd semantics); use auto or torch for prefill"
            )
        if need_lse:
            raise RuntimeError(
                f"{forced}: torch.ops._C.flash_mla_with_kvcache_cpu does not "
                "return the lse; call sparse_mla_decode(..., need_lse=False) or use auto/torch"
            )
        ok, why = vllm_cpu.available(dev)
        if not ok:
            raise RuntimeError(f"{forced}, but vLLM's C++ kernel cannot run: {why}")
        return "vllm_cpu"
    # auto
    if dev.type == "cuda":
        ok, why = flashmla.available(dev)
        if ok:
            return "flashmla"
        _log_once(op, "torch-fallback", logging.WARNING,
                  "FlashMLA unavailable on %s (%s); sparse MLA %s uses the torch path", dev, why,
                  op)
        return "torch"
    if dev.type == "cpu" and op == "decode" and not need_lse and vllm_cpu.available(dev)[0]:
        return "vllm_cpu"
    return "torch"


def last_path(op: str | None = None) -> str | None:
    """The kernel path the most recent eager call took in this process (None before any).

    Args:
        op: ``"decode"`` or ``"prefill"`` for the last call of that op; None (default) for the
            last call of either.
    """
    return _last.get(op or "any")


def _log_once(op: str, path: str, level: int, msg: str, *args: object) -> None:
    if (op, path) not in _logged:
        _logged.add((op, path))
        logger.log(level, msg, *args)


def _record(op: str, path: str) -> None:
    _last[op] = path
    _last["any"] = path
    _log_once(op, path, logging.INFO, "vllm_dsv4 sparse_mla_%s: %s path", op, path)


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------
def _decode_eager(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    softmax_scale: float,
    extra_k_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_topk_length: torch.Tensor | None,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    need_lse: bool,
    scratch: torch.Tensor | None,
    sched_meta: object | None,
    kernel: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dims = checks.check_decode_args(
        q, k_cache, indices, topk_length, attn_sink, softmax_scale, extra_k_cache,
        extra_indices, extra_topk_length, out, lse_out,
    )
    path = kernel_path(q.device, "decode", need_lse=need_lse, kernel=kernel)
    _record("decode", path)
    if path == "torch":
        return torch_sparse_mla.sparse_mla_decode_torch(
            q, k_cache, indices, topk_length, attn_sink, dims, extra_k_cache, extra_indices,
            extra_topk_length, out=out, lse_out=lse_out, need_lse=need_lse, scratch=scratch,
        )
    # Built only here: the torch path (the common CPU one) takes the tensors as they are.
    call = checks.DecodeInputs(
        q, k_cache, indices, topk_length, attn_sink, dims, extra_k_cache, extra_indices,
        extra_topk_length,
    )
    if path == "flashmla":
        checks.check_flashmla_decode(q, k_cache, dims, extra_k_cache, flashmla.capability(q.device))
        o, lse = flashmla.sparse_mla_decode_flashmla(
            call, out=out, lse_out=lse_out, sched_meta=sched_meta
        )
        return o, (lse if need_lse else None)
    # vllm_cpu
    checks.check_decode_index_range(indices, topk_length, dims.layout.num_slots, "indices")
    if dims.extra_layout is not None:
        checks.check_decode_index_range(
            extra_indices, extra_topk_length, dims.extra_layout.num_slots, "extra_indices"
        )
    return vllm_cpu.sparse_mla_decode_vllm_cpu(call, out=out), None


@torch.library.custom_op(
    "vllm_dsv4::sparse_mla_decode", mutates_args=("out", "lse_out", "scratch")
)
def _sparse_mla_decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    softmax_scale: float,
    extra_k_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_topk_length: torch.Tensor | None,
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    scratch: torch.Tensor | None = None,
    kernel: str | None = None,
) -> None:
    """Custom-op form of :func:`sparse_mla_decode`: writes ``out`` (and ``lse_out`` if given;
    without it the lse is not needed, so ``auto`` may pick vLLM's C++ CPU kernel)."""
    _decode_eager(
        q, k_cache, indices, topk_length, attn_sink, softmax_scale, extra_k_cache,
        extra_indices, extra_topk_length, out, lse_out, lse_out is not None, scratch, None,
        kernel,
    )


@_sparse_mla_decode_op.register_fake
def _sparse_mla_decode_fake(
    q, k_cache, indices, topk_length, attn_sink, softmax_scale, extra_k_cache, extra_indices,
    extra_topk_length, out, lse_out, scratch=None, kernel=None,
) -> None:
    return None


def sparse_mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    softmax_scale: float,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    need_lse: bool = True,
    scratch: torch.Tensor | None = None,
    sched_meta: object | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA decode over ``fp8_ds_mla`` paged caches (FlashMLA MODEL1 semantics).

    Args:
        q: bf16 ``[b, s_q, h_q, 512]`` (torch path: any strides; FlashMLA: h_q in {64, 128},
            last dim contiguous).
        k_cache: uint8 ``[num_blocks, B, 584]`` or ``[num_blocks, B, 1, 584]`` fp8_ds_mla
            cache (block-split bytes, ``stride(0)`` may be padded; see
            :mod:`vllm_dsv4_backend.formats.fp8_ds_mla`).
        indices: int32 ``[b, s_q, topk]`` global slot ids ``blk*B + t``. **Only -1 is
            invalid.** Any other id outside ``[0, num_blocks*B)`` within the used prefix is
            rejected with ``ValueError`` on the torch and vllm_cpu paths (one vectorized
            check); FlashMLA does not check (it would read out of bounds).
        topk_length: int32 ``[b]`` or None: only the first ``topk_length[i]`` indices of batch
            row ``i`` (all its ``s_q`` queries) are used.
        attn_sink: fp32 ``[h_q]`` or None: ``p_j = e^{s_j} / (sum_k e^{s_k} + e^{sink})``;
            ``+inf`` zeroes the row, ``-inf`` has no effect; the returned lse excludes it.
        softmax_scale: multiplies ``<q, k>`` (DeepSeek-V4: ``512 ** -0.5``).
        extra_k_cache / extra_indices / extra_topk_length: a second cache with its own block
            size, ``[b, s_q, extra_topk]`` indices and ``[b]`` lengths, attended under the same
            softmax (DeepSeek-V4: SWA window in ``k_cache``, compressed entries here).
        out: optional bf16 ``[b, s_q, h_q, 512]`` written in place (e.g. a workspace view).
        lse_out: optional fp32 ``[b, h_q, s_q]`` written in place.
        need_lse: False lets ``auto`` use vLLM's C++ CPU kernel (no lse) and returns None.
        scratch: optional uint8 1-D buffer for the torch path's intermediates
            (:func:`decode_scratch_nbytes`); with ``out``, ``lse_out`` and ``scratch`` given
            the torch path performs no allocation.
        sched_meta: FlashMLA path only: a ``FlashMLASchedMeta`` reused across same-shaped
            calls in one step.
        kernel: ``auto``, ``torch``, ``vllm_cpu`` or ``flashmla`` (see the module docstring);
            None (default) means the ``VLLM_DSV4_KERNEL`` setting.

    Returns:
        ``(out, lse)``: out bf16 ``[b, s_q, h_q, 512]`` (V = the whole 512-d row), lse fp32
        ``[b, h_q, s_q]`` natural log (None when ``need_lse`` is False). A row with no valid
        index gives ``out = 0`` and ``lse = +inf``.

    Raises:
        ValueError: a bad argument (named, with expected vs received shape/dtype/device).
        RuntimeError: a path forced by ``kernel`` / ``VLLM_DSV4_KERNEL`` cannot serve the call.
    """
    if torch.compiler.is_compiling():
        b, s_q, h = q.shape[0], q.shape[1], q.shape[2]
        if out is None:
            out = q.new_empty(b, s_q, h, q.shape[3])
        if need_lse and lse_out is None:
            lse_out = q.new_empty(b, h, s_q, dtype=torch.float32)
        torch.ops.vllm_dsv4.sparse_mla_decode(
            q, k_cache, indices, topk_length, attn_sink, float(softmax_scale), extra_k_cache,
            extra_indices, extra_topk_length, out, lse_out if need_lse else None, scratch,
            kernel,
        )
        return out, (lse_out if need_lse else None)
    return _decode_eager(
        q, k_cache, indices, topk_length, attn_sink, softmax_scale, extra_k_cache,
        extra_indices, extra_topk_length, out, lse_out, need_lse, scratch, sched_meta, kernel,
    )


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------
def _prefill_eager(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    out: torch.Tensor | None,
    max_logits_out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    scratch: torch.Tensor | None,
    kernel: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dims = checks.check_prefill_args(
        q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits_out, lse_out
    )
    path = kernel_path(q.device, "prefill", kernel=kernel)
    _record("prefill", path)
    if path == "flashmla":
        checks.check_flashmla_prefill(q, kv, dims, flashmla.capability(q.device))
        return flashmla.sparse_mla_prefill_flashmla(
            checks.PrefillInputs(q, kv, indices, dims, attn_sink, topk_length), out=out,
            max_logits_out=max_logits_out, lse_out=lse_out,
        )
    return torch_sparse_mla.sparse_mla_prefill_torch(
        q, kv, indices, dims, attn_sink, topk_length, out=out, max_logits_out=max_logits_out,
        lse_out=lse_out, scratch=scratch,
    )


@torch.library.custom_op(
    "vllm_dsv4::sparse_mla_prefill", mutates_args=("out", "max_logits_out", "lse_out", "scratch")
)
def _sparse_mla_prefill_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    out: torch.Tensor,
    max_logits_out: torch.Tensor,
    lse_out: torch.Tensor,
    scratch: torch.Tensor | None = None,
    kernel: str | None = None,
) -> None:
    """Custom-op form of :func:`sparse_mla_prefill`: writes the three output buffers."""
    _prefill_eager(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits_out,
                   lse_out, scratch, kernel)


@_sparse_mla_prefill_op.register_fake
def _sparse_mla_prefill_fake(
    q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits_out, lse_out, scratch=None,
    kernel=None,
) -> None:
    return None


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    max_logits_out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill over a bf16 KV buffer (FlashMLA ``flash_mla_sparse_fwd`` semantics).

    Args:
        q: bf16 ``[s_q, h_q, 512]`` (no batch axis: concatenate sequences, offset indices).
        kv: bf16 ``[s_kv, 1, 512]`` (dequantized; e.g. gathered from the fp8_ds_mla caches).
        indices: int32 ``[s_q, 1, topk]``; entries ``< 0`` or ``>= s_kv`` are invalid.
        sm_scale: multiplies ``<q, k>``.
        attn_sink: fp32 ``[h_q]`` or None (same conventions as decode).
        topk_length: int32 ``[s_q]`` or None: only the first n indices of each row are used.
        out: optional bf16 ``[s_q, h_q, 512]``; max_logits_out / lse_out: optional fp32
            ``[s_q, h_q]``; all written in place.
        scratch: optional uint8 1-D buffer for the torch path (:func:`prefill_scratch_nbytes`).
        kernel: ``auto``, ``torch`` or ``flashmla``; None (default) means the
            ``VLLM_DSV4_KERNEL`` setting.

    Returns:
        ``(out, max_logits, lse)``: max_logits and lse fp32 ``[s_q, h_q]`` in natural units
        (max over ``sm_scale * <q, k>``); a row with no valid index gives ``out = 0``,
        ``max_logits = -inf``, ``lse = +inf``.

    Raises:
        ValueError: a bad argument. RuntimeError: a forced path cannot serve the call.
    """
    if torch.compiler.is_compiling():
        s_q, h = q.shape[0], q.shape[1]
        if out is None:
            out = q.new_empty(s_q, h, q.shape[2])
        if max_logits_out is None:
            max_logits_out = q.new_empty(s_q, h, dtype=torch.float32)
        if lse_out is None:
            lse_out = q.new_empty(s_q, h, dtype=torch.float32)
        torch.ops.vllm_dsv4.sparse_mla_prefill(
            q, kv, indices, float(sm_scale), attn_sink, topk_length, out, max_logits_out, lse_out,
            scratch, kernel,
        )
        return out, max_logits_out, lse_out
    return _prefill_eager(q, kv, indices, sm_scale, attn_sink, topk_length, out,
                          max_logits_out, lse_out, scratch, kernel)
