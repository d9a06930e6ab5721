# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layer benchmark's JSON schema: stable keys, validation, headline summary.

No torch and no vLLM here, so ``vllm-dsv4-bench --summary-from`` and CI scripts can read
a result anywhere. ``docs/benchmarks.md`` documents every key; a change to a key list is a
schema change (bump :data:`SCHEMA`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

SCHEMA = "vllm-dsv4-bench/2"

# Stable JSON keys (docs/benchmarks.md documents each one).
RESULT_KEYS: tuple[str, ...] = (
    "schema", "meta", "cases", "comparisons", "peer", "e2e", "summary",
)
META_KEYS: tuple[str, ...] = (
    "argv", "started", "duration_s", "device", "device_name", "torch", "python", "vllm",
    "threads", "cpu_count", "load_avg_start", "load_avg_end", "kernel_path",
    "indexer_kv_dtype", "tp", "num_heads", "local_heads", "padded_heads", "head_dim",
    "window", "index_topk", "layers", "layer_kinds", "max_num_batched_tokens",
    "device_copy_GBps", "steps", "warmup", "seed", "time_budget_s", "skipped_cases",
)
CASE_KEYS: tuple[str, ...] = (
    "mode", "policy", "batch", "tokens", "context", "num_layers", "indexer",
    "steps", "p50_ms", "p99_ms", "mean_ms", "min_ms", "p50_ms_per_layer", "tokens_per_s",
    "allocs_per_step", "alloc_bytes_per_step", "workspace_allocs_per_step",
    "kernel_allocs_per_step", "total_allocs_per_step", "allocator_requests_per_step",
    "leases_per_step", "workspace_bytes", "peak_transient_bytes", "peak_bytes",
    "cuda_peak_step_bytes", "floor_bytes", "achieved_GBps", "floor_ms", "bw_fraction",
    "phase_ms",
)
PHASES: tuple[str, ...] = ("rope", "indexer_q", "topk", "attend", "glue")
COMPARISON_KEYS: tuple[str, ...] = (
    "mode", "batch", "tokens", "context", "policy", "baseline", "p50_ratio",
    "paired_ratio_median", "paired_ratio_q1", "paired_ratio_q3", "allocs_per_step",
    "baseline_allocs_per_step",
)
PEER_KEYS: tuple[str, ...] = ("available", "reason", "kernel", "rows", "quoted", "quoted_rows")
PEER_ROW_KEYS: tuple[str, ...] = (
    "batch", "context", "entries", "ours_ms", "ours_tok_per_s", "peer_ms", "peer_tok_per_s",
    "ours_over_peer", "max_abs_diff", "gemm_floor_ms", "gemm_floor_tok_per_s",
    "ours_over_gemm_floor",
)
QUOTED_ROW_KEYS: tuple[str, ...] = (
    "batch", "context", "entries", "ours_tok_per_s", "quoted_tok_per_s", "ours_over_quoted",
    "gemm_floor_tok_per_s", "three_x_reachable",
)


def summarize(records: Sequence[Mapping[str, Any]], comparisons: Sequence[Mapping[str, Any]],
              peer: Mapping[str, Any]) -> dict[str, Any]:
    """Headline figures: allocations per policy, shared/off and private/off ratios (median
    over cases of the paired per-step ratios), attention vs the peer."""
    out: dict[str, Any] = {"allocs_per_step": {}, "ratio_vs_off": {}, "ours_over_peer": None,
                           "ours_over_quoted": None, "ours_over_gemm_floor": None}
    for p in sorted({r["policy"] for r in records}):
        vals = [r["allocs_per_step"] for r in records if r["policy"] == p]
        out["allocs_per_step"][p] = {"min": min(vals), "max": max(vals)}
    for p in sorted({c["policy"] for c in comparisons}):
        pr = [c["paired_ratio_median"] for c in comparisons if c["policy"] == p
              and c["paired_ratio_median"] is not None]
        p50 = [c["p50_ratio"] for c in comparisons if c["policy"] == p]
        out["ratio_vs_off"][p] = {
            "median_paired": statistics.median(pr) if pr else None,
            "median_p50": statistics.median(p50) if p50 else None,
            "cases": len(p50),
        }
    rows = [r["ours_over_peer"] for r in peer.get("rows", []) if r["ours_over_peer"]]
    if rows:
        out["ours_over_peer"] = {"median": statistics.median(rows), "max": max(rows)}
    f = [r["ours_over_gemm_floor"] for r in peer.get("rows", [])]
    if f:
        out["ours_over_gemm_floor"] = {"median": statistics.median(f), "max": max(f)}
    q = [r["ours_over_quoted"] for r in peer.get("quoted_rows", [])]
    if q:
        out["ours_over_quoted"] = {"median": statistics.median(q), "max": max(q)}
    return out


def validate_result(result: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first missing/unexpected key of a result (the JSON
    schema ``docs/benchmarks.md`` documents)."""

    def check(obj: Any, keys: Sequence[str], where: str) -> None:
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
        missing = [k for k in keys if k not in obj]
        extra = [k for k in obj if k not in keys]
        if missing or extra:
            raise ValueError(f"{where}: missing keys {missing}, unexpected keys {extra}")

    check(result, RESULT_KEYS, "result")
    if result["schema"] != SCHEMA:
        raise ValueError(f"result.schema: expected {SCHEMA!r}, got {result['schema']!r}")
    check(result["meta"], META_KEYS, "meta")
    for i, c in enumerate(result["cases"]):
        check(c, CASE_KEYS, f"cases[{i}]")
        check(c["phase_ms"], PHASES, f"cases[{i}].phase_ms")
    for i, c in enumerate(result["comparisons"]):
        check(c, COMPARISON_KEYS, f"comparisons[{i}]")
    check(result["peer"], PEER_KEYS, "peer")
    for i, r in enumerate(result["peer"]["rows"]):
        check(r, PEER_ROW_KEYS, f"peer.rows[{i}]")
    for i, r in enumerate(result["peer"]["quoted_rows"]):
        check(r, QUOTED_ROW_KEYS, f"peer.quoted_rows[{i}]")
