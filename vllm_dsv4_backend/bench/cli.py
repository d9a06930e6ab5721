# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm-dsv4-bench``: the DeepSeek-V4 attention eager region, workspace policies side by side.

Default run (decode, batch 1/8/32, contexts 1k/8k, 4 Flash layers C4/C128/C4/C128, policies
off/shared/private on the current device; a few minutes at most on a 2-core CPU)::

    vllm-dsv4-bench --json out/bench.json

Bigger sweeps: ``--full`` (batch 1/8/32/64, contexts 1k/8k/32k, prefill 1k/4k), or pick
``--batch``, ``--context``, ``--prefill``, ``--num-layers`` / ``--layers``. ``--e2e`` adds
the end-to-end ``vllm bench serve`` comparison on the tiny model (needs vLLM; minutes).
``--summary-from JSON`` prints the tables of an earlier run. Keys of the JSON file:
``docs/benchmarks.md``.

Runs without vLLM (torch only); the optional peer (vLLM's C++ CPU attention kernel) and
``--e2e`` look vLLM up lazily and report why they cannot run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from vllm_dsv4_backend.bench import schema as S

MIB = 1 << 20
PRESET_NAMES = ("default", "full", "tiny")


def _lb() -> Any:
    """The benchmark proper (imports torch); ``--summary-from`` and ``--help`` do without."""
    from vllm_dsv4_backend.bench import layer_bench

    return layer_bench


# ---------------------------------------------------------------------------------------------
# progress bar
# ---------------------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on a TTY (rewritten in place), else a line every few seconds."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True,
                 width: int = 24, every_s: float = 5.0) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.every_s = every_s
        self.t0 = time.monotonic()
        self._last = -math.inf
        self._len = 0

    def __call__(self, units: int, label: str) -> None:
        self.done = min(self.total, self.done + units)
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and now - self._last < self.every_s and self.done < self.total:
            return
        self._last = now
        frac = self.done / self.total
        fill = int(round(frac * self.width))
        el = now - self.t0
        line = (f"[{'#' * fill}{'.' * (self.width - fill)}] {frac * 100:3.0f}% "
                f"{int(el) // 60:02d}:{int(el) % 60:02d} {label}")
        if self.tty:
            pad = max(0, self._len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._len:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------
def _f(v: Any, fmt: str, na: str = "n/a") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return na
    return format(v, fmt)


def format_cases(cases: Sequence[Mapping[str, Any]]) -> str:
    head = (f"{'mode':<7} {'b':>3} {'T':>5} {'ctx':>6} {'policy':<8}| {'p50 ms':>8} "
            f"{'p99 ms':>8} {'ms/lyr':>7} | {'allocs':>6} {'kern':>5} | {'ws MiB':>7} "
            f"{'peak MiB':>8} | {'GB/s':>7} {'of bw':>6}")
    lines = [head, "-" * len(head)]
    for c in cases:
        lines.append(
            f"{c['mode']:<7} {c['batch']:>3} {c['tokens']:>5} {c['context']:>6} "
            f"{c['policy']:<8}| {c['p50_ms']:>8.2f} {c['p99_ms']:>8.2f} "
            f"{c['p50_ms_per_layer']:>7.2f} | {_f(c['allocs_per_step'], 'd'):>6} "
            f"{_f(c['kernel_allocs_per_step'], 'd'):>5} | {c['workspace_bytes'] / MIB:>7.2f} "
            f"{c['peak_bytes'] / MIB:>8.2f} | {c['achieved_GBps']:>7.3f} "
            f"{c['bw_fraction'] * 100:>5.1f}%"
        )
    return "\n".join(lines)


def format_comparisons(comps: Sequence[Mapping[str, Any]]) -> str:
    head = (f"{'mode':<7} {'b':>3} {'T':>5} {'ctx':>6} {'policy':<8}| {'p50/off':>7} "
            f"{'paired':>7} {'[q1, q3]':>15} | {'allocs':>6} {'off':>5}")
    lines = [head, "-" * len(head)]
    for c in comps:
        iqr = (f"[{_f(c['paired_ratio_q1'], '.3f')}, {_f(c['paired_ratio_q3'], '.3f')}]")
        lines.append(
            f"{c['mode']:<7} {c['batch']:>3} {c['tokens']:>5} {c['context']:>6} "
            f"{c['policy']:<8}| {c['p50_ratio']:>7.3f} "
            f"{_f(c['paired_ratio_median'], '.3f'):>7} {iqr:>15} | "
            f"{_f(c['allocs_per_step'], 'd'):>6} {_f(c['baseline_allocs_per_step'], 'd'):>5}"
        )
    return "\n".join(lines)


def format_peer(peer: Mapping[str, Any]) -> str:
    lines = []
    if peer["available"]:
        lines.append(f"peer {peer['kernel']}: measured in this run")
    else:
        lines.append(f"peer {peer['kernel']}: unavailable ({peer['reason']})")
    head = (f"{'b':>3} {'ctx':>6} {'entries':>7} | {'ours ms':>8} {'tok/s':>8} | "
            f"{'peer ms':>8} {'tok/s':>8} | {'ours/peer':>9} | {'floor ms':>8} {'tok/s':>8} "
            f"{'ours/floor':>10}")
    lines += [head, "-" * len(head)]
    for r in peer["rows"]:
        lines.append(
            f"{r['batch']:>3} {r['context']:>6} {r['entries']:>7} | {r['ours_ms']:>8.2f} "
            f"{r['ours_tok_per_s']:>8.0f} | {_f(r['peer_ms'], '8.2f'):>8} "
            f"{_f(r['peer_tok_per_s'], '8.0f'):>8} | {_f(r['ours_over_peer'], '9.2f'):>9} | "
            f"{r['gemm_floor_ms']:>8.2f} {r['gemm_floor_tok_per_s']:>8.0f} "
            f"{r['ours_over_gemm_floor']:>10.2f}"
        )
    lines.append("floor = the two fp32 GEMMs of the attention alone (Q K^T, P K) on dequantized "
                 "rows, same run: what any fp32 path needs here")
    if not peer["available"]:
        q = ", ".join(f"b={k}: {v:.0f}" for k, v in peer["quoted"].items())
        lines.append(f"reference (the issue's figures, another run, same shapes, tok/s per "
                     f"layer): {q}")
        for r in peer["quoted_rows"]:
            lines.append(
                f"  b={r['batch']:<3} ctx={r['context']}: ours {r['ours_tok_per_s']:.0f} tok/s "
                f"vs quoted {r['quoted_tok_per_s']:.0f} -> ours/quoted time "
                f"{r['ours_over_quoted']:.2f}x; fp32 GEMM floor {r['gemm_floor_tok_per_s']:.0f} "
                f"tok/s -> within 3x of quoted "
                f"{'reachable' if r['three_x_reachable'] else 'NOT reachable by any fp32 path'}"
            )
        if not peer["quoted_rows"]:
            lines.append("  (no case with the quoted shapes: window 128 + top-k 512 entries at "
                         "batch 1/8/32; use a context >= 2048 with the Flash top-k)")
    return "\n".join(lines)


def format_e2e(e2e: Mapping[str, Any]) -> str:
    from vllm_dsv4_backend.bench import e2e as E

    return E.format_e2e(e2e)


def format_summary(result: Mapping[str, Any]) -> str:
    """The closing table: what the issue checks, one line each."""
    meta, s = result["meta"], result["summary"]
    bw = meta["device_copy_GBps"]
    lines = [
        (f"summary: {meta['device']} ({meta['device_name']}), torch {meta['torch']}, "
         f"{meta['threads']} threads, load {_f(meta['load_avg_start'], '.1f')} -> "
         f"{_f(meta['load_avg_end'], '.1f')} on {meta['cpu_count']} cores, kernel path "
         f"{meta['kernel_path']}, layers {','.join(meta['layer_kinds'])}, indexer "
         f"{meta['indexer_kv_dtype']}, copy bandwidth {_f(bw, '.1f')} GB/s, "
         f"{_f(meta['duration_s'], '.0f')} s"),
    ]
    head = f"{'check':<44} {'value':>22}"
    lines += [head, "-" * len(head)]
    for p, v in s["allocs_per_step"].items():
        val = f"{v['min']}" if v["min"] == v["max"] else f"{v['min']}..{v['max']}"
        lines.append(f"{'allocs/step in the eager region, ' + p:<44} {val:>22}")
    for p, v in s["ratio_vs_off"].items():
        val = (f"{_f(v['median_paired'], '.3f')} (p50 {_f(v['median_p50'], '.3f')}, "
               f"n={v['cases']})")
        lines.append(f"{'latency ' + p + '/off, median over cases':<44} {val:>22}")
    if s["ours_over_peer"]:
        v = s["ours_over_peer"]
        lines.append(f"{'attention time ours/vLLM C++ (median, max)':<44} "
                     f"{v['median']:>11.2f} {v['max']:>10.2f}")
    elif s["ours_over_quoted"]:
        v = s["ours_over_quoted"]
        lines.append(f"{'attention time ours/quoted C++ (median, max)':<44} "
                     f"{v['median']:>11.2f} {v['max']:>10.2f}")
    else:
        lines.append(f"{'attention vs vLLM C++':<44} {'n/a':>22}")
    if s.get("ours_over_gemm_floor"):
        v = s["ours_over_gemm_floor"]
        lines.append(f"{'attention time ours/fp32 GEMM floor (med, max)':<44} "
                     f"{v['median']:>11.2f} {v['max']:>10.2f}")
    e2e = result.get("e2e")
    if e2e and e2e.get("ratios"):
        for k, v in e2e["ratios"].items():
            lines.append(f"{'e2e ' + k + ' shared/off':<44} {_f(v, '.3f'):>22}")
    return "\n".join(lines)


def print_report(result: Mapping[str, Any], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    if result["cases"]:
        print("\nper case (allocs = eager-region allocations outside the kernels per step; "
              "kern = inside the torch kernels; ws = workspace reserved; GB/s = floor bytes / "
              "p50; of bw = vs device copy bandwidth)", file=out)
        print(format_cases(result["cases"]), file=out)
    if result["comparisons"]:
        print("\npolicy vs off (time ratios; paired = per-round step ratio, median and "
              "quartiles; < 1 = faster)", file=out)
        print(format_comparisons(result["comparisons"]), file=out)
    if result["cases"]:
        print("\nattention alone, first C4 layer, decode (ours = torch path)", file=out)
        print(format_peer(result["peer"]), file=out)
    if result.get("e2e"):
        print("\nend to end (vllm bench serve, tiny model)", file=out)
        print(format_e2e(result["e2e"]), file=out)
    skipped = result["meta"].get("skipped_cases") or []
    if skipped:
        print(f"\nskipped (time budget {result['meta']['time_budget_s']} s): " + ", ".join(
            f"{c['mode']} b={c['batch']} T={c['tokens']} ctx={c['context']}" for c in skipped),
            file=out)
    print("", file=out)
    print(format_summary(result), file=out)
    out.flush()


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


def _size(text: str) -> int:
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1024, t[:-1]
    try:
        v = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 1024 or 8k, got {text!r}") \
            from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-dsv4-bench",
        description="Benchmark the DeepSeek-V4 attention eager region (q RoPE + SWA insert, "
        "indexer q, top-k, sparse MLA) of N Flash-shaped layers under the workspace policies "
        "off / shared / private, side by side in one run.",
        epilog=("JSON keys: docs/benchmarks.md. Example: vllm-dsv4-bench --json bench.json. "
                "Plugin layer vs vLLM's own layer (need vLLM): vllm-dsv4-bench step-ab | "
                "layer-ab | e2e-layers | solo-identity [--help]"),
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--preset", choices=PRESET_NAMES, default="default",
                   help="default: decode b=1,8,32 ctx=1k,8k; full: the issue's whole sweep "
                   "(b up to 64, ctx up to 32k, prefill 1k/4k); tiny: seconds on a CPU "
                   "(small top-k and window, for dry runs and tests)")
    p.add_argument("--full", action="store_const", const="full", dest="preset",
                   help="same as --preset full")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--num-layers", type=int, metavar="N",
                   help="N layers of the Flash middle pattern C4,C128,C4,... (default 4)")
    p.add_argument("--layers", type=_ints, metavar="R,R,...",
                   help="explicit compress ratios per layer (0 = SWA only, 4 = C4, 128 = C128)")
    p.add_argument("--batch", type=_ints, metavar="B,B,...", help="decode batch sizes")
    p.add_argument("--context", type=lambda s: [_size(x) for x in s.replace(",", " ").split()],
                   metavar="C,C,...", help="context lengths (e.g. 1k,8k,32k)")
    p.add_argument("--prefill", nargs="?", const="1k,4k", default=None, metavar="T,T,...",
                   help="add prefill cases with these chunk sizes (default 1k,4k)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode cases")
    p.add_argument("--policies", type=lambda s: [x for x in s.replace(",", " ").split()],
                   metavar="P,P,...", help="workspace policies (default off,shared,private)")
    p.add_argument("--indexer-kv-dtype", choices=("fp8", "mxfp4"), help="indexer K cache "
                   "format (fp8: 132 B entries, default; mxfp4: 68 B)")
    p.add_argument("--tp", type=int, help="tensor parallel size: 64/tp local heads, padded to "
                   "64 for FlashMLA (default 1)")
    p.add_argument("--steps", type=int, help="timed steps per case and policy (default: as "
                   "many as fit --target-s, 5..50)")
    p.add_argument("--target-s", type=float, help="seconds per case and policy when --steps "
                   "is not given (default 1.5)")
    p.add_argument("--warmup", type=int, help="untimed warm-up rounds (default 1)")
    p.add_argument("--time-budget", type=float, metavar="S", help="start no new case after S "
                   "seconds; skipped cases are listed in meta.skipped_cases")
    p.add_argument("--threads", default="auto", help="torch CPU threads: auto (default: the "
                   "cores the 1-min load average leaves idle) or a number")
    p.add_argument("--max-num-batched-tokens", type=int, help="workspace rows (default: the "
                   "largest step of the run)")
    p.add_argument("--no-peer", action="store_true", help="skip the attention-only peer "
                   "comparison with vLLM's C++ CPU kernel")
    p.add_argument("--seed", type=int, help="RNG seed of the synthetic inputs (default 0)")
    p.add_argument("--e2e", action="store_true", help="also run vllm bench serve on the tiny "
                   "model, one server with VLLM_DSV4_WORKSPACE=shared and one with off, in "
                   "alternating rounds (needs vLLM; 10+ minutes on a loaded 2-core CPU)")
    p.add_argument("--e2e-only", action="store_true", help="only the end-to-end comparison")
    p.add_argument("--e2e-rounds", type=int, default=3, help="bench rounds against the two "
                   "servers (order alternates; ratios: median of paired ratios; default 3)")
    p.add_argument("--e2e-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a vllm bench serve flag of the e2e bench config")
    p.add_argument("--summary-from", metavar="JSON", help="print the tables of an earlier "
                   "run's JSON and exit")
    p.add_argument("--summary-only", action="store_true", help="with --summary-from: only "
                   "the closing summary table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    """The ``layer_bench.BenchConfig`` for parsed arguments (preset, then explicit flags)."""
    L = _lb()
    kw: dict[str, Any] = {}
    if args.device is not None:
        kw["device"] = args.device
    if args.layers is not None and args.num_layers is not None:
        raise ValueError("--layers and --num-layers: give one, not both")
    if args.layers is not None:
        kw["layers"] = tuple(args.layers)
    elif args.num_layers is not None:
        if args.num_layers < 1:
            raise ValueError(f"--num-layers: expected a positive int, got {args.num_layers}")
        kw["layers"] = tuple(L.FLASH_MIDDLE[i % 2] for i in range(args.num_layers))
    if args.batch is not None:
        kw["batches"] = tuple(args.batch)
    if args.context is not None:
        kw["contexts"] = tuple(args.context)
    if args.prefill is not None:
        kw["prefill_tokens"] = tuple(_size(x) for x in args.prefill.replace(",", " ").split())
    if args.no_decode:
        kw["batches"] = ()
    for flag, key in (("policies", "policies"), ("indexer_kv_dtype", "indexer_kv_dtype"),
                      ("tp", "tp"), ("steps", "steps"), ("target_s", "target_s"),
                      ("warmup", "warmup"), ("max_num_batched_tokens",
                                             "max_num_batched_tokens"), ("seed", "seed"),
                      ("time_budget", "time_budget_s")):
        v = getattr(args, flag)
        if v is not None:
            kw[key] = tuple(v) if isinstance(v, list) else v
    if args.no_peer:
        kw["peer"] = False
    return L.PRESETS[args.preset](**kw)


def _write_json(path: str, result: Mapping[str, Any]) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2, allow_nan=True)
        f.write("\n")
    os.replace(tmp, path)


# ``vllm-dsv4-bench COMMAND ...``: the plugin's layer against vLLM's own CPU
# layer (each needs vLLM; the module's --help lists its flags).
SUBCOMMANDS = {
    "step-ab": "vllm_dsv4_backend.bench.step_ab",
    "layer-ab": "vllm_dsv4_backend.bench.layer_ab",
    "e2e-layers": "vllm_dsv4_backend.bench.e2e_layers",
    "solo-identity": "vllm_dsv4_backend.bench.solo_identity",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (0 ok, 2 bad arguments, 3 e2e failure).

    ``vllm-dsv4-bench step-ab|layer-ab|e2e-layers|solo-identity ARGS`` runs that
    comparison of the plugin's layer with vLLM's own layer instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        # argparse names the program after argv[0]: usage lines then read
        # "vllm-dsv4-bench layer-ab ...".
        prog, sys.argv[0] = sys.argv[0], f"vllm-dsv4-bench {argv[0]}"
        try:
            return int(importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:]) or 0)
        finally:
            sys.argv[0] = prog
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.summary_from:
        with open(args.summary_from) as f:
            result = json.load(f)
        S.validate_result(result)
        if args.summary_only:
            print(format_summary(result))
        else:
            print_report(result)
        return 0
    L = _lb()
    try:
        cfg = config_from_args(args)
        threads = L.resolve_threads(args.threads)
    except ValueError as e:
        parser.error(str(e))
    result: dict[str, Any]
    if args.e2e_only:
        result = L.empty_result(cfg, argv)
    else:
        progress = Progress(L.estimate_units(cfg), enabled=not args.quiet)
        dev = L.resolve_device(cfg.device)
        print(f"vllm-dsv4-bench: {len(cfg.cases())} cases x {len(cfg.policies)} policies "
              f"({','.join(cfg.policies)}) on {dev}, layers "
              f"{','.join(str(r) for r in cfg.layers)}, {threads} threads", file=sys.stderr)
        try:
            result = L.run(cfg, threads=threads, argv=argv, progress=progress)
        finally:
            progress.close()
    rc = 0
    if args.e2e or args.e2e_only:
        from vllm_dsv4_backend.bench import e2e as E

        try:
            result["e2e"] = E.run_e2e(rounds=args.e2e_rounds, overrides=args.e2e_set,
                                      progress=None if args.quiet else sys.stderr)
        except E.E2EError as e:
            print(f"vllm-dsv4-bench: e2e failed: {e}", file=sys.stderr)
            result["e2e"] = {"error": str(e)}
            rc = 3
        result["summary"] = S.summarize(result["cases"], result["comparisons"], result["peer"])
    S.validate_result(result)
    if args.json:
        _write_json(args.json, result)
    print_report(result)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
