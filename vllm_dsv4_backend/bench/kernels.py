# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA decode throughput, torch path vs vLLM's C++ CPU kernel (a benchmark, not a test).

DeepSeek-V4-Flash C4 layer shapes: h_q 64 (padded heads), head dim 512, SWA window 128
(``k_cache`` block 64) + top-k 512 compressed entries (``extra_k_cache`` block 64), fp8_ds_mla
caches with padded block stride, one query token per request (s_q 1), batch 1 / 8 / 32.

Reported per batch size: median time per call (= one layer's sparse attention for the whole
batch) and tokens/s per layer = batch / time, for

- ``torch``: the plugin's torch sparse MLA (argument checks, then
  :func:`~vllm_dsv4_backend.ops.torch_sparse_mla.sparse_mla_decode`, the fallback that
  serves ``flash_mla_with_kvcache_cpu`` where vLLM's C++ library lacks it), with
  preallocated ``out`` / ``lse_out`` / ``scratch``;
- ``naive``: the straightforward torch formulation (``dequantize_and_gather`` of every index,
  fp32 einsum softmax), to show what the optimised reference buys;
- ``gemm_floor``: the two fp32 GEMMs alone (``Q K^T`` and ``P K`` on contiguous, dequantized
  rows): the compute any fp32 path needs on this machine's BLAS;
