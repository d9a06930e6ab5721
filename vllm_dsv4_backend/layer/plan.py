# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-V4's workspace buffers, declared once: the families and their
views (:func:`family_views`), the lease plan of each platform's layer
(:data:`LEASE_PLAN`) and the one builder of the workspace config
(:func:`build_workspace_config`), which serving
(:func:`vllm_dsv4_backend.layer.core.workspace_config`), the sizing report
(:mod:`vllm_dsv4_backend.layer.sizing`), the docs' figures and the CUDA graph
harness all call. The workspace (:mod:`vllm_dsv4_backend.workspace`) is the
mechanism and names none of this.

=============  ===========  ==========================================  ==========
family         view         per token (T rows in all), dtype            kinds
=============  ===========  ==========================================  ==========
``q``          ``q``        ``[Hp, D]`` bf16 padded q (pad heads zero)  all
               ``out``      ``[Hp, D]`` bf16 attention output
``indexer_q``  ``q``        fp8: ``[Hi, Di]`` float8_e4m3fn             C4
                            mxfp4: ``[Hi, Di/2]`` uint8, two e2m1 per
                            byte, even index in the low nibble
               ``scales``   mxfp4 only: ``[Hi, Di/32]`` uint8 ue8m0
               ``weights``  ``[Hi]`` float32 head weights
``topk``       ``local``    ``[K]`` int32 local compressed ids (-1 pad) C4
               ``global``   ``[K]`` int32 global KV slot ids (-1 pad)
               ``lens``     ``[]`` int32 valid entries per row
``compressor`` ``scratch``  ``[D]`` float32 compressor scratch          C4, C128
=============  ===========  ==========================================  ==========

``Hp`` = padded q heads, ``D`` = ``head_dim`` (512), ``Hi`` x ``Di`` =
indexer heads x head dim (64 x 128), ``K`` = ``index_topk``. Kinds follow
vLLM's ``compress_ratio`` (``formats.constants.layer_kind``); the workspace's
layer kinds are the compress ratios, so a layer registers with its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from vllm_dsv4_backend.formats.constants import INDEXER_KV_DTYPES, LAYER_KINDS, layer_kind
from vllm_dsv4_backend.workspace.sizing import BufferSpec, FamilySpec, WorkspaceConfig

__all__ = [
    "DSV4_FLASH_HF_CONFIG",
    "LEASE_PLAN",
    "Dims",
    "build_workspace_config",
    "dims_from_hf_config",
    "family_views",
    "padded_q_heads",
]

Plan = Mapping[str, Mapping[str, tuple[str, ...]]]  # kind -> family -> views

# The indexer q: values, MXFP4's ue8m0 scales (FP8 has no scales view, so
# nothing is reserved for it there) and the head weights; written by the
# platform's q-quant kernel on both platforms.
_INDEXER_Q = ("q", "scales", "weights")

# platform -> indexer K cache dtype -> layer kind -> family -> views: what
# each layer really leases (tests/cuda/test_layer_streams.py and
# tests/vllm/test_lease_plan_served.py compare it with the leases taken).
# Neither layer leases ``topk.local``: both write the local ids into vLLM's
# model-wide ``topk_indices_buffer``. Every layer leases ``q.out`` (vLLM's
# per-layer attention output); the padded q comes back from vLLM's fused
# q-norm/RoPE/KV-insert kernel (no output argument) on both platforms.
LEASE_PLAN: dict[str, dict[str, Plan]] = {
    # CPU: topk.global is the page-id output topk_transform_512_cpu must
    # write (FP8) or the plugin's MXFP4 top-k's global ids, with lens; the
    # compressors' state goes to vLLM's caches (no scratch on CPU).
    "cpu": {
        "fp8": {
            "swa": {"q": ("out",)},
            "c4": {"q": ("out",), "indexer_q": _INDEXER_Q, "topk": ("global",)},
            "c128": {"q": ("out",)},
        },
        "mxfp4": {
            "swa": {"q": ("out",)},
            "c4": {"q": ("out",), "indexer_q": _INDEXER_Q, "topk": ("global", "lens")},
            "c128": {"q": ("out",)},
        },
    },
    # CUDA: C4 decode's global top-k and lengths through vLLM's kernel
    # object; C128's compressor fp32 scratch (C4's compressors allocate
    # nothing the plugin replaces).
    "cuda": dict.fromkeys(("fp8", "mxfp4"), {
        "swa": {"q": ("out",)},
        "c4": {"q": ("out",), "indexer_q": _INDEXER_Q, "topk": ("global", "lens")},
        "c128": {"q": ("out",), "compressor": ("scratch",)},
    }),
}

