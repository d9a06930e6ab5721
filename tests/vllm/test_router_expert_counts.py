# SPDX-License-Identifier: Apache-2.0
"""Patch ``router_expert_counts``: vLLM 0.32's DeepSeek-V4 routing on CPU for expert
counts its AVX512 kernels refuse, held to a float64 oracle of DeepSeek's routing.

vLLM's ``hash_topk_cpu`` / ``biased_topk_cpu`` (SGLang ports, AVX512-BF16 library only)
take 64 or more experts; the trained tiny model has 4 (top 2) and stopped at its first
MoE layer on such CPUs ("hash_topk_cpu: unsupported num_experts 4"). Through vLLM's own
``cpu_router._sqrtsoftplus_bias_topk`` after ``plugin.register()``:

- 4 experts, top 2, the biased and the hash path: the float64 oracle's experts and
  weights (sqrt(softplus(logit)); selection by weight + bias, ties to the lower id;
  the unbiased weights renormalized to ``routed_scaling_factor``); where vLLM's kernel
  is loaded it refused the shape (one WARNING) and the torch op served.
- A shape the kernel takes (64 experts, top 6) is vLLM's kernel's answer, bitwise, and
  nothing is refused (other DeepSeek-V4 models untouched).

In a subprocess: ``register()`` arms process-wide hooks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tests.support import ROOT, worker_env  # noqa: E402

pytestmark = pytest.mark.vllm

CODE = r"""
import json, logging, torch
seen = []
class Seen(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("vllm_dsv4_backend.vllm_compat.cpu_ops").addHandler(Seen())
from vllm_dsv4_backend import plugin
plugin.register()
from vllm_dsv4_backend.vllm_compat import cpu_ops, hooks
import vllm._custom_ops as ops
from vllm.model_executor.layers.fused_moe.router import cpu_router as r
cpu_ops.register_missing()  # as the DeepSeek-V4 CPU model's import does
out = {"ported": [hooks.is_port(r.hash_topk_cpu), hooks.is_port(r.biased_topk_cpu)],
       "real_kernel": not cpu_ops.is_fallback("hash_topk_cpu")}
g = torch.Generator().manual_seed(0)

def oracle(logits, bias, k, rsf, ids=None):
    w = torch.nn.functional.softplus(logits.double()).sqrt()
    if ids is None:
        key = w + bias.double()
        # ties to the lower id: stable sort of the negated key
        ids = torch.sort(-key, dim=-1, stable=True).indices[:, :k]
    sel = w.gather(1, ids.long())
    return (sel / sel.sum(-1, keepdim=True) * rsf), ids.long()

rows = {}
for e, k in ((4, 2), (64, 6)):
    logits = torch.randn(9, e, generator=g)
    bias = torch.randn(e, generator=g) * 0.1
    table = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(50)]).int()
    input_ids = torch.randint(0, 50, (9,), generator=g)
    for path in ("biased", "hash"):
        kw = dict(e_score_correction_bias=bias, input_ids=None, hash_indices_table=None)
        want_ids = None
        if path == "hash":
            kw = dict(e_score_correction_bias=None, input_ids=input_ids,
                      hash_indices_table=table)
            want_ids = table[input_ids]
        w, ids = r._sqrtsoftplus_bias_topk(logits, k, True, routed_scaling_factor=1.5, **kw)
        ow, oids = oracle(logits, bias, k, 1.5, want_ids)
        order = torch.argsort(ids.long(), dim=-1)
        oorder = torch.argsort(oids, dim=-1)
        rows[f"{e}/{k}/{path}"] = {
            "ids_equal": torch.equal(ids.long().gather(1, order), oids.gather(1, oorder)),
            "w_err": float((w.double().gather(1, order) - ow.gather(1, oorder)).abs().max()),
        }
        if e == 64:
            if path == "hash":
                rw, rids = ops.hash_topk_cpu(logits, table[input_ids], k, "sqrtsoftplus",
                                             0, e, 1.5)
            else:
                rw, rids = ops.biased_topk_cpu(logits, logits, bias, k, True,
                                               "sqrtsoftplus", 0, 1.5, True)
            rows[f"{e}/{k}/{path}"]["bitwise_vs_op"] = (torch.equal(rw, w)
                                                        and torch.equal(rids, ids))
out["rows"] = rows
out["refused"] = {n: sorted(getattr(getattr(r, n), "__vllm_dsv4_refused__", ()))
                  for n in ("hash_topk_cpu", "biased_topk_cpu")}
out["warnings"] = [m for m in seen if "refuses" in m]
print("RESULT " + json.dumps(out))
"""


def test_router_expert_counts() -> None:
    p = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=worker_env(),
                       capture_output=True, text=True, timeout=300)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-4000:]
    out = json.loads(line.removeprefix("RESULT "))
    assert out["ported"] == [True, True]
    for name, row in out["rows"].items():
        assert row["ids_equal"], (name, row)
        # fp32 arithmetic (the kernel's and the torch op's) against float64
        assert row["w_err"] <= 1e-5, (name, row)
        if "bitwise_vs_op" in row:
            assert row["bitwise_vs_op"], (name, row)
    if out["real_kernel"]:
        # vLLM's kernel refused the 4-expert shape once per op and took the 64-expert one
        assert out["refused"] == {"hash_topk_cpu": [[4, 2]], "biased_topk_cpu": [[4, 2]]}, out
        assert len(out["warnings"]) == 2, out["warnings"]
        assert all("refuses num_experts=4, top_k=2" in m for m in out["warnings"]), out
    else:
        # the torch ops are registered for every shape: nothing to refuse
        assert out["refused"] == {"hash_topk_cpu": [], "biased_topk_cpu": []}, out
        assert out["warnings"] == [], out
