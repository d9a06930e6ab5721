# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Engine-step A/B on CPU: whole model steps with the plugin's layer and builder vs
with vLLM's own, alternating step by step in one engine.

A real vLLM engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
uniprocess executor) with the plugin's layer. Before every engine step
(``execute_model``) the bench switches the whole model to one side, the other side
for the next step:

* ``plugin``: the plugin's ``DSV4CPUAttention`` / ``DSV4Indexer`` /
  ``DSV4Compressor`` classes and its sliding-window metadata builder;
* ``vllm``: the same modules with their classes set to vLLM's
  ``DeepseekV4CPUAttention`` / ``DeepseekV4CPUIndexer`` /
  ``DeepseekV4CPUCompressor``, and vLLM's ``DeepseekV4CPUSparseSWAMetadataBuilder``
  (the compressed caches' builder is vLLM's on both sides).

Same weights, caches and requests; each step is one real forward of every layer, so
nothing is repeated or warmer on one side. Adjacent steps are ~10 ms apart, close
enough that this host's second-to-second speed changes cancel in the pair (served
blocks a few seconds apart do not: ``e2e_layers``). Per step it records the time of
``execute_model``, and inside it of ``_build_attention_metadata`` (every group's
builder), ``_model_forward`` and, inside that, the attention layers' ``forward``
(``attn``, summed over the step's layers: the layer-level figure, in real steps); the
ratio vLLM / plugin (>= 1: the plugin at least as fast) of each pair of steps doing the
same work, their median and its 95% confidence interval. The layers are bitwise equal,
so the generation is the same whichever side runs a step: the bench checks that its
tokens equal a run with the plugin's side only.

"The same work" is more than the token count. A compressed layer's compressor does
its real work (compress, norm, RoPE, store) only in a step where a token closes a
window of ``compress_ratio`` positions: every 4th decode step for C4 at batch 1, and
in lock step for a batch of equal prompts. Strict step-by-step alternation would hand
every such step to one side (positions advance by one per step, so a window's end
always falls on steps of the same parity). So each step's work is its token count and,
per compress ratio, the number of its tokens that close a window
(:func:`step_work`); the sides alternate within each kind of work, and a pair is two
consecutive steps of the same work (adjacent steps, or four apart for the closing
ones). The result says how many closing steps each side ran.

Cases: decode at batch 1 / 8 / 32 (prompts of ``--context`` tokens, default 16) and
prefills of ``--prefill`` tokens (one request per step, alternating sides request by request).

``vllm-dsv4-bench step-ab [--requests 6] [--threads N] [--json out.json]``. A served CPU
worker on a 2-core host runs on one thread (vLLM reserves a core for the engine process and
drops torch to one thread for serving); ``--threads 1`` times the steps as it runs them.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from vllm_dsv4_backend.bench import ab
from vllm_dsv4_backend.bench.ab import SIDES

SCHEMA = "vllm-dsv4-step-ab/2"  # 2: pairs of the same work, closing_steps
# execute_model, the two parts of it the layer and the builders change, and inside the
# forward the attention layers' own forwards (summed over the step's layers).
PARTS = ("step", "build", "forward", "attn")


def step_work(spans: Iterable[tuple[int, int]], ratios: Sequence[int]) -> tuple[int, ...]:
    """A step's work: its token count, then for each compress ratio ``r`` the number of
    its tokens that close a compressor window (position ``p`` with ``(p + 1) % r == 0``).

    ``spans``: ``(computed, scheduled)`` per request, the step covering positions
    ``computed .. computed + scheduled - 1``.
    """
    spans = list(spans)
    return (sum(n for _, n in spans),
            *(sum((c + n) // r - c // r for c, n in spans) for r in ratios))


def _spans(scheduler_output: Any) -> Iterator[tuple[int, int]]:
    """``(num_computed_tokens, num_scheduled_tokens)`` of every request in a vLLM
    ``SchedulerOutput``."""
    scheduled = scheduler_output.num_scheduled_tokens
    for req in scheduler_output.scheduled_new_reqs:
        yield req.num_computed_tokens, scheduled[req.req_id]
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
        yield computed, scheduled[req_id]


class Sides:
    """Switches an engine's model between the plugin's classes and vLLM's."""

    def __init__(self, runner: Any) -> None:
        from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder
        from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

        from vllm_dsv4_backend import backend
        from vllm_dsv4_backend.layer.cpu import DSV4CPUAttention

        self.layers = [m for m in runner.get_model().modules()
                       if isinstance(m, DSV4CPUAttention)]
        if not self.layers:
            raise RuntimeError("step-ab: the engine is not running the plugin's layer")
        self.ratios = sorted({m.compress_ratio for m in self.layers if m.compress_ratio > 1})
        self.parts = [p for m in self.layers for p in ab.swapped_parts(m)]
        swa_cls = backend.get_swa_builder_cls()
        self.swa_builders = [b for groups in runner.attn_groups for g in groups
                             for b in g.metadata_builders if type(b) is swa_cls]
        self.layer_classes = (DSV4CPUAttention, DeepseekV4CPUAttention)
        self._builder_classes = {"plugin": swa_cls,
                                 "vllm": DeepseekV4CPUSparseSWAMetadataBuilder}

    def set(self, side: str) -> None:
        ab.set_classes(self.parts, side)
        for b in self.swa_builders:
            b.__class__ = self._builder_classes[side]


class _StepRecorder:
    """Wraps the model runner's ``execute_model`` (side switch + timers)."""

    def __init__(self, sides: Sides) -> None:
        self.sides = sides
        self.alternate = True
        self._runs: Counter[tuple[int, ...]] = Counter()  # steps per kind of work
        self.steps: list[dict[str, Any]] = []
        self._parts: dict[str, float] = {}

    @contextlib.contextmanager
    def installed(self, runner_cls: type) -> Iterator[None]:
        originals = {name: runner_cls.__dict__[name] for name in
                     ("execute_model", "_build_attention_metadata", "_model_forward")}
        # Each side's attention layer class (neither forward calls the other's).
        layer_forwards = {cls: cls.__dict__["forward"] for cls in self.sides.layer_classes}

        def timed(fn: Any, label: str) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._parts[label] = self._parts.get(label, 0.0) + time.perf_counter() - t0
            return wrapper

        build = timed(originals["_build_attention_metadata"], "build")
        forward = timed(originals["_model_forward"], "forward")

        def execute_model(runner: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            work = step_work(_spans(scheduler_output), self.sides.ratios)
            side = "plugin"
            if self.alternate:
                side = SIDES[self._runs[work] % 2]
                self._runs[work] += 1
            self.sides.set(side)
            self._parts = {}
            t0 = time.perf_counter()
            try:
                return originals["execute_model"](runner, scheduler_output, *args, **kwargs)
            finally:
                self.steps.append({"side": side, "step": time.perf_counter() - t0,
                                   "tokens": work[0], "work": work, **self._parts})

        runner_cls.execute_model = execute_model
        runner_cls._build_attention_metadata = build
        runner_cls._model_forward = forward
        for cls, fn in layer_forwards.items():
            cls.forward = timed(fn, "attn")
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(runner_cls, name, fn)
            for cls, fn in layer_forwards.items():
                cls.forward = fn
            self.sides.set("plugin")


def pair_ratios(steps: Sequence[dict[str, Any]], part: str, tokens: int) -> list[float]:
    """vLLM / plugin of ``part`` for each pair of consecutive ``tokens``-token steps of
    the same work (:func:`step_work`; a step without ``"work"`` counts by its tokens)
    on opposite sides, in the order the pairs started (each step in one pair at most;
    the same pairs for every part, a pair left out where either step lacks ``part``)."""
    groups: dict[tuple[int, ...], list[tuple[int, dict[str, Any]]]] = {}
    for i, s in enumerate(steps):
        if s["tokens"] == tokens:
            groups.setdefault(tuple(s.get("work", ())), []).append((i, s))
    out: list[tuple[int, float]] = []
    for rows in groups.values():
        j = 0
        while j + 1 < len(rows):
            (i, a), (_, b) = rows[j], rows[j + 1]
            if a["side"] == b["side"]:
                j += 1
                continue
            p, v = (a, b) if a["side"] == "plugin" else (b, a)
            if p.get(part) and part in v:
                out.append((i, v[part] / p[part]))
            j += 2
    return [r for _, r in sorted(out)]


def summarize(steps: Sequence[dict[str, Any]], tokens: int) -> dict[str, Any]:
    row: dict[str, Any] = {"tokens": tokens, "closing_steps": {
        side: sum(1 for s in steps if s["tokens"] == tokens and s["side"] == side
                  and any(s.get("work", ())[1:])) for side in SIDES}}
    for part in PARTS:
        ms = {side: [1e3 * s[part] for s in steps
                     if s["tokens"] == tokens and s["side"] == side and part in s]
              for side in SIDES}
        row[part] = {**ab.ratio_stats(pair_ratios(steps, part, tokens)),
                     **{f"{side}_ms_median": statistics.median(v) if v else None
                        for side, v in ms.items()}}
    return row


def _runner(llm: Any) -> Any:
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    return core.model_executor.driver_worker.worker.model_runner


def run(*, flash_shaped: bool = False, batches: Sequence[int] = (1, 8, 32),
        prefill: int = 1024, output_len: int = 64, requests: int = 6, context: int = 16,
        threads: int | None = None, progress: Any = sys.stderr) -> dict[str, Any]:
    """Run every case in one engine; returns the JSON-able result."""
    from vllm_dsv4_backend import envs

    if envs.VLLM_DSV4_ATTN_IMPL == "vllm":
        raise ValueError("step-ab switches the plugin's layer to vLLM's and back: run it "
                         "with VLLM_DSV4_ATTN_IMPL=auto or plugin, not vllm")
    max_len = max(prefill + 16, context + output_len + 16, 2048)
    llm, vocab = ab.start_engine(flash_shaped=flash_shaped, threads=threads,
                                 max_model_len=max_len, max_num_batched_tokens=max_len,
                                 max_num_seqs=max(batches), distributed_executor_backend="uni",
                                 generation_config="vllm")
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    rec = _StepRecorder(Sides(_runner(llm)))
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[Any]:
        return ab.token_prompts(rng, vocab, [length] * n)

    say = ab.sayer("step-ab", progress)
    t0 = time.monotonic()
    rows, identical = [], {}
    with rec.installed(GPUModelRunner):
        decode = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for b in batches:
            say(f"decode b{b}: 1 warm-up + {requests} generations of {output_len} tokens")
            fixed = prompts(b, context)
            rec.alternate = False
            want = [o.outputs[0].token_ids for o in llm.generate(fixed, decode, use_tqdm=False)]
            rec.alternate, rec.steps = True, []
            got = [o.outputs[0].token_ids for o in llm.generate(fixed, decode, use_tqdm=False)]
            identical[f"decode_b{b}"] = got == want
            for _ in range(requests):
                llm.generate(prompts(b, context), decode, use_tqdm=False)
            rows.append({"case": f"decode_b{b}", **summarize(rec.steps, b)})
        say(f"prefill {prefill}: {8 * requests} one-token requests")
        one = SamplingParams(temperature=0.0, max_tokens=1)
        llm.generate(prompts(1, prefill), one, use_tqdm=False)
        rec.steps = []
        for _ in range(8 * requests):
            llm.generate(prompts(1, prefill), one, use_tqdm=False)
        rows.append({"case": f"prefill_{prefill}", **summarize(rec.steps, prefill)})
    import torch

    return {"schema": SCHEMA, "model": "flash-shaped" if flash_shaped else "tiny",
            "threads": torch.get_num_threads(), "requests": requests,
            "output_len": output_len, "context": context, "rows": rows,
            "tokens_identical": identical, "wall_s": time.monotonic() - t0}


def format_result(res: dict[str, Any]) -> str:
    lines = [(f"engine-step A/B ({res['model']} model, {res['threads']} thread(s)): ratio = "
              "vLLM side / plugin side per pair of consecutive steps of the same work (>= 1: "
              "plugin at least as fast), median and its 95% CI; step = execute_model, build = "
              "every metadata builder, forward = the model forward, attn = its attention layers' "
              "forwards"),
             (f"{'case':<14}{'part':<9}{'pairs':>6}{'plugin ms':>11}{'vLLM ms':>10}"
              f"{'ratio':>8}{'median CI':>16}  verdict")]
    for r in res["rows"]:
        for part in PARTS:
            x = r[part]
            if not x["pairs"]:
                lines.append(f"{r['case']:<14}{part:<9}{0:>6}  (no pair: the batch never "
                             "formed)")
                continue
            lines.append(f"{r['case']:<14}{part:<9}{x['pairs']:>6}{x['plugin_ms_median']:>11.3f}"
                         f"{x['vllm_ms_median']:>10.3f}{x['ratio_median']:>8.3f}"
                         f"{x['ratio_ci95_lo']:>8.3f}..{x['ratio_ci95_hi']:<6.3f}  "
                         f"{x['verdict']}")
    same = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in res["tokens_identical"].items())
    lines.append(f"tokens of an alternating run equal the plugin-only run: {same}")
    closing = ", ".join(f"{r['case']} {r['closing_steps']['plugin']}/{r['closing_steps']['vllm']}"
                        for r in res["rows"])
    lines.append(f"steps where a token closes a compressor window, plugin/vLLM: {closing}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = ab.parser(__doc__, context=16)
    p.add_argument("--output-len", type=int, default=64, help="tokens per decode request")
    p.add_argument("--requests", type=ab.positive, default=6,
                   help="generations per decode case (8x as many prefills; default 6)")
    args = p.parse_args(argv)
    if args.output_len < 2:
        p.error("--output-len must be >= 2")
    return ab.conclude("step-ab", lambda: run(
        flash_shaped=args.flash_shaped, batches=args.batches, prefill=args.prefill,
        output_len=args.output_len, requests=args.requests, context=args.context,
        threads=args.threads), format_result, args.json)


if __name__ == "__main__":
    sys.exit(main())
