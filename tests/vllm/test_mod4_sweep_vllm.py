# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prompt-length sweep of tests/core/test_mod4_sweep.py (tests.support.mod4_sweep) on
vLLM 0.32's real C++ CPU kernels, and prompt logprobs of the served tiny model, plugin
layer vs vLLM's layer.

Issue 29 item 2 (vllm#55927: a wrong token whenever the prompt length is 3 mod 4).

(b) ``test_mod4_sweep_vllm_kernels``: the same lengths, layer kinds (SWA only, C4 with
    the indexer, C128), prefill tail and decode token, through the ``torch.ops._C``
    kernels the CPU layer calls (``fused_qnorm_rope_kv_insert_cpu``, the compressor
    stores, ``fused_indexer_q_rope_quant_cpu``, ``fp8_paged_mqa_logits_cpu`` +
    ``topk_transform_512_cpu``, ``flash_mla_with_kvcache_cpu``), with the window, C128
    and C4 slot tables built by the plugin layer's own builders
    (``layer.cpu_tables``: ``window_slots``, ``dense_compressed_slots``, ``map_slots``),
    against the float64 oracle. Skips where the loaded ``_C`` library lacks the
    kernels (no AVX512-BF16) or where they are the plugin's torch fallbacks.
(c) ``test_prompt_logprobs_plugin_vs_vllm_layer`` (only with ``DSV4_FULL_SWEEP=1``: two
    engine starts, minutes on 2 cores): prompts of lengths 0..3 mod 4 around 128, 512
    and 2048 tokens, greedy, ``prompt_logprobs``: the plugin's layer and vLLM's own
    (``VLLM_DSV4_ATTN_IMPL=vllm``) must agree exactly (same kernels, same order), every
    prompt position and the first two generated steps.

``DSV4_FULL_SWEEP=1`` is a test switch read only in the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tests.support import ROOT, worker_env  # noqa: E402
from tests.support import mod4_sweep as S  # noqa: E402
from tests.support.threads import one_thread  # noqa: E402
from tests.support.vllm_helpers import (  # noqa: E402
    CPU_LAYER_KERNELS,
    TINY_ENGINE,
    real_cpp_ops,
)

pytestmark = pytest.mark.vllm

MODEL = ROOT / "configs" / "tiny-dsv4"
KERNELS = CPU_LAYER_KERNELS
# vLLM's C++ kernels round more than the torch path (bf16 probabilities and partial
# sums; golden README), yet stay within the torch path's tolerance: measured max
# rel_l2 over the full sweep in docs/correctness.md.
KERNEL_REL_TOL = S.REL_TOL
EXACT_ATOL = 1e-6  # plugin layer vs vLLM layer: same kernels, same order
SERVED_LENGTHS = [128, 129, 130, 131, 512, 513, 514, 515, 2049, 2050, 2051, 2052]


@pytest.fixture(scope="module")
def C() -> Any:
    """``torch.ops._C`` with vLLM's real DeepSeek-V4 kernels; skips where they are absent."""
    return real_cpp_ops(KERNELS)


class LayerTableOps(S.VllmConventionOps):
    """vLLM's kernels with the slot tables of the plugin's CPU layer."""

    name = "vllm_cpu"

    def __init__(self, c: Any) -> None:
        super().__init__(c)
        from vllm_dsv4_backend.layer import cpu_tables

        self.tables = cpu_tables

    def _md(self, w: Any, table: str, block_size: int, t: int) -> SimpleNamespace:
        return SimpleNamespace(block_size=block_size, block_table=w.bt[table],
                               token_to_req_indices=torch.zeros(t, dtype=torch.int64))

    def map_slots(self, local: torch.Tensor, bt: torch.Tensor, bs: int) -> torch.Tensor:
        req = torch.zeros(local.shape[0], dtype=torch.int64)
        return self.tables.map_slots(local, req, bt, bs)

    def window(self, w, pos):
        me = SimpleNamespace(window_size=S.WINDOW)
        md = self._md(w, "swa", S.SWA_BS, pos.numel())
        return self.tables.window_slots(me, md, pos), None

    def c128_slots(self, w, pos):
        me = SimpleNamespace(max_model_len=w.n + 8, compress_ratio=128)
        swa_md = self._md(w, "swa", S.SWA_BS, pos.numel())
        # vLLM's compressed metadata counts tokens per block (256); the layer divides.
        flash_md = self._md(w, "comp128", S.COMP_BS[128] * 128, pos.numel())
        slots = self.tables.dense_compressed_slots(me, swa_md, flash_md, pos)
        return slots, torch.div(pos + 1, 128, rounding_mode="floor").to(torch.int32)


def test_mod4_sweep_vllm_kernels(C) -> None:
    with one_thread():  # an OpenMP barrier per tiny kernel call costs ms on 2 cores
        t0 = time.perf_counter()
        findings, entry = S.sweep(S.LENGTHS, lambda: LayerTableOps(C))
        dt = time.perf_counter() - t0
    print(f"\n[mod4 sweep] vllm_cpu kernels: {len(S.LENGTHS)} lengths, {len(findings)} "
          f"tokens, {dt:.1f} s\n{S.table(findings)}")
    assert not entry, "\n".join(entry)
    bad = [f"L={L} {f.kind} {f.phase} p={f.pos}: rel {f.rel:.3g} {f.note}"
           for L, f in findings if f.note or not f.rel <= KERNEL_REL_TOL]
    assert not bad, f"{len(bad)} token(s) off the oracle:\n" + "\n".join(bad[:40])


# ------------------------------------------------------------------------------------------
# (c) the served tiny model: prompt logprobs, plugin layer vs vLLM's layer
# ------------------------------------------------------------------------------------------
def _worker(spec_path: str, out_path: str) -> None:  # pragma: no cover - subprocess
    """One engine per variant (env applied before it starts), prompts one at a time."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    base = dict(os.environ)
    res: dict[str, Any] = {}
    for name, env in spec["variants"].items():
        os.environ.clear()
        os.environ.update(base)
        os.environ.update(env)
        t0 = time.perf_counter()
        llm = LLM(model=spec["model"], **spec["engine"])
        sp = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, prompt_logprobs=1,
                            ignore_eos=True, seed=0)
        rows = []
        for p in spec["prompts"]:
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
            prompt_lp = [None if d is None else {str(t): v.logprob for t, v in d.items()}
                         for d in o.prompt_logprobs]
            c = o.outputs[0]
            rows.append({"prompt": prompt_lp, "tokens": list(c.token_ids),
                         "logprobs": [{str(t): v.logprob for t, v in d.items()}
                                      for d in c.logprobs]})
        res[name] = {"rows": rows, "s": time.perf_counter() - t0}
        del llm
    Path(out_path).write_text(json.dumps(res))


def _lp_problems(length: int, a: dict, b: dict) -> list[str]:
    out = []
    for i, (x, y) in enumerate(zip(a["prompt"], b["prompt"])):
        if x is None and y is None:
            continue
        if x is None or y is None or set(x) != set(y):
            out.append(f"L={length} prompt position {i}: ids differ")
            break
        worst = max(abs(x[t] - y[t]) for t in x)
        if not worst <= EXACT_ATOL:
            out.append(f"L={length} prompt position {i} (p%4={i % 4}): logprob differs by "
                       f"{worst:.3g}")
            break
    if a["tokens"] != b["tokens"]:
        out.append(f"L={length}: generated {a['tokens']} vs {b['tokens']}")
    for k, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"])):
        common = set(x) & set(y)
        if not common or max(abs(x[t] - y[t]) for t in common) > EXACT_ATOL:
            out.append(f"L={length} step {k}: sampled logprobs differ")
    return out


@pytest.mark.slow
@pytest.mark.skipif(not S.FULL_SWEEP, reason="two engine starts (minutes on 2 cores): "
                    "DSV4_FULL_SWEEP=1")
def test_prompt_logprobs_plugin_vs_vllm_layer(tmp_path: Path) -> None:
    import random

    cfg = json.loads((MODEL / "config.json").read_text())
    rng = random.Random(29)
    prompts = [[rng.randrange(16, cfg["vocab_size"]) for _ in range(n)]
               for n in SERVED_LENGTHS]
    spec = {"model": str(MODEL), "prompts": prompts, "engine": TINY_ENGINE,
            "variants": {"vllm": {"VLLM_DSV4_ATTN_IMPL": "vllm"},
                         "plugin": {"VLLM_DSV4_ATTN_IMPL": "plugin"}}}
    sp, op = tmp_path / "spec.json", tmp_path / "out.json"
    sp.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, str(sp), str(op)], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads(op.read_text())
    problems = []
    for L, a, b in zip(SERVED_LENGTHS, res["vllm"]["rows"], res["plugin"]["rows"]):
        problems += _lp_problems(L, a, b)
    print(f"\n[mod4 served] lengths {SERVED_LENGTHS}: vllm {res['vllm']['s']:.0f} s, "
          f"plugin {res['plugin']['s']:.0f} s, {len(problems)} problem(s)")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":  # pragma: no cover
    _worker(sys.argv[1], sys.argv[2])
