# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one tensor-argument check of the package (torch only).

At the bottom of the layering (like ``_logging``), so ``formats`` and ``ops``
both use it; :mod:`vllm_dsv4_backend.ops.checks` re-exports it as the public
home. Every failure is a ``ValueError`` naming the argument, what was
expected and what was received (FlashInfer ``check_shape_dtype_device``
style): ``"<name>: expected shape [T, 512], dtype torch.bfloat16, device cpu;
got shape [3, 64], dtype torch.float32, device cpu"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_tensor", "describe", "fmt_shape"]


def fmt_shape(shape: Sequence[int | str | None]) -> str:
    """``[4, *, 512]`` (``None`` is any size)."""
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def describe(t: object) -> str:
    """``shape [..], dtype .., device ..`` of a tensor (the type name of anything else)."""
    if not isinstance(t, torch.Tensor):
        return "None" if t is None else type(t).__name__
    return f"shape {list(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(
    name: str,
    t: object,
    *,
    shape: Sequence[int | None] | None = None,
    ndim: int | Sequence[int] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    min_rows: int | None = None,
    shape_doc: str | None = None,
    where: str | None = None,
) -> torch.Tensor:
    """Return ``t`` if it is a tensor matching every given constraint, else raise.

    Args:
        name: the argument's name (first in the message).
        shape: exact sizes, ``None`` = any size (implies the number of dims).
        ndim: allowed numbers of dims (when ``shape`` is not given).
        dtype: one dtype or the allowed ones.
        device: the required device.
        min_rows: the least ``t.shape[0]``.
        shape_doc: how to print ``shape`` (e.g. ``"[b, s_q, h_q, 512]"``).
        where: the function's name, for ops whose messages start with it
            (``"<where>: argument '<name>': ..."``).

    Raises:
        ValueError: ``"<name>: expected <constraints>; got <shape, dtype, device>"``.
    """
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype or ())
    ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim or ())
    dev = torch.device(device) if device is not None else None
    parts = []
    if shape is not None:
        parts.append(f"shape {shape_doc or fmt_shape(shape)}")
    elif ndims:
        parts.append(f"a {' or '.join(map(str, ndims))}-D tensor")
    if min_rows is not None:
        parts.append(f"at least {min_rows} rows")
    if dtypes:
        parts.append("dtype " + " or ".join(str(d) for d in dtypes))
    if dev is not None:
        parts.append(f"device {dev}")
    expected = ", ".join(parts)
    label = f"{where}: argument '{name}'" if where else name
    if not isinstance(t, torch.Tensor):
        with_ = f" with {expected}" if expected else ""
        raise ValueError(f"{label}: expected a torch.Tensor{with_}; got {describe(t)}")
    ok = (
        (shape is None or (t.dim() == len(shape)
                           and all(s is None or int(d) == int(s) for d, s in zip(t.shape, shape))))
        and (not ndims or t.dim() in ndims)
        and (not dtypes or t.dtype in dtypes)
        and (dev is None or t.device == dev)
        and (min_rows is None or (t.dim() >= 1 and t.shape[0] >= min_rows))
    )
    if not ok:
        raise ValueError(f"{label}: expected {expected}; got {describe(t)}")
    return t
