# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``VllmCudaKernels``' indexer-q dispatch: the arguments it hands vLLM's CuTe DSL
kernels (when ``has_cutedsl()``) and their Triton twins (otherwise), as vLLM 0.33's /
0.34's ``fused_indexer_q_rope_quant`` hands them.

The kernel modules cannot be imported on CPU (the CuTe DSL ones import ``cutlass`` and
initialise the CUDA driver; the Triton ones need Triton's CUDA backend), so recording
stand-ins are put in their place in ``sys.modules``: a test double for what cannot exist
here, checking the call, not the kernel."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from tests.support.cuda_guard import require_vllm_cuda

require_vllm_cuda()

import vllm.utils.import_utils as import_utils  # noqa: E402

from vllm_dsv4_backend.layer.cuda import KERNEL_SIGNATURES  # noqa: E402
from vllm_dsv4_backend.layer.cuda_kernels import VllmCudaKernels  # noqa: E402

CUTE = "vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl"
TRITON = "vllm.models.deepseek_v4.common.ops.fused_indexer_q"
KERNELS = {
    CUTE: ("_INDEXER_Q_FP8_KERNEL", "_INDEXER_Q_MXFP4_KERNEL"),
    TRITON: ("_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL",
             "_FUSED_INDEXER_Q_ROPE_MXFP4_TRITON_KERNEL"),
}


# The kernel object behind each module global; KERNEL_SIGNATURES holds its ``__call__``
# parameters as read from the installed vLLM's source (checked by test_structure).
CLASSES = {
    "_INDEXER_Q_FP8_KERNEL": "IndexerQFp8Kernel",
    "_INDEXER_Q_MXFP4_KERNEL": "IndexerQMxFp4Kernel",
    "_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL": "FusedIndexerQRopeQuantTritonKernel",
    "_FUSED_INDEXER_Q_ROPE_MXFP4_TRITON_KERNEL": "FusedIndexerQRopeMxFp4TritonKernel",
}


def _binds(name: str, args: tuple, kw: dict) -> None:
    """The recorded call fills exactly vLLM's parameters of that kernel."""
    [params] = [p for _, q, p in KERNEL_SIGNATURES if q == f"{CLASSES[name]}.__call__"]
    assert len(args) + len(kw) == len(params), (name, params)
    assert set(kw) == set(params[len(args):]), (name, params)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple, dict]]:
    seen: list[tuple[str, tuple, dict]] = []
    for module, names in KERNELS.items():
        fake = types.ModuleType(module)
        for name in names:
            setattr(fake, name,
                    lambda *a, _n=name, **kw: seen.append((_n, a, kw)))
        monkeypatch.setitem(sys.modules, module, fake)
    return seen


def _common() -> dict[str, Any]:
    return dict(positions=torch.arange(3), q=torch.zeros(3, 4, 128, dtype=torch.bfloat16),
                cos_sin_cache=torch.zeros(16, 64), weights=torch.zeros(3, 4),
                weights_softmax_scale=0.125, weights_head_scale=0.5,
                weights_out=torch.zeros(3, 4))


@pytest.mark.parametrize("cutedsl", [True, False], ids=["cutedsl", "triton"])
def test_indexer_q_fp8_dispatch(calls, monkeypatch: pytest.MonkeyPatch, cutedsl: bool) -> None:
    monkeypatch.setattr(import_utils, "has_cutedsl", lambda: cutedsl)
    c = _common()
    q_fp8 = torch.zeros(3, 4, 128, dtype=torch.float8_e4m3fn)
    VllmCudaKernels().indexer_q_fp8(**c, q_fp8=q_fp8)
    [(name, args, kw)] = calls
    _binds(name, args, kw)
    if cutedsl:
        assert name == "_INDEXER_Q_FP8_KERNEL" and args == ()
        assert kw["q_fp8"].dtype == torch.uint8  # the CuTe DSL kernel takes bytes
        assert kw["q_fp8"].data_ptr() == q_fp8.data_ptr()
        assert {k: v for k, v in kw.items() if k != "q_fp8"} == c
    else:
        assert name == "_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL"
        order = ("positions", "q", "cos_sin_cache", "weights", "weights_softmax_scale",
                 "weights_head_scale")
        assert args[:6] == tuple(c[k] for k in order)
        assert args[6] is q_fp8 and args[7] is c["weights_out"] and len(args) == 8
        assert kw == {"fp8_max": 448.0, "use_fnuz": False}


@pytest.mark.parametrize("cutedsl", [True, False], ids=["cutedsl", "triton"])
def test_indexer_q_mxfp4_dispatch(calls, monkeypatch: pytest.MonkeyPatch,
                                  cutedsl: bool) -> None:
    monkeypatch.setattr(import_utils, "has_cutedsl", lambda: cutedsl)
    c = _common()
    q_packed = torch.zeros(3, 4, 64, dtype=torch.uint8)
    q_scale = torch.zeros(3, 4, 4, dtype=torch.uint8)
    VllmCudaKernels().indexer_q_mxfp4(**c, q_packed=q_packed, q_scale=q_scale)
    [(name, args, kw)] = calls
    _binds(name, args, kw)
    if cutedsl:
        assert name == "_INDEXER_Q_MXFP4_KERNEL" and args == ()
        assert kw == {**c, "q_packed": q_packed, "q_scale": q_scale}
    else:
        assert name == "_FUSED_INDEXER_Q_ROPE_MXFP4_TRITON_KERNEL" and kw == {}
        order = ("positions", "q", "cos_sin_cache", "weights", "weights_softmax_scale",
                 "weights_head_scale")
        assert args[:6] == tuple(c[k] for k in order)
        assert args[6:] == (q_packed, q_scale, c["weights_out"])


def test_every_kernel_double_implements_the_layer_protocol() -> None:
    """vLLM's kernel objects and the stream tests' double are one typed interface
    (``layer.cuda_kernels.CudaKernels``): a method the layer starts calling must
    exist on both, with the protocol's parameters (no ``**kwargs``). The graph
    harness runs ``VllmCudaKernels`` itself (recording stand-ins bound to the real
    kernels' signatures: ``tools/cuda_graph/recording.py``)."""
    import inspect

    from tests.support.layer_streams import TorchKernels
    from vllm_dsv4_backend.layer.cuda_kernels import CudaKernels

    names = {n for n in dir(CudaKernels) if not n.startswith("_")}
    for cls in (VllmCudaKernels, TorchKernels):
        assert names <= {n for n in dir(cls) if not n.startswith("_")}, cls
    assert isinstance(VllmCudaKernels(), CudaKernels)
    for n in names:
        want = inspect.signature(getattr(CudaKernels, n))
        assert not any(p.kind is p.VAR_KEYWORD for p in want.parameters.values()), n
        assert inspect.signature(getattr(VllmCudaKernels, n)) == want, n
