# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Workspace sizing for the DeepSeek-V4 attention eager region (torch only).

Everything the eager region of one DeepSeek-V4 attention layer writes per step
is grouped into four *families*. Every buffer is token-major: row ``t`` belongs
to token ``t`` and a lease for ``T`` tokens is the prefix ``[:T]`` of a buffer
reserved for ``max_num_batched_tokens`` rows, so its address never moves.

=============  ==============  =========================================  ===========
family         view            shape, dtype (T = tokens of the lease)     layer types
=============  ==============  =========================================  ===========
``q``          ``q``           ``[T, Hp, D]`` bf16 (padded q; pad heads   all
                               zero); ``D`` = ``head_dim`` (512)
               ``out``         ``[T, Hp, D]`` bf16 attention output, only
                               if ``WorkspaceConfig.include_attn_out``
``indexer_q``  ``q``           fp8: ``[T, Hi, Di]`` float8_e4m3fn         C4
                               mxfp4: ``[T, Hi, Di/2]`` uint8, two e2m1
                               per byte, even index in the low nibble
               ``scales``      mxfp4 only: ``[T, Hi, Di/32]`` uint8 ue8m0
               ``weights``     ``[T, Hi]`` float32 head weights
``topk``       ``local``       ``[T, K]`` int32 local compressed indices  C4
                               (-1 pad), ``K`` = ``index_topk``
               ``global``      ``[T, K]`` int32 global KV slot ids (-1)
               ``lens``        ``[T]`` int32 valid entries per row
``compressor`` ``scratch``     ``[T, D]`` float32 compressor scratch      C4, C128
=============  ==============  =========================================  ===========

