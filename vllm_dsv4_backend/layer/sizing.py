# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workspace's bytes for DeepSeek-V4, beside vLLM #49236's pool.

``python -m vllm_dsv4_backend.layer.sizing`` prints the table the README and
docs/workspace.md quote: each platform's lease plan (:data:`.plan.LEASE_PLAN`)
sized by the workspace's own layout (:func:`~vllm_dsv4_backend.workspace.sizing.workspace_bytes`)
from the config serving builds (:func:`.plan.build_workspace_config`).
Imports no vLLM.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_dsv4_backend.formats.constants import INDEXER_KV_DTYPES
from vllm_dsv4_backend.workspace.sizing import (
    MIB,
    POLICIES,
    WorkspaceConfig,
    align,
    workspace_bytes,
)

from .plan import (
    DSV4_FLASH_HF_CONFIG,
    LEASE_PLAN,
    build_workspace_config,
    dims_from_hf_config,
)

__all__ = ["format_memory_table", "main", "memory_table", "pool49236_bytes"]


def pool49236_bytes(config: WorkspaceConfig) -> dict[str, int]:
    """Bytes of vLLM #49236's ``DeepseekV4EagerScratchPool`` for the model
    ``config`` was built for (:func:`.plan.build_workspace_config`).

    ``q`` = ``[T, Hp, D]`` bf16; ``aux`` = the max (not the sum: all three
    families sat at offset 0) of the fp4 family (``[T,Hi,Di/2]`` u8 +
    ``[T,Hi,Di/32]`` u8 + ``[T,Hi]`` f32), the global top-k family
    (``[T,K]`` i32 + ``[T]`` i32) and compressor scratch ``[T,D]`` f32.
    One pool for the model; DBO was disabled rather than given storage.
    """
    t = config.max_num_batched_tokens
    p = config.params
    hi, di, k, d = p["index_n_heads"], p["index_head_dim"], p["index_topk"], p["head_dim"]
    fp4 = align(t * hi * (di // 2)) + align(t * hi * (di // 32)) + align(t * hi * 4)
    glob = align(t * k * 4) + align(t * 4)
    comp = align(t * d * 4)
    q = align(t * p["padded_q_heads"] * d * 2)
    aux = max(fp4, glob, comp)
    return {"q": q, "aux": aux, "total": q + aux}


def memory_table(
    *,
    platform: str = "cuda",
    hf_config: Any = None,
    tp_sizes: Sequence[int] = (1, 4, 8),
    max_num_batched_tokens: int = 8192,
    indexer_kv_dtypes: Sequence[str] = INDEXER_KV_DTYPES,
    policies: Sequence[str] = POLICIES,
    num_ubatches: int = 1,
    shared_slots: int = 1,
) -> list[dict[str, Any]]:
    """Rows of reserved bytes per family and total, beside the #49236 pool.

    One row per (tp, indexer dtype, policy) for ``hf_config`` (default:
    DeepSeek-V4-Flash) under ``platform``'s lease plan. Keys: ``tp``,
    ``local_heads``, ``padded_heads``, ``indexer``, ``policy``,
    ``families`` {family: bytes}, ``total`` (bytes), ``pool49236`` (bytes,
    q + aux) and ``ratio`` (total / pool49236).
    """
    hf = DSV4_FLASH_HF_CONFIG if hf_config is None else hf_config
    rows: list[dict[str, Any]] = []
    for tp in tp_sizes:
        dims, ratios = dims_from_hf_config(hf, tp_size=tp)
        for dt in indexer_kv_dtypes:
            cfg = build_workspace_config(
                dims, max_num_batched_tokens=max_num_batched_tokens, indexer_kv_dtype=dt,
                platform=platform, num_ubatches=num_ubatches, compress_ratios=ratios)
            pool = pool49236_bytes(cfg)["total"]
            for p in policies:
                wb = workspace_bytes(cfg, p, shared_slots=shared_slots)
                rows.append({
                    "tp": tp,
                    "local_heads": dims.num_local_heads,
                    "padded_heads": dims.padded_q_heads,
                    "indexer": dt,
                    "policy": p,
                    "families": wb.per_family,
                    "total": wb.total,
                    "pool49236": pool,
                    "ratio": wb.total / pool,
                })
    return rows


def format_memory_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of ``memory_table`` rows, sizes in MiB (a column per
    family any row reserves)."""

    def mib(n: int) -> str:
        return f"{n / MIB:,.2f}"

    fams = list(dict.fromkeys(f for r in rows for f in r["families"]))
    head = ("| TP | heads (local/padded) | indexer | policy | " + " | ".join(fams)
            + " | **total** | #49236 pool | ratio |")
    lines = [head, "|" + "---|" * (7 + len(fams))]
    for r in rows:
        if r["policy"] == "off":
            cells = " | ".join("-" for _ in fams)
            total, ratio = "0 (allocator)", "n/a"
        else:
            cells = " | ".join(mib(r["families"].get(f, 0)) for f in fams)
            total, ratio = f"**{mib(r['total'])}**", f"{r['ratio']:.3f}x"
        lines.append(
            f"| {r['tp']} | {r['local_heads']}/{r['padded_heads']} | {r['indexer']} | "
            f"{r['policy']} | {cells} | {total} | {mib(r['pool49236'])} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Workspace bytes per family for DeepSeek-V4-Flash, beside vLLM #49236's pool"
    )
    ap.add_argument("--tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--ubatches", type=int, default=1)
    ap.add_argument("--shared-slots", type=int, default=1)
    ap.add_argument("--platform", nargs="+", choices=sorted(LEASE_PLAN),
                    default=["cuda", "cpu"], help="whose lease plan to size")
    a = ap.parse_args(argv)
    print(
        f"DeepSeek-V4-Flash, T={a.tokens}, micro-batches={a.ubatches}, "
        f"shared slots={a.shared_slots}; MiB reserved at load (off: allocator, nothing "
        "reserved). #49236 pool = padded q + max(aux families), no DBO."
    )
    for platform in a.platform:
        rows = memory_table(platform=platform, tp_sizes=a.tp, max_num_batched_tokens=a.tokens,
                            num_ubatches=a.ubatches,
                            shared_slots=a.shared_slots)
        print()
        print(f"{platform}: the layer's lease plan (layer.plan.LEASE_PLAN)")
        print()
        print(format_memory_table(rows))


if __name__ == "__main__":
    main()
