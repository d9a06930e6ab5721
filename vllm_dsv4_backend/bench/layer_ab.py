# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer-level A/B on CPU: the plugin's DeepSeek-V4 layer vs vLLM's own
``DeepseekV4CPUAttention``, on identical inputs, interleaved in one process.

A real vLLM engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
with the plugin's layer. For every forward of an attention layer whose token
count matches the running case, the hook runs the layer's forward ``reps``
times as the plugin's layer and ``reps`` times as vLLM's (the same instance,
its class switched to vLLM's for the call: same weights, caches, metadata),
alternating which goes first, then returns the plugin's output. Both write the
same bytes to the same cache slots (the inserts are pure functions of the
inputs), so repeating them changes nothing. Per pair it records both times and
whether the outputs are bitwise equal; once per layer kind and case, the CPU
allocations of each (``torch.profiler`` memory events, which see inside vLLM's
C++ ops and its opaque custom op).

Cases: decode at batch 1 / 8 / 32 (each request ``--context`` tokens of
prompt) and one ``--prefill``-token prefill, on the tiny model
(``configs/tiny-dsv4``) or a Flash-shaped variant of it (``--flash-shaped``:
DeepSeek-V4-Flash's attention widths, 64 heads, hidden 4096, q/o LoRA 1024,
8 output groups; small MoE and vocabulary so it fits a CPU).

``python -m vllm_dsv4_backend.bench.layer_ab --json out.json`` prints a table;
the ratio is vLLM's time / the plugin's (>= 1: the plugin is at least as
fast), median over all pairs with its p10..p90 spread.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from vllm_dsv4_backend.bench import ab

SCHEMA = "vllm-dsv4-layer-ab/1"


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _cpu_allocations(fn: Any) -> tuple[int, int]:
    """(allocations, bytes) of CPU memory made while ``fn()`` runs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # An op's own (not its children's) net CPU memory: > 0 where it allocated
    # a tensor that outlived it (its output) or that it freed only later.
    count = nbytes = 0
    for evt in prof.events():
        if evt.self_cpu_memory_usage > 0:
            count += 1
            nbytes += evt.self_cpu_memory_usage
    del torch
    return count, nbytes


class _Recorder:
    """Hooks ``DSV4CPUAttention.forward`` and records A/B pairs per case."""

    def __init__(self, reps: int) -> None:
        self.reps = reps
        self.case: str | None = None
        self.tokens: int | None = None
        self.rows: dict[tuple[str, str], dict[str, Any]] = {}
        # Per case: one [plugin ms, vLLM ms] list per rep for each model step,
        # summed over the step's layers (a step starts at the first layer).
        self.steps: dict[str, list[list[list[float]]]] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import torch
        from vllm.forward_context import get_forward_context
        from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

        from vllm_dsv4_backend.layer.cpu import DSV4CPUAttention

        plugin_forward = DSV4CPUAttention.forward
        parts: dict[int, list[tuple[Any, type, type]]] = {}

        @contextlib.contextmanager
        def as_vllm_layer(layer: Any) -> Iterator[None]:
            # The same module, dispatching to vLLM's methods for one call.
            mine = parts.get(id(layer))
            if mine is None:
                mine = parts[id(layer)] = ab.swapped_parts(layer)
            ab.set_classes(mine, "vllm")
            try:
                yield
            finally:
                ab.set_classes(mine, "plugin")

        def vllm_forward(layer: Any, positions: Any, hidden: Any) -> Any:
            with as_vllm_layer(layer):
                return DeepseekV4CPUAttention.forward(layer, positions, hidden)

        def hooked(layer: Any, positions: Any, hidden_states: Any,
                   llama_4_scaling: Any = None) -> Any:
            if (self.case is None or hidden_states.shape[0] != self.tokens
                    or not isinstance(get_forward_context().attn_metadata, dict)):
                return plugin_forward(layer, positions, hidden_states)
            row = self.rows.setdefault((self.case, layer.layer_kind), {
                "case": self.case, "layer_kind": layer.layer_kind, "tokens": self.tokens,
                "plugin_ms": [], "vllm_ms": [], "ratios": [], "identical": 0, "pairs": 0,
            })
            steps = self.steps.setdefault(self.case, [])
            if layer._dsv4_regions.starts_steps or not steps:
                steps.append([[0.0, 0.0] for _ in range(self.reps)])
            for r in range(self.reps):
                order = ("plugin", "vllm") if r % 2 == 0 else ("vllm", "plugin")
                times: dict[str, float] = {}
                outs: dict[str, Any] = {}
                for who in order:
                    t0 = time.perf_counter()
                    if who == "plugin":
                        outs[who] = plugin_forward(layer, positions, hidden_states)
                    else:
                        outs[who] = vllm_forward(layer, positions, hidden_states)
                    times[who] = time.perf_counter() - t0
                row["plugin_ms"].append(times["plugin"] * 1e3)
                row["vllm_ms"].append(times["vllm"] * 1e3)
                row["ratios"].append(times["vllm"] / times["plugin"])
                steps[-1][r][0] += times["plugin"] * 1e3
                steps[-1][r][1] += times["vllm"] * 1e3
                row["pairs"] += 1
                row["identical"] += int(torch.equal(outs["plugin"], outs["vllm"]))
            if "plugin_allocs" not in row:
                row["plugin_allocs"], row["plugin_alloc_bytes"] = _cpu_allocations(
                    lambda: plugin_forward(layer, positions, hidden_states))
                row["vllm_allocs"], row["vllm_alloc_bytes"] = _cpu_allocations(
                    lambda: vllm_forward(layer, positions, hidden_states))
            return plugin_forward(layer, positions, hidden_states)

        DSV4CPUAttention.forward = hooked  # type: ignore[method-assign]
        try:
            yield
        finally:
            DSV4CPUAttention.forward = plugin_forward  # type: ignore[method-assign]

    def summary(self) -> list[dict[str, Any]]:
        out = []
        for row in self.rows.values():
            out.append(_row(row["case"], row["layer_kind"], row["tokens"], row["plugin_ms"],
                            row["vllm_ms"], row["identical"], row))
        for case, steps in self.steps.items():
            pairs = [pair for step in steps for pair in step if pair[0] > 0]
            tokens = next(r["tokens"] for r in self.rows.values() if r["case"] == case)
            out.append(_row(case, "step", tokens, [p for p, _ in pairs],
                            [v for _, v in pairs], None, {}))
        return out


def _row(case: str, kind: str, tokens: int, plugin_ms: list[float], vllm_ms: list[float],
         identical: int | None, allocs: dict[str, Any]) -> dict[str, Any]:
    ratios = [v / p for p, v in zip(plugin_ms, vllm_ms)]
    ci_lo, ci_hi = ab.median_ci(ratios)
    return {
        "case": case, "layer_kind": kind, "tokens": tokens, "pairs": len(ratios),
        "identical": identical,
        "plugin_ms_median": statistics.median(plugin_ms),
        "vllm_ms_median": statistics.median(vllm_ms),
        "ratio_median": statistics.median(ratios),
        "ratio_p10": _pct(ratios, 10), "ratio_p90": _pct(ratios, 90),
        "ratio_ci95_lo": ci_lo, "ratio_ci95_hi": ci_hi,
        "plugin_allocs": allocs.get("plugin_allocs"),
        "vllm_allocs": allocs.get("vllm_allocs"),
        "plugin_alloc_bytes": allocs.get("plugin_alloc_bytes"),
        "vllm_alloc_bytes": allocs.get("vllm_alloc_bytes"),
    }


def run(*, flash_shaped: bool = False, batches: Sequence[int] = (1, 8, 32),
        context: int = 256, prefill: int = 1024, decode_steps: int = 4, reps: int = 3,
        threads: int | None = None, progress: Any = sys.stderr) -> dict[str, Any]:
    """Run every case in one engine; returns the JSON-able result."""
    llm, vocab = ab.start_engine(
        flash_shaped=flash_shaped, threads=threads,
        max_model_len=max(max(prefill, context + decode_steps) + 16, 2048),
        max_num_batched_tokens=max(prefill, max(batches) * (context + 1), 2048),
        max_num_seqs=max(batches))
    from vllm import SamplingParams

    rng = random.Random(0)
    rec = _Recorder(reps)
    t0 = time.monotonic()
    with rec.installed():
        cases = [(f"decode_b{b}", b, [context] * b, decode_steps) for b in batches]
        cases.append((f"prefill_{prefill}", prefill, [prefill], 1))
        for name, tokens, lens, steps in cases:
            ab.sayer("layer-ab", progress)(f"{name} ...")
            rec.case, rec.tokens = name, tokens
            prompts = ab.token_prompts(rng, vocab, lens)
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps,
                                                 ignore_eos=True), use_tqdm=False)
        rec.case = None
    import torch

    rows = rec.summary()
    # A case whose batch never formed (vLLM scheduled its requests into steps of other
    # sizes) has no pair; say so rather than print a table without it.
    missing = [name for name, *_ in cases if name not in {r["case"] for r in rows}]
    return {
        "schema": SCHEMA, "model": "flash-shaped" if flash_shaped else "tiny",
        "threads": torch.get_num_threads(), "reps": reps, "context": context,
        "wall_s": time.monotonic() - t0, "rows": rows, "missing_cases": missing,
        "ratio_median_all": statistics.median(
            r["ratio_median"] for r in rows if r["layer_kind"] != "step") if rows else None,
    }


def format_result(res: dict[str, Any]) -> str:
    title = (f"layer A/B ({res['model']} model, {res['threads']} thread(s)): ratio = vLLM "
             "layer time / plugin layer time (>= 1: plugin at least as fast); p10..p90 of "
             "the pairs, and the 95% confidence interval of the median; 'step' sums a "
             "model step's layers")
    head = (f"{'case':<14}{'kind':<6}{'T':>6}{'plugin ms':>11}{'vLLM ms':>10}{'ratio':>8}"
            f"{'p10..p90':>14}{'median CI':>14}{'identical':>11}{'allocs p/v':>12}")
    lines = [title, head]
    for r in sorted(res["rows"], key=lambda r: (r["tokens"], r["case"], r["layer_kind"] == "step")):
        same = "-" if r["identical"] is None else f"{r['identical']}/{r['pairs']}"
        allocs = "-" if r["plugin_allocs"] is None else f"{r['plugin_allocs']}/{r['vllm_allocs']}"
        lines.append(
            f"{r['case']:<14}{r['layer_kind']:<6}{r['tokens']:>6}{r['plugin_ms_median']:>11.3f}"
            f"{r['vllm_ms_median']:>10.3f}{r['ratio_median']:>8.3f}"
            f"{r['ratio_p10']:>8.2f}..{r['ratio_p90']:<4.2f}"
            f"{r['ratio_ci95_lo']:>8.3f}..{r['ratio_ci95_hi']:<5.3f}"
            f"{same:>10}{allocs:>12}")
    for name in res.get("missing_cases", []):
        lines.append(f"{name}: not measured (no model step had exactly this batch's tokens: "
                     "vLLM's scheduler split it)")
    lines.append(f"median ratio over rows: {res['ratio_median_all']:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = ab.parser(__doc__, context=256)
    p.add_argument("--reps", type=ab.positive, default=3, help="A/B pairs per layer forward")
    args = p.parse_args(argv)
    return ab.conclude("layer-ab", lambda: run(
        flash_shaped=args.flash_shaped, batches=args.batches, context=args.context,
        prefill=args.prefill, reps=args.reps, threads=args.threads), format_result, args.json)


if __name__ == "__main__":
    sys.exit(main())
