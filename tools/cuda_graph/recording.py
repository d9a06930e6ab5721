# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Recording stand-ins for vLLM's kernel objects, held to the real signatures.

``build_stub.py`` copies this file into the stand-in ``vllm`` package as
``vllm/_harness_recording.py`` and binds every kernel object that the
plugin's adapter (``layer.cuda_kernels.VllmCudaKernels``) and vLLM's own
layer both call, at the module names both import them from, to a
:class:`Kernel`. Each one

* binds the call to the real kernel's signature (read from vLLM's source by
  ``build_stub.py``: parameter names, kinds and defaults), so an unknown,
  missing or doubled argument fails as it would on a GPU
  (:class:`ContractError`);
* applies the interface checks the real kernel documents (``checks``: FlashMLA's
  ``out`` contiguous and of ``q``'s dtype and shape, for example);
* computes, through the harness's torch stand-ins (``standins.py``);
* records the kernel, the bound argument names, each tensor's shape, dtype,
  strides, storage offset, 16-byte alignment and whether its bytes are the
  plugin's workspace, the launching stream (named by first use) and the
  micro-batch.

:func:`contract_diff` compares two traces (the plugin's layer and vLLM's, the
same mode, seed and steps): the same kernels in the same order on the same
streams with the same metadata, except where the plugin's tensor lives in the
workspace (its storage offset is the lease's; it must still be 16-byte
aligned).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

# The calls of the current run, in issue order (all threads).
TRACE: list[dict[str, Any]] = []
# The current step (set by the harness; None outside a step: capture, warm-up).
CONTEXT: dict[str, Any] = {"step": None}
# data_ptrs of the plugin's workspace storages (set by the harness after reserve).
WORKSPACE_STORAGES: set[int] = set()
_STREAMS: dict[int, str] = {}
_LOCK = threading.Lock()
ALIGN = 16


class ContractError(TypeError):
    """A call the real kernel would refuse (signature or documented interface)."""


def reset() -> None:
    with _LOCK:
        TRACE.clear()
        _STREAMS.clear()
        CONTEXT["step"] = None


def take() -> list[dict[str, Any]]:
    with _LOCK:
        out = list(TRACE)
    reset()
    return out


def _stream_name() -> str:
    try:
        s = torch.cuda.current_stream()
    except (AssertionError, RuntimeError):  # CPU-only mode: no streams at all
        return "host"
    key = id(s)
    if key not in _STREAMS:
        _STREAMS[key] = f"s{len(_STREAMS)}"
    return _STREAMS[key]


def _ubatch() -> int:
    try:
        from vllm.v1.worker.ubatching import dbo_current_ubatch_id
    except ImportError:
        return 0
    return int(dbo_current_ubatch_id())


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (AssertionError, RuntimeError):
        return False


def describe(value: Any) -> Any:
    """What the contract compares of one argument."""
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
                "strides": list(value.stride()), "storage_offset": value.storage_offset(),
                "aligned16": value.data_ptr() % ALIGN == 0,
                "workspace": value.untyped_storage().data_ptr() in WORKSPACE_STORAGES}
    if isinstance(value, (tuple, list)):
        return [describe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    return f"<{type(value).__name__}>"


class Kernel:
    """One of vLLM's kernel objects, computing through a stand-in.

    ``signature``: a function with the real kernel's parameters (``self``
    dropped). ``compute``: the stand-in, called with every bound argument by
    name (defaults applied). ``checks``: the real kernel's documented interface
    checks, called like ``compute`` before it; they raise :class:`ContractError`.
    ``attrs``: attributes the real object carries (``state_block_size``)."""

    def __init__(self, name: str, signature: Callable[..., Any], compute: Callable[..., Any],
                 checks: Iterable[Callable[..., None]] = (), **attrs: Any) -> None:
        self.name = name
        self.signature = inspect.signature(signature)
        self.compute = compute
        self.checks = tuple(checks)
        for k, v in attrs.items():
            setattr(self, k, v)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ContractError(f"{self.name}{self.signature}: {e}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for check in self.checks:
            check(**arguments)
        entry = {"kernel": self.name, "step": CONTEXT["step"], "ubatch": _ubatch(),
                 "stream": _stream_name(), "capturing": _capturing(),
                 "args": {k: describe(v) for k, v in arguments.items()}}
        result = self.compute(**arguments)
        # An output the caller left to the kernel (C128 compress without
        # compressed_kv): the tensor it returned.
        for k, v in arguments.items():
            if v is None and isinstance(result, torch.Tensor) and k in getattr(
                    self.compute, "allocates", ()):
                entry["args"][k] = describe(result)
        with _LOCK:
            TRACE.append(entry)
        return result


def _same(a: Any, b: Any) -> bool:
    """Whether the plugin's argument ``a`` keeps vLLM's ``b``'s contract."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.get("workspace") or b.get("workspace"):
            keys = ("shape", "dtype", "strides")
            return all(a[k] == b[k] for k in keys) and bool(a["aligned16"])
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def contract_diff(plugin: list[dict[str, Any]], vllm: list[dict[str, Any]],
                  limit: int = 20) -> list[str]:
    """Every difference between the two traces, per micro-batch in issue order
    (empty: the plugin's layer calls vLLM's kernels exactly as vLLM's does)."""
    out: list[str] = []
    ubatches = sorted({e["ubatch"] for e in plugin} | {e["ubatch"] for e in vllm})
    for u in ubatches:
        p = [e for e in plugin if e["ubatch"] == u]
        v = [e for e in vllm if e["ubatch"] == u]
        if len(p) != len(v):
            out.append(f"ubatch {u}: {len(p)} kernel calls, vLLM's layer {len(v)}: plugin "
                       f"{[e['kernel'] for e in p][:12]} vs vLLM {[e['kernel'] for e in v][:12]}")
        for i, (a, b) in enumerate(zip(p, v)):
            where = f"ubatch {u} call {i} (step {b['step']})"
            for key in ("kernel", "stream", "capturing"):
                if a[key] != b[key]:
                    out.append(f"{where}: {key} {a[key]!r}, vLLM's layer {b[key]!r}")
            if a["kernel"] != b["kernel"]:
                continue
            if set(a["args"]) != set(b["args"]):
                out.append(f"{where} {a['kernel']}: arguments {sorted(a['args'])}, vLLM's "
                           f"layer {sorted(b['args'])}")
                continue
            for k in a["args"]:
                if not _same(a["args"][k], b["args"][k]):
                    out.append(f"{where} {a['kernel']}({k}=): {a['args'][k]}, vLLM's layer "
                               f"{b['args'][k]}")
            if len(out) >= limit:
                return out[:limit]
    return out[:limit]


# --- the real kernels' documented interface checks ---------------------------------


def _fail(kernel: str, what: str) -> None:
    raise ContractError(f"{kernel}: {what}")


def flash_mla_out_check(*, q: torch.Tensor, out: torch.Tensor | None, head_dim_v: int,
                        **_: Any) -> None:
    """FlashMLA's ``out``: (batch_size, seq_len_q, num_heads_q, head_dim_v), q's
    dtype, contiguous (``flash_mla_interface.flash_mla_with_kvcache``)."""
    if q.dim() != 4:
        _fail("flash_mla_with_kvcache", f"q must be 4-D (b, s_q, h_q, d), got {tuple(q.shape)}")
    if head_dim_v != 512:
        _fail("flash_mla_with_kvcache", f"head_dim_v must be 512, got {head_dim_v}")
    if out is None:
        return
    want = (*q.shape[:3], head_dim_v)
    if tuple(out.shape) != want or out.dtype != q.dtype or not out.is_contiguous():
        _fail("flash_mla_with_kvcache",
              f"out must be {want} {q.dtype} contiguous, got {tuple(out.shape)} {out.dtype} "
              f"strides {out.stride()}")


def sparse_indices_check(*, q: torch.Tensor, indices: torch.Tensor | None,
                         topk_length: torch.Tensor | None,
                         extra_indices_in_kvcache: torch.Tensor | None,
                         extra_topk_length: torch.Tensor | None, **_: Any) -> None:
    """FlashMLA's sparse indices: (b, s_q, topk) int32; lengths (b,) int32."""
    b = q.shape[0]
    for name, t in (("indices", indices), ("extra_indices_in_kvcache",
                                           extra_indices_in_kvcache)):
        if t is not None and (t.dim() != 3 or t.shape[0] != b or t.dtype != torch.int32
                              or t.stride(-1) != 1):
            _fail("flash_mla_with_kvcache", f"{name} must be (b={b}, s_q, topk) int32 with "
                  f"unit last stride, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    for name, t in (("topk_length", topk_length), ("extra_topk_length", extra_topk_length)):
        if t is not None and (tuple(t.shape) != (b,) or t.dtype != torch.int32):
            _fail("flash_mla_with_kvcache",
                  f"{name} must be ({b},) int32, got {tuple(t.shape)} {t.dtype}")


def unit_last_stride_check(kernel: str, *names: str) -> Callable[..., None]:
    """The Triton and CuTe DSL kernels take their tensors' leading strides as
    arguments and index the last dimension densely: a last stride other than 1
    would be read or written out of place."""

    def check(**arguments: Any) -> None:
        for n in names:
            t = arguments.get(n)
            if isinstance(t, torch.Tensor) and t.dim() and t.stride(-1) != 1:
                _fail(kernel, f"{n} must have a unit last stride, got shape {tuple(t.shape)} "
                      f"strides {t.stride()}")

    return check
