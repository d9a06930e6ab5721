# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One-thread GEMMs where a result's rounding must not depend on the rest of the call.

MKL (torch's CPU BLAS) splits a GEMM that is alone in its call, a one-matrix ``bmm`` or an
``mm``, across its threads, and the split depends on the shape; with MKL's AVX2 kernels
(``scripts/as_avx2.sh``, and AVX2 machines) the split changes the rounding: 1 to 9 ulp
between an indexer row or a sparse-MLA row computed alone and the same row inside a batch.
A ``bmm`` of at least as many matrices as threads gives each matrix one thread, and a GEMM
on one thread rounds the same whatever its batch or row count (measured on AVX2 and
AVX512). :func:`gemm_one_thread` runs the lone GEMMs that way (MKL's thread-local setting,
``mkl_set_num_threads_local``), so the torch sparse MLA and indexer give a row the same bits
alone or in any batch. (MKL's strict reproducibility mode, ``MKL_CBWR=AUTO,STRICT``, is no
substitute: on AVX512 it makes the indexer's batched and lone GEMMs differ instead.)

The cost is the lone GEMM's second thread: at batch 1 the torch paths are bound by Python
dispatch, not by those GEMMs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator

import torch

from vllm_dsv4_backend._logging import init_logger

__all__ = ["gemm_one_thread", "lone_gemm"]

logger = init_logger(__name__)


@functools.lru_cache(maxsize=1)
def _set_local_threads() -> Callable[[int], int] | None:
    """``mkl_set_num_threads_local`` of the MKL linked into torch, or None without MKL."""
    if not torch.backends.mkl.is_available():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = ctypes.CDLL(path).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError) as e:
        logger.warning(
            "torch's MKL does not export mkl_set_num_threads_local (%s): lone GEMMs of the "
            "torch sparse MLA / indexer keep MKL's thread split, so their rounding may depend "
            "on the batch (by ulps)", e)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int]
    return fn


def lone_gemm(batch: int, device: torch.device) -> bool:
    """True when a ``bmm`` of ``batch`` matrices on ``device`` would give MKL spare threads
    to split one matrix with (so :func:`gemm_one_thread` should wrap it)."""
    return device.type == "cpu" and batch < torch.get_num_threads()


@contextlib.contextmanager
def gemm_one_thread(enabled: bool = True) -> Iterator[None]:
    """MKL runs the GEMMs issued inside on this thread alone (no-op when not ``enabled``
    or without MKL); the previous thread-local setting is restored on exit."""
    fn = _set_local_threads() if enabled else None
    if fn is None:
        yield
        return
    prev = fn(1)
    try:
        yield
    finally:
        fn(prev)
