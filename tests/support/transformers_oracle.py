# SPDX-License-Identifier: Apache-2.0
"""The transformers oracle (issue 40): vLLM + the plugin against transformers'
own ``DeepseekV4ForCausalLM`` in fp32 on one seeded checkpoint, teacher-forced.

- :func:`checkpoint`: the bf16 checkpoint of ``scripts/make_oracle_checkpoint.py``
  (written once per directory; the script is the single maker).
- :func:`reference`: transformers' log-probabilities of every token of a
  sequence given its prefix (one full forward, fp32, eager attention).
- The worker (``python -m tests.support.transformers_oracle SPEC OUT``): one
  in-process ``vllm.LLM`` per engine variant (a TP / PP variant's ranks are vLLM's
  worker processes); for each request, greedy decode
  of ``n_decode`` tokens with ``prompt_logprobs=1`` and ``logprobs=1``, then the
  same engine again under each negative-control fault (the switch is read on
  every step, and the engine runs in this process).
- :func:`compare`: per-position logprob difference of the token that was
  actually fed, and top-1 agreement, grouped by the boundary a position sits at.

Position ``p`` below is the position of the token whose logprob is taken
minus one: the logprob of token ``p + 1`` comes from the forward at position
``p`` (what attention at ``p`` sees decides it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import ROOT

MAKER = ROOT / "scripts" / "make_oracle_checkpoint.py"
WINDOW = 128
TOPK_SPAN = 4 * 512  # index_topk entries of 4 tokens: top-k selects from p = 2051 on


def maker() -> Any:
    """``scripts/make_oracle_checkpoint.py`` as a module (the one checkpoint maker)."""
    sys.path.insert(0, str(MAKER.parent))
    try:
        import make_oracle_checkpoint as mk
    finally:
        sys.path.pop(0)
    return mk


def checkpoint(out_dir: Path, layout: str = "bf16") -> Path:
    """The oracle checkpoint in ``out_dir`` (made by the maker script unless present)."""
    if not (out_dir / "model.safetensors").exists():
        maker().write(out_dir, layout=layout)
    return out_dir


def load_reference(model_dir: Path) -> Any:
    return maker().load_transformers(model_dir)


def reference(model: Any, ids: Sequence[int]) -> tuple[list[float], list[int]]:
    """transformers' teacher-forced ``log p(ids[p + 1] | ids[:p + 1])`` and its
    argmax at every position ``p`` (lists of ``len(ids) - 1``)."""
    import torch

    with torch.no_grad():
        x = torch.tensor([list(ids)], dtype=torch.long)
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1)
        nxt = x[0, 1:]
        return lp.gather(1, nxt[:, None])[:, 0].tolist(), lp.argmax(-1).tolist()


# ---------------------------------------------------------------------------------------
# the vLLM side (a subprocess: one in-process engine per variant)
# ---------------------------------------------------------------------------------------
def _run_requests(llm: Any, requests: Sequence[Mapping[str, Any]]) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rows = []
    for req in requests:
        sp = SamplingParams(temperature=0.0, max_tokens=max(1, req["n_decode"]), logprobs=1,
                            prompt_logprobs=1, ignore_eos=True, seed=0)
        o = llm.generate([TokensPrompt(prompt_token_ids=req["ids"])], sp, use_tqdm=False)[0]
        ids = list(req["ids"])
        lp: list[float] = []
        top1: list[int] = []
        # prompt_logprobs[i] scores prompt token i (None for i = 0): the forward at i - 1
        for i, d in enumerate(o.prompt_logprobs[1:], start=1):
            lp.append(d[ids[i]].logprob)
            top1.append(next(t for t, v in d.items() if v.rank == 1))
        c = o.outputs[0]
        gen = list(c.token_ids)[: req["n_decode"]]
        # a generated token's logprob comes from the decode step at the previous position
        for t, d in zip(gen, c.logprobs):
            lp.append(d[t].logprob)
            top1.append(next(k for k, v in d.items() if v.rank == 1))
        rows.append({"ids": ids + gen, "prompt_len": len(ids), "lp": lp, "top1": top1})
    return rows


def worker(spec_path: str, out_path: str) -> None:  # pragma: no cover - subprocess
    spec = json.loads(Path(spec_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the fault switch is read in-process
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import vllm.plugins
    from vllm import LLM

    vllm.plugins.load_general_plugins()  # before LLM() converts attention_config
    base = dict(os.environ)
    out: dict[str, Any] = {}
    for name, var in spec["variants"].items():
        os.environ.clear()
        os.environ.update(base)
        os.environ.update(var.get("env", {}))
        t0 = time.perf_counter()
        model = spec["models"][var.get("model", "bf16")]
        try:
            llm = LLM(model=model, **{**spec["engine"], **var.get("engine", {})})
        except Exception as e:  # a refusal is the variant's result
            if not var.get("may_refuse"):
                raise
            # the last variant (the engine's half-built state is not reused)
            out[name] = {"refused": f"{type(e).__name__}: {e}"}
            continue
        sched = llm.llm_engine.vllm_config.scheduler_config
        par = llm.llm_engine.vllm_config.parallel_config
        res: dict[str, Any] = {"start_s": time.perf_counter() - t0,
                               "parallel": {"tp": par.tensor_parallel_size,
                                            "pp": par.pipeline_parallel_size},
                               "chunked_prefill": bool(sched.enable_chunked_prefill),
                               "max_num_batched_tokens": int(sched.max_num_batched_tokens)}
        t0 = time.perf_counter()
        res["rows"] = _run_requests(llm, spec["requests"])
        res["run_s"] = time.perf_counter() - t0
        res["faults"] = {}
        for fault in var.get("faults", []):
            os.environ["VLLM_DSV4_TEST_ORACLE_FAULT"] = fault
            reqs = [r for r in spec["requests"] if r.get("faults", True)]
            res["faults"][fault] = _run_requests(llm, reqs)
            os.environ["VLLM_DSV4_TEST_ORACLE_FAULT"] = "off"
        out[name] = res
        # a TP / PP engine's workers are processes of their own: stop them before the next
        llm.llm_engine.engine_core.shutdown()
        del llm
    Path(out_path).write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # skip the in-process engines' teardown


# ---------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------
def boundary(p: int, prompt_len: int) -> list[str]:
    """The groups position ``p`` counts in (a position can be in several)."""
    g = ["decode" if p >= prompt_len - 1 else "prefill"]
    g.append("in window" if p < WINDOW - 1 else "past window")
    if p % 4 == 3:
        g.append("C4 entry completes")
    if p % 128 == 127:
        g.append("C128 entry completes")
    if p >= TOPK_SPAN + 3:  # (p + 1) // 4 > 512 entries: the indexer's top-k selects
        g.append("top-k selects")
    return g


@dataclass
class Stats:
    n: int = 0
    agree: int = 0
    worst: float = 0.0
    worst_at: tuple[int, int] = (-1, -1)  # (request, position)
    diffs: list[float] = field(default_factory=list)

    def add(self, d: float, same: bool, where: tuple[int, int]) -> None:
        self.n += 1
        self.agree += int(same)
        self.diffs.append(d)
        if d > self.worst:
            self.worst, self.worst_at = d, where

    def row(self) -> dict[str, Any]:
        s = sorted(self.diffs)
        return {"n": self.n, "top1_agree": self.agree / max(self.n, 1), "worst": self.worst,
                "p99": s[min(len(s) - 1, int(0.99 * len(s)))] if s else 0.0,
                "mean": sum(s) / max(len(s), 1), "worst_at": self.worst_at}


def compare(rows: Sequence[Mapping[str, Any]],
            refs: Sequence[tuple[list[float], list[int]]]) -> dict[str, dict[str, Any]]:
    """Per group: positions, top-1 agreement, worst / p99 / mean |logprob diff|."""
    groups: dict[str, Stats] = {}
    for r, (row, (ref_lp, ref_top)) in enumerate(zip(rows, refs)):
        assert len(row["lp"]) == len(ref_lp), (len(row["lp"]), len(ref_lp))
        for p, (a, b, ta, tb) in enumerate(zip(row["lp"], ref_lp, row["top1"], ref_top)):
            d = abs(a - b)
            for g in ["all", *boundary(p, row["prompt_len"])]:
                groups.setdefault(g, Stats()).add(d, ta == tb, (r, p))
    return {g: s.row() for g, s in sorted(groups.items())}


def table(results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    lines = ["| variant | group | positions | top-1 agree | worst abs diff (req, p) | p99 | mean |",
             "|---|---|---|---|---|---|---|"]
    for v, groups in results.items():
        for g, s in groups.items():
            lines.append(f"| {v} | {g} | {s['n']} | {s['top1_agree']:.4f} | {s['worst']:.3g} "
                         f"{tuple(s['worst_at'])} | {s['p99']:.3g} | {s['mean']:.3g} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    worker(sys.argv[1], sys.argv[2])