``Hp`` = padded q heads, ``Hi`` x ``Di`` = indexer heads x head dim (64 x 128).
Within a family's region each view starts at a 256-byte aligned offset
(the alignment #49236 used), so any view can be reinterpreted as uint8/int32.

Layer types follow vLLM's ``compress_ratio``: 0 or 1 = sliding-window only,
4 = C4 (compressor + lightning indexer), 128 = C128 (compressed without
indexer); any other ratio is refused (``formats.constants.layer_kind``).
A ``LeasePlan`` narrows this to what a platform's layer really leases.

Policies (see ``manager.py``): ``shared`` reserves ``shared_slots`` slots per
family and micro-batch, used by every layer in turn behind stream fences;
``private`` reserves one slot per layer, family and micro-batch; ``off``
reserves nothing (plain allocator).

``python -m vllm_dsv4_backend.workspace.sizing`` prints the README's table:
each platform's lease plan (``layer.plan.LEASE_PLAN``) beside #49236's pool.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_dsv4_backend.formats import constants
from vllm_dsv4_backend.formats.constants import layer_kind

ALIGNMENT = 256
"""Byte alignment of every view and slot (same as vLLM #49236's pool)."""

FAMILIES: tuple[str, ...] = ("q", "indexer_q", "topk", "compressor")
"""Buffer families, in storage order."""

POLICIES: tuple[str, ...] = ("shared", "private", "off")

INDEXER_KV_DTYPES: tuple[str, ...] = constants.INDEXER_KV_DTYPES

KERNELS: tuple[str, ...] = ("flashmla", "torch")

MIB = 1 << 20

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


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def padded_q_heads(local_heads: int, kernel: str = "flashmla") -> int:
    """Number of q heads the attention kernel needs for ``local_heads`` heads.

    FlashMLA's sparse FP8 decode kernel only runs with 64 or 128 q heads, so
    ``local_heads <= 64`` pads to 64 and ``65..128`` to 128 (vLLM's
    ``get_padded_num_q_heads``); more than 128 is an error. The torch path
    (``kernel="torch"``) needs no padding and returns ``local_heads``.
    """
    if not isinstance(local_heads, int) or isinstance(local_heads, bool) or local_heads < 1:
        raise ValueError(f"local_heads: expected a positive int, got {local_heads!r}")
    if kernel == "torch":
        return local_heads
    if kernel != "flashmla":
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if local_heads <= 64:
        return 64
    if local_heads <= 128:
        return 128
    raise ValueError(
        f"local_heads: FlashMLA supports at most 128 q heads per rank, got {local_heads}; "
        "raise tensor parallelism or use kernel='torch'"
    )


_FAMILIES_OF_KIND: dict[str, tuple[str, ...]] = {
    "swa": ("q",),
    # The C4 MLA compressor gets scratch too: #49236 gave it none, and a C4
    # compressor path using scratch was one of the ways the pool broke.
    "c4": ("q", "indexer_q", "topk", "compressor"),
    "c128": ("q", "compressor"),
}

# Every view a family can have (which exist also depends on the indexer dtype
# and, without a lease plan, on include_q / include_attn_out).
FAMILY_VIEWS: dict[str, tuple[str, ...]] = {
    "q": ("q", "out"),
    "indexer_q": ("q", "scales", "weights"),
    "topk": ("local", "global", "lens"),
    "compressor": ("scratch",),
}


def layer_families(compress_ratio: int) -> tuple[str, ...]:
    """Families a layer with this compress ratio may lease without a lease
    plan (every family its kind can use; see ``WorkspaceConfig.layer_families``)."""
    return _FAMILIES_OF_KIND[layer_kind(compress_ratio)]


@dataclasses.dataclass(frozen=True)
class LeasePlan:
    """The (family, view) pairs a platform's layer really leases, per layer
    kind: ``kinds[kind][family]`` = the views. Sizing reserves exactly these
    (``WorkspaceConfig.lease_plan``); a view the indexer dtype does not have
    (``scales`` under FP8) is simply not reserved. The plans themselves are
    declared next to the layers (``vllm_dsv4_backend.layer.plan.LEASE_PLAN``).
    """

    kinds: Mapping[str, Mapping[str, tuple[str, ...]]]

    def __post_init__(self) -> None:
        views_of: dict[str, tuple[str, ...]] = {}
        for kind, fams in self.kinds.items():
            if kind not in _FAMILIES_OF_KIND:
                raise ValueError(f"lease plan: unknown layer kind {kind!r}; "
                                 f"expected one of {tuple(_FAMILIES_OF_KIND)}")
            for fam, views in fams.items():
                if fam not in FAMILIES:
                    raise ValueError(f"lease plan: unknown family {fam!r}; expected one of "
                                     f"{FAMILIES}")
                bad = [v for v in views if v not in FAMILY_VIEWS[fam]]
                if bad or not views:
                    raise ValueError(f"lease plan: family {fam!r} views {views!r}; expected a "
                                     f"non-empty subset of {FAMILY_VIEWS[fam]}")
                if views_of.setdefault(fam, tuple(views)) != tuple(views):
                    raise ValueError(f"lease plan: family {fam!r} has views "
                                     f"{views_of[fam]} in one kind and {views} in another "
                                     "(a family's slots are shared between kinds)")

    def families(self, kind: str) -> tuple[str, ...]:
        """Families layers of ``kind`` lease, in storage order."""
        fams = self.kinds.get(kind, {})
        return tuple(f for f in FAMILIES if f in fams)

    def views(self, family: str) -> tuple[str, ...]:
        """Views of ``family`` any kind leases (empty if none)."""
        for fams in self.kinds.values():
            if family in fams:
                return tuple(fams[family])
        return ()

    def pairs(self) -> frozenset[tuple[str, str, str]]:
        """Every planned ``(kind, family, view)``."""
        return frozenset((k, f, v) for k, fams in self.kinds.items()
                         for f, views in fams.items() for v in views)


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """One token-major view of a family: ``[T, *per_token_shape]`` of ``dtype``."""

    name: str
    per_token_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        n = self.dtype.itemsize
        for d in self.per_token_shape:
            n *= d
        return n

    def nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens


@dataclasses.dataclass(frozen=True)
class WorkspaceConfig:
    """Sizing inputs of the eager-region workspace.

    Attributes:
        max_num_batched_tokens: ``T``, the most tokens one step (one
            micro-batch) can carry; every buffer has ``T`` rows. Pass vLLM's
            ``scheduler_config.max_num_batched_tokens``: the worst case of a
            forward (prefill chunks + decode + speculative tokens, CUDA-graph
            padding, the MTP/DSpark drafter; see ``manager``'s docstring). A
            lease of more tokens raises ``WorkspaceCapacityError``.
        num_local_heads: q heads on this rank (``num_attention_heads / tp``).
        padded_q_heads: q heads of the padded q buffer (``padded_q_heads()``).
        head_dim: MLA head dim (512 = 448 NoPE + 64 RoPE).
        index_n_heads, index_head_dim: lightning-indexer heads x dim (64 x 128).
        index_topk: compressed entries selected per token (512 for Flash).
        indexer_kv_dtype: ``"fp8"`` or ``"mxfp4"``; picks the indexer_q views.
        compress_ratios: one vLLM compress ratio per attention layer (drives
            which families exist and the ``private`` size).
        num_ubatches: micro-batches (DBO); each gets its own storage. Pass
            vLLM's ``parallel_config.num_ubatches`` when micro-batching is on
            (2 with DBO, ``--ubatch-size`` otherwise), else 1; a lease for a
            micro-batch id ``>= num_ubatches`` raises ``WorkspaceCapacityError``.
        include_attn_out: also reserve the ``[T, Hp, D]`` bf16 attention
            output in the ``q`` family (vLLM passes its own ``o_padded`` from
            outside the eager break, as in #49236, so this is off by default).
        include_q: reserve the padded q rows in the ``q`` family (off where
            the platform's fused q-norm/RoPE kernel returns its own q, as
            vLLM's CPU ``fused_qnorm_rope_kv_insert_cpu`` does; then the
            family holds only ``out``).
        lease_plan: the (family, view) pairs the platform's layer leases per
            layer kind (``LeasePlan``); when given it alone decides the
            families and views reserved (``include_*`` are then ignored).
            ``None``: every family of every kind, views by ``include_*``.
    """

    max_num_batched_tokens: int
    num_local_heads: int
    padded_q_heads: int
    head_dim: int = 512
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    indexer_kv_dtype: str = "fp8"
    compress_ratios: tuple[int, ...] = ()
    num_ubatches: int = 1
    include_attn_out: bool = False
    include_q: bool = True
    lease_plan: LeasePlan | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "num_local_heads",
            "padded_q_heads",
            "head_dim",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "num_ubatches",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if self.lease_plan is None and not (self.include_q or self.include_attn_out):
            raise ValueError("include_q / include_attn_out: the q family needs at least one")
        if self.padded_q_heads < self.num_local_heads:
            raise ValueError(
                f"padded_q_heads: expected >= num_local_heads ({self.num_local_heads}), "
                f"got {self.padded_q_heads}"
            )
        if self.indexer_kv_dtype not in INDEXER_KV_DTYPES:
            raise ValueError(
                f"indexer_kv_dtype: expected one of {INDEXER_KV_DTYPES}, "
                f"got {self.indexer_kv_dtype!r}"
            )
        if self.indexer_kv_dtype == "mxfp4" and self.index_head_dim % 32:
            raise ValueError(
                "index_head_dim: MXFP4 needs a multiple of 32 (one ue8m0 scale per 32 "
                f"values), got {self.index_head_dim}"
            )
        ratios = tuple(self.compress_ratios)
        for r in ratios:
            layer_kind(r)
        object.__setattr__(self, "compress_ratios", ratios)

    @classmethod
    def from_hf_config(
        cls,
        hf_config: Any,
        *,
        max_num_batched_tokens: int,
        tp_size: int,
        indexer_kv_dtype: str,
        num_ubatches: int = 1,
        padded_heads: int | None = None,
        kernel: str = "flashmla",
        include_attn_out: bool = False,
        include_q: bool = True,
        lease_plan: LeasePlan | None = None,
    ) -> WorkspaceConfig:
        """Build the config from a DeepSeek-V4 HF config (object or dict).

        Reads ``num_attention_heads``, ``head_dim``, ``index_n_heads``,
        ``index_head_dim``, ``index_topk``, ``compress_ratios`` and
        ``num_hidden_layers`` (``compress_ratios`` may carry extra MTP entries
        after the first ``num_hidden_layers``; they are dropped).
        ``padded_heads`` overrides ``padded_q_heads(local, kernel)``.
        """

        def get(name: str) -> Any:
            v = hf_config.get(name) if isinstance(hf_config, Mapping) else getattr(
                hf_config, name, None
            )
            if v is None:
                raise ValueError(f"hf_config: missing DeepSeek-V4 attribute {name!r}")
            return v

        heads = int(get("num_attention_heads"))
        if not isinstance(tp_size, int) or tp_size < 1 or heads % tp_size:
            raise ValueError(
                f"tp_size: expected a positive divisor of num_attention_heads={heads}, "
                f"got {tp_size!r}"
            )
        local = heads // tp_size
        num_layers = int(get("num_hidden_layers"))
        ratios = [int(r) for r in get("compress_ratios")]
        if len(ratios) < num_layers:
            raise ValueError(
                f"hf_config.compress_ratios: expected >= num_hidden_layers={num_layers} "
                f"entries, got {len(ratios)}"
            )
        return cls(
            max_num_batched_tokens=max_num_batched_tokens,
            num_local_heads=local,
            padded_q_heads=padded_heads if padded_heads is not None
            else padded_q_heads(local, kernel),
            head_dim=int(get("head_dim")),
            index_n_heads=int(get("index_n_heads")),
            index_head_dim=int(get("index_head_dim")),
            index_topk=int(get("index_topk")),
            indexer_kv_dtype=indexer_kv_dtype,
            compress_ratios=tuple(ratios[:num_layers]),
            num_ubatches=num_ubatches,
            include_attn_out=include_attn_out,
            include_q=include_q,
            lease_plan=lease_plan,
        )

    def layer_families(self, compress_ratio: int) -> tuple[str, ...]:
        """Families a layer with this compress ratio leases (the lease plan's,
        else every family its kind can use)."""
        if self.lease_plan is None:
            return layer_families(compress_ratio)
        return self.lease_plan.families(layer_kind(compress_ratio))

    def family_buffers(self, family: str) -> tuple[BufferSpec, ...]:
        """The views of ``family`` (see the module docstring for layouts)."""
        specs = self._all_family_buffers(family)
        if self.lease_plan is None:
            return specs
        planned = self.lease_plan.views(family)
        return tuple(s for s in specs if s.name in planned)

    def _all_family_buffers(self, family: str) -> tuple[BufferSpec, ...]:
        hp, d = self.padded_q_heads, self.head_dim
        hi, di, k = self.index_n_heads, self.index_head_dim, self.index_topk
        if family == "q":
            if self.lease_plan is not None:
                return (BufferSpec("q", (hp, d), torch.bfloat16),
                        BufferSpec("out", (hp, d), torch.bfloat16))
            specs = [BufferSpec("q", (hp, d), torch.bfloat16)] if self.include_q else []
            if self.include_attn_out:
                specs.append(BufferSpec("out", (hp, d), torch.bfloat16))
            return tuple(specs)
        if family == "indexer_q":
            if self.indexer_kv_dtype == "fp8":
                return (
                    BufferSpec("q", (hi, di), torch.float8_e4m3fn),
                    BufferSpec("weights", (hi,), torch.float32),
                )
            return (
                BufferSpec("q", (hi, di // 2), torch.uint8),
                BufferSpec("scales", (hi, di // 32), torch.uint8),
                BufferSpec("weights", (hi,), torch.float32),
            )
        if family == "topk":
            return (
                BufferSpec("local", (k,), torch.int32),
                BufferSpec("global", (k,), torch.int32),
                BufferSpec("lens", (), torch.int32),
            )
        if family == "compressor":
            return (BufferSpec("scratch", (d,), torch.float32),)
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")

    def slot_bytes(self, family: str) -> int:
        """Bytes of one slot of ``family`` (all views, ``T`` rows, aligned)."""
        t = self.max_num_batched_tokens
        return sum(_align(s.nbytes(t)) for s in self.family_buffers(family))


@dataclasses.dataclass(frozen=True)
class Slot:
    """One reserved region: ``ubatch``, ``family``, ``index`` at ``offset``."""

    ubatch: int
    family: str
    index: int
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every slot lives in the single uint8 storage, and who uses it.

    ``slot_of[(layer_idx, family)]`` is the slot index the layer leases (the
    same index in every micro-batch); ``slots`` lists every slot with its byte
    range; ``total_bytes`` is the storage size.
    """

    policy: str
    slots: tuple[Slot, ...]
    slot_of: Mapping[tuple[int, str], int]
    total_bytes: int


def plan_layout(
    config: WorkspaceConfig,
    compress_ratios: Sequence[int] | None = None,
    policy: str = "shared",
    shared_slots: int = 1,
) -> Layout:
    """Lay out every slot; the manager and ``workspace_bytes`` both use this.

    ``shared``: family ``f`` gets ``shared_slots`` slots per micro-batch; the
    ``n``-th layer using ``f`` takes slot ``n % shared_slots``. Families never
    share bytes (they can be live at once on different streams) and neither do
    micro-batches. ``private``: one slot per layer and family. ``off``: none.
    """
    ratios = tuple(config.compress_ratios if compress_ratios is None else compress_ratios)
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if not isinstance(shared_slots, int) or shared_slots < 1:
        raise ValueError(f"shared_slots: expected a positive int, got {shared_slots!r}")
    slot_of: dict[tuple[int, str], int] = {}
    count: dict[str, int] = dict.fromkeys(FAMILIES, 0)
    for i, r in enumerate(ratios):
        for f in config.layer_families(r):
            if policy == "private":
                slot_of[(i, f)] = count[f]
            else:
                slot_of[(i, f)] = count[f] % shared_slots
            count[f] += 1
    if policy == "off":
        return Layout(policy, (), slot_of, 0)
    slots: list[Slot] = []
    off = 0
    for u in range(config.num_ubatches):
        for f in FAMILIES:
            n = count[f] if policy == "private" else min(count[f], shared_slots)
            size = config.slot_bytes(f)
            for k in range(n):
                slots.append(Slot(u, f, k, off, size))
                off += size
    return Layout(policy, tuple(slots), slot_of, off)


def private_fit_tokens(
    config: WorkspaceConfig, compress_ratios: Sequence[int] | None, budget_bytes: int
) -> int:
    """The largest ``max_num_batched_tokens`` (at most ``config``'s) at which
    the ``private`` policy reserves at most ``budget_bytes``; 0 if none does.
    (Bytes grow with the token count, so a bisection finds it.)"""

    def total(t: int) -> int:
        cfg = dataclasses.replace(config, max_num_batched_tokens=t)
        return plan_layout(cfg, compress_ratios, "private").total_bytes

    lo, hi = 0, config.max_num_batched_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclasses.dataclass(frozen=True)
class WorkspaceBytes:
    """Reserved bytes of one policy: ``per_family`` (all slots, all micro-
    batches) and ``total``."""

    policy: str
    per_family: dict[str, int]
    total: int


def workspace_bytes(
    config: WorkspaceConfig,
    policy: str = "shared",
    *,
    compress_ratios: Sequence[int] | None = None,
    shared_slots: int = 1,
) -> WorkspaceBytes:
    """Bytes the manager reserves at load for ``config`` under ``policy``."""
    layout = plan_layout(config, compress_ratios, policy, shared_slots)
    per = dict.fromkeys(FAMILIES, 0)
    for s in layout.slots:
        per[s.family] += s.nbytes
    return WorkspaceBytes(policy, per, layout.total_bytes)


def pool49236_bytes(config: WorkspaceConfig) -> dict[str, int]:
    """Bytes of vLLM #49236's ``DeepseekV4EagerScratchPool`` for ``config``.

    ``q`` = ``[T, Hp, D]`` bf16; ``aux`` = the max (not the sum: all three
    families sat at offset 0) of the fp4 family (``[T,Hi,Di/2]`` u8 +
    ``[T,Hi,Di/32]`` u8 + ``[T,Hi]`` f32), the global top-k family
    (``[T,K]`` i32 + ``[T]`` i32) and compressor scratch ``[T,D]`` f32.
    One pool for the model; DBO was disabled rather than given storage.
    """
    t = config.max_num_batched_tokens
    hi, di, k, d = (
        config.index_n_heads,
        config.index_head_dim,
        config.index_topk,
        config.head_dim,
    )
    fp4 = _align(t * hi * (di // 2)) + _align(t * hi * (di // 32)) + _align(t * hi * 4)
    glob = _align(t * k * 4) + _align(t * 4)
    comp = _align(t * d * 4)
    q = _align(t * config.padded_q_heads * d * 2)
    aux = max(fp4, glob, comp)
    return {"q": q, "aux": aux, "total": q + aux}


def memory_table(
    *,
    hf_config: Any = None,
    tp_sizes: Sequence[int] = (1, 4, 8),
    max_num_batched_tokens: int = 8192,
    indexer_kv_dtypes: Sequence[str] = INDEXER_KV_DTYPES,
    policies: Sequence[str] = POLICIES,
    num_ubatches: int = 1,
    kernel: str = "flashmla",
    shared_slots: int = 1,
    lease_plans: Mapping[str, LeasePlan] | None = None,
) -> list[dict[str, Any]]:
    """Rows of reserved bytes per family and total, beside the #49236 pool.

    One row per (tp, indexer dtype, policy) for ``hf_config`` (default:
    DeepSeek-V4-Flash). ``lease_plans``: the plan per indexer dtype a
    platform's layer leases (``layer.core.lease_plan``); ``None``: every
    family of every layer kind with the padded q (the pre-plan sizing).
    Keys: ``tp``, ``local_heads``, ``padded_heads``, ``indexer``, ``policy``,
    ``q``, ``indexer_q``, ``topk``, ``compressor``,
    ``total`` (bytes), ``pool49236`` (bytes, q + aux) and ``ratio``
    (total / pool49236).
    """
    hf = DSV4_FLASH_HF_CONFIG if hf_config is None else hf_config
    rows: list[dict[str, Any]] = []
    for tp in tp_sizes:
        for dt in indexer_kv_dtypes:
            cfg = WorkspaceConfig.from_hf_config(
                hf,
                max_num_batched_tokens=max_num_batched_tokens,
                tp_size=tp,
                indexer_kv_dtype=dt,
                num_ubatches=num_ubatches,
                kernel=kernel,
                lease_plan=None if lease_plans is None else lease_plans[dt],
            )
            pool = pool49236_bytes(cfg)["total"]
            for p in policies:
                wb = workspace_bytes(cfg, p, shared_slots=shared_slots)
                rows.append(
                    {
                        "tp": tp,
                        "local_heads": cfg.num_local_heads,
                        "padded_heads": cfg.padded_q_heads,
                        "indexer": dt,
                        "policy": p,
                        **wb.per_family,
                        "total": wb.total,
                        "pool49236": pool,
                        "ratio": wb.total / pool,
                    }
                )
    return rows


def format_memory_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of ``memory_table`` rows, sizes in MiB."""

    def mib(n: int) -> str:
        return f"{n / MIB:,.2f}"

    head = (
        "| TP | heads (local/padded) | indexer | policy | q | indexer_q | topk | "
        "compressor | **total** | #49236 pool | ratio |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if r["policy"] == "off":
            fams = " | ".join("-" for _ in FAMILIES)
            total, ratio = "0 (allocator)", "n/a"
        else:
            fams = " | ".join(mib(r[f]) for f in FAMILIES)
            total, ratio = f"**{mib(r['total'])}**", f"{r['ratio']:.3f}x"
        lines.append(
            f"| {r['tp']} | {r['local_heads']}/{r['padded_heads']} | {r['indexer']} | "
            f"{r['policy']} | {fams} | {total} | {mib(r['pool49236'])} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Workspace bytes per family for DeepSeek-V4-Flash, beside vLLM #49236's pool"
    )
    ap.add_argument("--tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--ubatches", type=int, default=1)
    ap.add_argument("--kernel", choices=KERNELS, default="flashmla")
    ap.add_argument("--shared-slots", type=int, default=1)
    ap.add_argument("--platform", nargs="+", choices=("cuda", "cpu", "all-families"),
                    default=["cuda", "cpu"],
                    help="whose lease plan to size (all-families: every family of every "
                         "layer kind with the padded q, the sizing before lease plans)")
    a = ap.parse_args(argv)
    # The plans are declared next to the layers (data only: layer/plan.py imports nothing).
    from vllm_dsv4_backend.layer.plan import LEASE_PLAN

    print(
        f"DeepSeek-V4-Flash, T={a.tokens}, micro-batches={a.ubatches}, kernel={a.kernel}, "
        f"shared slots={a.shared_slots}; MiB reserved at load (off: allocator, nothing "
        "reserved). #49236 pool = padded q + max(aux families), no DBO."
    )
    for platform in a.platform:
        plans = None if platform == "all-families" else {
            dt: LeasePlan(LEASE_PLAN[platform][dt]) for dt in INDEXER_KV_DTYPES}
        rows = memory_table(
            tp_sizes=a.tp,
            max_num_batched_tokens=a.tokens,
            num_ubatches=a.ubatches,
            kernel=a.kernel,
            shared_slots=a.shared_slots,
            lease_plans=plans,
        )
        print()
        print(f"{platform}: " + ("every family, padded q" if plans is None else
                                 "the layer's lease plan (layer.plan.LEASE_PLAN)"))
        print()
        print(format_memory_table(rows))


if __name__ == "__main__":
    main()
