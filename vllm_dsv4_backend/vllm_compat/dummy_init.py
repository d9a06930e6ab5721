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

Tensor parallelism: :func:`init_model_` makes the weights independent of the
TP size. A sharded parameter's *whole* logical tensor is generated (from its
name and full shape, ``fan_in`` = the full input features) and handed to the
parameter's own vLLM ``weight_loader``, which keeps this rank's shard exactly
as it would from a checkpoint: linear layers (one tensor per output of a
merged layer), vocab embeddings / LM head, routed experts (one tensor per
global expert and ``w1``/``w2``/``w3``), and the attention sink (heads
``[rank * n_local, (rank + 1) * n_local)``, padding slots keep their -inf).
So TP 1 and TP 2 serve the same model. Other parameters are replicated and
initialised in place; the hash router table (``tid2eid``) gets seeded
``randint(0, n_routed_experts)`` like vLLM's own.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "MARKER_KEY",
    "DummyInitSpec",
    "init_fan_in_normal_",
    "init_model_",
    "init_tensor_",
    "spec_from_config",
]

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


def _full(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The whole logical fp32 tensor ``name`` of ``shape`` (same on every rank)."""
    t = torch.empty(shape, dtype=torch.float32)
    init_tensor_(name, t, seed)
    return t


def _load_linear(module: Any, name: str, param: torch.Tensor, seed: int) -> None:
    in_size = module.input_size
    sizes = getattr(module, "output_sizes", None)
    if sizes:  # merged column-parallel: one checkpoint tensor per output
        for i, size in enumerate(sizes):
            param.weight_loader(param, _full(f"{name}[{i}]", (size, in_size), seed), i)
    else:
        param.weight_loader(param, _full(name, (module.output_size, in_size), seed))


def _load_experts(module: Any, name: str, pname: str, param: torch.Tensor, seed: int) -> None:
    cfg = module.moe_config
    n_exp, hidden, inter = cfg.num_logical_experts, cfg.hidden_dim, cfg.intermediate_size
    shards = (("w1", (inter, hidden)), ("w3", (inter, hidden))) if pname == "w13_weight" \
        else (("w2", (hidden, inter)),)
    for e in range(n_exp):
        for shard, shape in shards:
            param.weight_loader(param, _full(f"{name}[{e}].{shard}", shape, seed), name,
                                shard_id=shard, expert_id=e, return_success=True)


def init_model_(
    model: torch.nn.Module,
    *,
    seed: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    num_heads: int | None = None,
    num_experts: int | None = None,
) -> dict[str, int]:
    """Initialise a vLLM model's parameters, identically for every TP size (see above).

    Args:
        model: the vLLM model (its parallel layers carry ``weight_loader``).
        seed: the marker's seed.
        tp_rank, tp_size: this rank's tensor-parallel position.
        num_heads: total attention heads (``attn_sink`` narrowing); None: no narrowing.
        num_experts: routed experts (the ``tid2eid`` value range); None: leave it.

    Returns:
        Counts by outcome: ``loaded`` (through a weight loader), ``initialised``
        (in place), ``untouched``.
    """
    stats = {"loaded": 0, "initialised": 0, "untouched": 0}
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                name = f"{mod_name}.{pname}" if mod_name else pname
                outcome = _init_param(module, pname, param, name, seed, tp_rank, tp_size,
                                      num_heads, num_experts)
                stats[outcome] += 1
    return stats


def _init_param(module: Any, pname: str, param: torch.Tensor, name: str, seed: int,
                tp_rank: int, tp_size: int, num_heads: int | None,
                num_experts: int | None) -> str:
    floating = param.dtype.is_floating_point or param.dtype in _FP8_DTYPES
    # Only full-precision weights take the loader path: quantized layouts (packed uint8,
    # block scales) have other shapes and are left to the in-place rules below.
    if param.dtype.is_floating_point and getattr(param, "weight_loader", None) is not None:
        # Embeddings first: they have input_size/output_size too (padded vocab).
        if pname == "weight" and hasattr(module, "org_vocab_size"):
            full = _full(name, (module.org_vocab_size, module.embedding_dim), seed)
            param.weight_loader(param, full)
            return "loaded"
        if pname == "weight" and param.dim() == 2 and hasattr(module, "input_size") \
                and hasattr(module, "output_size"):
            _load_linear(module, name, param, seed)
            return "loaded"
        if pname in ("w13_weight", "w2_weight") and hasattr(module, "moe_config"):
            _load_experts(module, name, pname, param, seed)
            return "loaded"
    if pname == "attn_sink" and num_heads is not None and param.dim() == 1:
        n_local = num_heads // tp_size
        full = _full(name, (num_heads,), seed)
        param[:n_local].copy_(full[tp_rank * n_local : (tp_rank + 1) * n_local])
        param[n_local:].fill_(-math.inf)  # padded heads, as a checkpoint leaves them
        return "initialised"
    if pname == "tid2eid" and num_experts is not None and not floating:
        param.copy_(torch.randint(0, num_experts, tuple(param.shape),
                                  generator=_generator(seed, name)))
        return "initialised"
    return "initialised" if init_tensor_(name, param, seed) else "untouched"
