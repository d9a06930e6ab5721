# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seeded fan-in dummy weights for ``--load-format dummy`` (parity testing).

vLLM's dummy loader fills every float tensor with U(-1e-3, 1e-3): activations
collapse and every logit of a model comes out equal (all logprobs
``-ln(vocab)``), which makes greedy outputs arbitrary and useless for
comparing two attention implementations. A model whose ``config.json``
carries the marker ::

    "vllm_dsv4_dummy_init": {"kind": "fan_in_normal", "seed": 0}

is instead initialised (by the plugin's hook on vLLM's ``DummyModelLoader``,
see :mod:`vllm_dsv4_backend.vllm_compat.loader`) parameter by parameter:

* floating tensors with >= 2 dims: N(0, 1/fan_in), ``fan_in = shape[-1]`` (the
  input features of ``nn.Linear`` weights, per expert for stacked MoE weights;
  the hidden size for embeddings);
* floating 1-D tensors (norm weights, biases, attention sinks, mHC bases and
  scales, router score-correction biases): U(0.9, 1.1), which keeps attention
  sinks finite;
* 0-D floating tensors: 1.0;
* FP8 tensors: the N(0, 1/fan_in) values rounded to the FP8 dtype;
  ``float8_e8m0fnu`` tensors and ``uint8`` tensors whose name contains
  ``scale`` (UE8M0 block scales stored as bytes): 2^0 (byte 127);
* other integer/bool tensors (e.g. the hash router's ``tid2eid``): untouched.

Every tensor gets its own CPU ``torch.Generator`` seeded from the marker's
seed and a CRC32 of the parameter name, so values depend neither on module
order nor on the device: two processes (or a CPU and a CUDA run) get
bit-identical weights. Buffers are left to vLLM's loader.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["MARKER_KEY", "DummyInitSpec", "init_fan_in_normal_", "init_tensor_", "spec_from_config"]

MARKER_KEY = "vllm_dsv4_dummy_init"
KINDS = ("fan_in_normal",)

_FP8_DTYPES = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


class DummyInitSpec:
    """Validated marker: ``kind`` and integer ``seed``."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind = kind
        self.seed = seed

    def __repr__(self) -> str:
        return f"DummyInitSpec(kind={self.kind!r}, seed={self.seed})"


def spec_from_config(hf_config: Any) -> DummyInitSpec | None:
    """Read the marker from a HF config object or dict; None when absent.

    Raises:
        ValueError: the marker is present but malformed (names the key).
    """
    raw = (
        hf_config.get(MARKER_KEY)
        if isinstance(hf_config, dict)
        else getattr(hf_config, MARKER_KEY, None)
    )
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{MARKER_KEY}: expected a dict, got {type(raw).__name__}")
    kind = raw.get("kind", "fan_in_normal")
    if kind not in KINDS:
        raise ValueError(f"{MARKER_KEY}.kind: expected one of {list(KINDS)}, got {kind!r}")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"{MARKER_KEY}.seed: expected an int >= 0, got {seed!r}")
    return DummyInitSpec(kind, seed)


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def init_tensor_(name: str, tensor: torch.Tensor, seed: int) -> bool:
    """Initialise one tensor in place by the rules above; False if left untouched."""
    dtype = tensor.dtype
    if tensor.device.type == "meta":
        return False
    if _E8M0 is not None and dtype == _E8M0:
        tensor.data.copy_(torch.ones(tensor.shape, dtype=torch.float32).to(dtype))
        return True
    if dtype == torch.uint8 and "scale" in name.rsplit(".", 1)[-1]:
        tensor.data.fill_(127)
        return True
    if not (dtype.is_floating_point or dtype in _FP8_DTYPES):
        return False
    shape = tuple(tensor.shape)
    if len(shape) == 0:
        value = torch.ones((), dtype=torch.float32)
    elif len(shape) == 1:
        value = torch.empty(shape, dtype=torch.float32).uniform_(
            0.9, 1.1, generator=_generator(seed, name)
        )
    else:
        fan_in = max(shape[-1], 1)
        value = torch.empty(shape, dtype=torch.float32).normal_(
            0.0, fan_in**-0.5, generator=_generator(seed, name)
        )
    tensor.data.copy_(value.to(dtype) if dtype in _FP8_DTYPES else value)
    return True


def init_fan_in_normal_(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, seed: int
) -> dict[str, int]:
    """Initialise every tensor of ``named_tensors``; returns counts by outcome."""
    stats = {"initialised": 0, "untouched": 0}
    with torch.no_grad():
        for name, tensor in named_tensors:
            stats["initialised" if init_tensor_(name, tensor, seed) else "untouched"] += 1
    return stats