- ``vllm_cpp``: ``torch.ops._C.flash_mla_with_kvcache_cpu`` when this machine can run it
  (vLLM's AVX512-BF16 library), and the ratio torch time / C++ time, measured in the same run
  with interleaved repetitions.

Usage: ``vllm-dsv4-bench kernels [--json PATH] [--batch 1 8 32] [--reps N]`` (or
``python -m vllm_dsv4_backend.bench.kernels ...``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from vllm_dsv4_backend.formats import fp8_ds_mla as F
from vllm_dsv4_backend.ops import torch_sparse_mla, vllm_cpu

H_Q = 64
WINDOW = 128
TOPK = 512
BLOCK = 64
SCALE = 512**-0.5


def _setup(batch: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    swa_blocks = 2 * batch + 1  # each request owns 2 SWA blocks (window 128)
    comp_blocks = 8 * batch + 1  # and 8 compressed blocks (512 C4 entries)
    swa = F.allocate_cache(swa_blocks, BLOCK)
    comp = F.allocate_cache(comp_blocks, BLOCK)
    for cache, nb in ((swa, swa_blocks), (comp, comp_blocks)):
        kv = (torch.randn(nb * BLOCK, 512, generator=g) / 3).to(torch.bfloat16)
        F.quantize_and_insert(kv, cache, torch.arange(nb * BLOCK))
    req = torch.arange(batch)
    win = (req.view(-1, 1) * 2 * BLOCK + torch.arange(WINDOW)).view(batch, 1, WINDOW)
    comp_idx = torch.stack(
        [r * 8 * BLOCK + torch.randperm(8 * BLOCK, generator=g)[:TOPK] for r in req.tolist()]
    ).view(batch, 1, TOPK)
    q = (torch.randn(batch, 1, H_Q, 512, generator=g)).to(torch.bfloat16)
    sink = torch.randn(H_Q, generator=g)
    return dict(
        q=q, swa=swa, comp=comp, win=win.to(torch.int32), comp_idx=comp_idx.to(torch.int32),
        sink=sink,
        out=torch.empty(batch, 1, H_Q, 512, dtype=torch.bfloat16),
        lse=torch.empty(batch, H_Q, 1),
        scratch=torch.empty(torch_sparse_mla.decode_scratch_nbytes(batch, 1, H_Q, WINDOW, TOPK),
                            dtype=torch.uint8),
    )


def _torch_fn(s: dict) -> Callable[[], object]:
    args = (s["q"], s["swa"], s["win"], None, s["sink"])
    extra = (s["comp"], s["comp_idx"], None)

    def run() -> object:
        return torch_sparse_mla.sparse_mla_decode(
            *args, SCALE, *extra, out=s["out"], lse_out=s["lse"], scratch=s["scratch"])

    return run


def _naive_fn(s: dict) -> Callable[[], object]:
    b = s["q"].shape[0]

    def run() -> object:
        k1 = F.dequantize_and_gather(s["swa"], s["win"].view(-1)).view(b, WINDOW, 512)
        k2 = F.dequantize_and_gather(s["comp"], s["comp_idx"].view(-1)).view(b, TOPK, 512)
        k = torch.cat([k1, k2], dim=1).float()
        scores = torch.einsum("bhd,bkd->bhk", s["q"][:, 0].float(), k) * SCALE
        lse = torch.logsumexp(scores, -1)
        p = torch.exp(scores - lse.unsqueeze(-1))
        out = torch.einsum("bhk,bkd->bhd", p, k) / (1 + torch.exp(s["sink"] - lse)).unsqueeze(-1)
        return out.to(torch.bfloat16), lse

    return run


def gemm_floor_fn(tokens: int, heads: int, entries: int, device: torch.device | str = "cpu"
                  ) -> Callable[[], object]:
    """The two fp32 GEMMs of sparse decode alone (``S = Q K^T``, ``O = P K``, K = V), on
    contiguous, already dequantized rows: what any fp32 implementation must compute, at
    this device's BLAS speed. ``ours / floor`` is the cost of everything else (gather,
    dequantization, softmax, dispatch)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(tokens, heads, 512, generator=g).to(device)
    k = torch.randn(tokens, entries, 512, generator=g).to(device)
    s = torch.empty(tokens, heads, entries, device=device)
    o = torch.empty(tokens, heads, 512, device=device)

    def floor() -> object:
        torch.bmm(q, k.transpose(1, 2), out=s)
        return torch.bmm(s, k, out=o)

    return floor


def _cpp_fn(s: dict) -> Callable[[], object]:
    b = s["q"].shape[0]
    lay_w, lay_c = F.cache_layout(s["swa"]), F.cache_layout(s["comp"])
    w2d = torch.as_strided(s["swa"], (lay_w.num_blocks, 584 * BLOCK), (lay_w.stride0, 1))
    c2d = torch.as_strided(s["comp"], (lay_c.num_blocks, 584 * BLOCK), (lay_c.stride0, 1))
    wslots = s["win"].view(b, WINDOW).to(torch.int64).contiguous()
    cslots = s["comp_idx"].view(b, TOPK).to(torch.int64).contiguous()
    q3 = s["q"].view(b, H_Q, 512)
    out3 = s["out"].view(b, H_Q, 512)
    op = torch.ops._C.flash_mla_with_kvcache_cpu

    def run() -> object:
        return op(out3, q3, w2d, wslots, BLOCK, c2d, cslots, BLOCK, s["sink"], SCALE)

    return run


def _time(fns: dict[str, Callable[[], object]], reps: int,
          min_s: float = 0.2) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) seconds per call of each fn; repetitions are interleaved
    across fns so that machine noise hits all of them alike. On a shared machine the CPU time
    is the steadier figure (it excludes time the process waited for a core)."""
    for f in fns.values():
        f()  # warm up
    inner = {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        f()
        dt = time.perf_counter() - t0
        inner[name] = max(1, int(min_s / max(dt, 1e-6)))
    wall: dict[str, list[float]] = {n: [] for n in fns}
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner[name]):
                f()
            wall[name].append((time.perf_counter() - t0) / inner[name])
            cpu[name].append((time.process_time() - c0) / inner[name])
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in fns}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results as JSON to this path")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-naive", action="store_true", help="skip the naive torch baseline")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    cpp_ok, cpp_why = vllm_cpu.load()
    rows = []
    for b in args.batch:
        s = _setup(b)
        fns = {"torch": _torch_fn(s), "gemm_floor": gemm_floor_fn(b, H_Q, WINDOW + TOPK)}
        if not args.no_naive:
            fns["naive"] = _naive_fn(s)
        if cpp_ok:
            fns["vllm_cpp"] = _cpp_fn(s)
        # Check once that the torch path agrees with the C++ kernel / the naive one.
        check = {}
        ref_out = _torch_fn(s)()[0].float().clone()
        if cpp_ok:
            fns["vllm_cpp"]()
            check["max_abs_diff_vs_cpp"] = float((s["out"].float() - ref_out).abs().max())
        t = _time(fns, args.reps)
        row = {"batch": b, **check}
        for n, (wall, cpu) in t.items():
            row[f"{n}_ms"] = wall * 1e3
            row[f"{n}_cpu_ms"] = cpu * 1e3
            row[f"{n}_tok_per_s"] = b / wall
            row[f"{n}_tok_per_cpu_s"] = b / cpu
        if cpp_ok:
            row["torch_over_cpp"] = t["torch"][0] / t["vllm_cpp"][0]
            row["torch_over_cpp_cpu"] = t["torch"][1] / t["vllm_cpp"][1]
        row["torch_over_gemm_floor"] = t["torch"][0] / t["gemm_floor"][0]
        if "naive" in t:
            row["naive_over_torch"] = t["naive"][0] / t["torch"][0]
            row["naive_over_torch_cpu"] = t["naive"][1] / t["torch"][1]
        rows.append(row)

    info = {
        "shape": f"h_q={H_Q}, head_dim=512, window={WINDOW} (block {BLOCK}) + top-k {TOPK} "
                 f"compressed (block {BLOCK}), s_q=1, fp8_ds_mla padded",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "vllm_cpp": "available" if cpp_ok else f"unavailable: {cpp_why}",
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan,
        "rows": rows,
    }
    print(f"sparse MLA decode, DeepSeek-V4-Flash C4 layer: {info['shape']}")
    print(f"torch {info['torch']}, {info['threads']} threads, vLLM C++: {info['vllm_cpp']}, "
          f"1-min load {info['load_avg_1m']:.1f}")
    hdr = (f"{'batch':>5} | {'torch ms':>8} {'cpu ms':>7} {'tok/s':>7} {'tok/cpu-s':>9} | "
           f"{'floor ms':>8} {'tok/s':>7} {'torch/floor':>11}")
    if not args.no_naive:
        hdr += f" | {'naive ms':>8} {'cpu ms':>7} {'naive/torch':>11}"
    hdr += f" | {'C++ ms':>7} {'cpu ms':>7} {'tok/s':>7} {'torch/C++':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        line = (f"{r['batch']:>5} | {r['torch_ms']:>8.2f} {r['torch_cpu_ms']:>7.2f} "
                f"{r['torch_tok_per_s']:>7.0f} {r['torch_tok_per_cpu_s']:>9.0f} | "
                f"{r['gemm_floor_ms']:>8.2f} {r['gemm_floor_tok_per_s']:>7.0f} "
                f"{r['torch_over_gemm_floor']:>11.2f}")
        if not args.no_naive:
            line += (f" | {r['naive_ms']:>8.2f} {r['naive_cpu_ms']:>7.2f} "
                     f"{r['naive_over_torch']:>11.2f}")
        if cpp_ok:
            line += (f" | {r['vllm_cpp_ms']:>7.2f} {r['vllm_cpp_cpu_ms']:>7.2f} "
                     f"{r['vllm_cpp_tok_per_s']:>7.0f} {r['torch_over_cpp']:>9.2f}")
        else:
            line += f" | {'n/a':>7} {'n/a':>7} {'n/a':>7} {'n/a':>9}"
        print(line)
    print("tok/s = batch / wall time per call (decode tokens per second through one layer); "
          "tok/cpu-s = batch / process CPU time; ratios use wall time; floor = the two fp32 "
          "GEMMs alone on dequantized rows (any fp32 path's minimum here).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    return info


if __name__ == "__main__":
    main()