# DeepSeek-V4-Flash, from its HF config.json (43 layers + 1 MTP entry).
DSV4_FLASH_HF_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],
}


@dataclasses.dataclass(frozen=True)
class Dims:
    """The model dimensions the families are built from (one rank's view)."""

    num_local_heads: int
    padded_q_heads: int
    head_dim: int = 512
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f.name}: expected a positive int, got {v!r}")
        if self.padded_q_heads < self.num_local_heads:
            raise ValueError(f"padded_q_heads: expected >= num_local_heads "
                             f"({self.num_local_heads}), got {self.padded_q_heads}")


def family_views(dims: Dims, indexer_kv_dtype: str) -> dict[str, tuple[BufferSpec, ...]]:
    """Every view of every family (the module docstring's table), in storage order."""
    hp, d = dims.padded_q_heads, dims.head_dim
    hi, di, k = dims.index_n_heads, dims.index_head_dim, dims.index_topk
    if indexer_kv_dtype == "fp8":
        indexer_q = (BufferSpec("q", (hi, di), torch.float8_e4m3fn),)
    else:
        indexer_q = (BufferSpec("q", (hi, di // 2), torch.uint8),
                     BufferSpec("scales", (hi, di // 32), torch.uint8))
    return {
        "q": (BufferSpec("q", (hp, d), torch.bfloat16),
              BufferSpec("out", (hp, d), torch.bfloat16)),
        "indexer_q": (*indexer_q, BufferSpec("weights", (hi,), torch.float32)),
        "topk": (BufferSpec("local", (k,), torch.int32),
                 BufferSpec("global", (k,), torch.int32),
                 BufferSpec("lens", (), torch.int32)),
        "compressor": (BufferSpec("scratch", (d,), torch.float32),),
    }


def _check_plan(plan: Plan, every: Mapping[str, tuple[BufferSpec, ...]]) -> None:
    views_of: dict[str, tuple[str, ...]] = {}
    for kind, fams in plan.items():
        if kind not in set(LAYER_KINDS.values()):
            raise ValueError(f"lease plan: unknown layer kind {kind!r}; expected one of "
                             f"{tuple(dict.fromkeys(LAYER_KINDS.values()))}")
        for fam, views in fams.items():
            if fam not in every:
                raise ValueError(f"lease plan: unknown family {fam!r}; expected one of "
                                 f"{tuple(every)}")
            known = ("q", "scales", "weights") if fam == "indexer_q" else \
                tuple(v.name for v in every[fam])
            bad = [v for v in views if v not in known]
            if bad or not views:
                raise ValueError(f"lease plan: family {fam!r} views {views!r}; expected a "
                                 f"non-empty subset of {known}")
            if views_of.setdefault(fam, tuple(views)) != tuple(views):
                raise ValueError(f"lease plan: family {fam!r} has views {views_of[fam]} in "
                                 f"one kind and {views} in another (a family's slots are "
                                 "shared between kinds)")


def build_workspace_config(
    dims: Dims,
    *,
    max_num_batched_tokens: int,
    indexer_kv_dtype: str,
    platform: str = "cuda",
    plan: Plan | None = None,
    num_ubatches: int = 1,
    compress_ratios: tuple[int, ...] = (),
) -> WorkspaceConfig:
    """The workspace config of one DeepSeek-V4 model on one rank: the families
    and views ``platform``'s :data:`LEASE_PLAN` leases (``plan`` instead, for
    tests of the mechanism), keyed by compress ratio. A view the indexer dtype
    does not have (``scales`` under FP8) is not reserved."""
    if indexer_kv_dtype not in INDEXER_KV_DTYPES:
        raise ValueError(f"indexer_kv_dtype: expected one of {INDEXER_KV_DTYPES}, "
                         f"got {indexer_kv_dtype!r}")
    if indexer_kv_dtype == "mxfp4" and dims.index_head_dim % 32:
        raise ValueError("index_head_dim: MXFP4 needs a multiple of 32 (one ue8m0 scale per "
                         f"32 values), got {dims.index_head_dim}")
    source = "custom" if plan is not None else platform
    if plan is None:
        try:
            plan = LEASE_PLAN[platform][indexer_kv_dtype]
        except KeyError:
            raise ValueError(f"lease plan: expected a platform in {sorted(LEASE_PLAN)}, "
                             f"got {platform!r}") from None
    every = family_views(dims, indexer_kv_dtype)
    _check_plan(plan, every)
    families = []
    for fam, specs in every.items():
        planned = next((fams[fam] for fams in plan.values() if fam in fams), ())
        views = tuple(s for s in specs if s.name in planned)
        if views:
            families.append(FamilySpec(fam, views))
    ratios = tuple(compress_ratios)
    for r in ratios:
        layer_kind(r)
    return WorkspaceConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        families=tuple(families),
        kinds={r: tuple(plan.get(kind, {})) for r, kind in LAYER_KINDS.items()},
        num_ubatches=num_ubatches,
        layer_kinds=ratios,
        kind_labels={r: kind.upper() for r, kind in LAYER_KINDS.items()},
        params={**dataclasses.asdict(dims), "indexer_kv_dtype": indexer_kv_dtype,
                "plan": source},
    )


def padded_q_heads(local_heads: int) -> int:
    """Number of q heads the attention kernel needs for ``local_heads`` heads.

    FlashMLA's sparse FP8 decode kernel only runs with 64 or 128 q heads, so
    ``local_heads <= 64`` pads to 64 and ``65..128`` to 128 (vLLM's
    ``get_padded_num_q_heads``); more than 128 is an error.
    """
    if not isinstance(local_heads, int) or isinstance(local_heads, bool) or local_heads < 1:
        raise ValueError(f"local_heads: expected a positive int, got {local_heads!r}")
    if local_heads <= 64:
        return 64
    if local_heads <= 128:
        return 128
    raise ValueError(
        f"local_heads: FlashMLA supports at most 128 q heads per rank, got {local_heads}; "
        "raise tensor parallelism"
    )


def dims_from_hf_config(
    hf_config: Any, *, tp_size: int, padded_heads: int | None = None
) -> tuple[Dims, tuple[int, ...]]:
    """The dimensions of one rank and the compress ratios of the attention
    layers, from a DeepSeek-V4 HF config (object or dict; ``compress_ratios``
    may carry MTP entries after the first ``num_hidden_layers``: dropped).
    ``padded_heads`` overrides ``padded_q_heads(local)``."""

    def get(name: str) -> Any:
        v = hf_config.get(name) if isinstance(hf_config, Mapping) else getattr(
            hf_config, name, None)
        if v is None:
            raise ValueError(f"hf_config: missing DeepSeek-V4 attribute {name!r}")
        return v

    heads = int(get("num_attention_heads"))
    if not isinstance(tp_size, int) or tp_size < 1 or heads % tp_size:
        raise ValueError(f"tp_size: expected a positive divisor of num_attention_heads="
                         f"{heads}, got {tp_size!r}")
    local = heads // tp_size
    num_layers = int(get("num_hidden_layers"))
    ratios = [int(r) for r in get("compress_ratios")]
    if len(ratios) < num_layers:
        raise ValueError(f"hf_config.compress_ratios: expected >= num_hidden_layers="
                         f"{num_layers} entries, got {len(ratios)}")
    dims = Dims(
        num_local_heads=local,
        padded_q_heads=padded_heads if padded_heads is not None
        else padded_q_heads(local),
        head_dim=int(get("head_dim")),
        index_n_heads=int(get("index_n_heads")),
        index_head_dim=int(get("index_head_dim")),
        index_topk=int(get("index_topk")),
    )
    return dims, tuple(ratios[:num_layers])
