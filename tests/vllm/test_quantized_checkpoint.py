# SPDX-License-Identifier: Apache-2.0
"""The oracle checkpoint in DeepSeek-V4-Flash's quantized layout (issue 40 item 1):
``scripts/make_oracle_checkpoint.py --layout fp8-mxfp4``, held to readers that are not
the maker's.

- Names: vLLM 0.32's own DeepSeek-V4 weight mapper (``hf_to_vllm_mapper`` of the CPU
  model, expert dtype "fp4") routes every ``.scale`` where vLLM's loader registers it:
  a routed expert's to ``weight_scale`` (MXFP4), every other to ``weight_scale_inv``
  (FP8 block), and every quantized weight has its scale.
- Values: vLLM's own MXFP4 reader of DeepSeek-V4 experts
  (``flashinfer_moe_ep._dequant_mxfp4_ue8m0_gran32``, used by vLLM's EP path) decodes
  the experts to exactly the values transformers' reference gets
  (``dequantize_flash_layout``); each decoded value is the e2m1 grid point nearest the
  bf16 weight (float64), and each FP8 weight is within e4m3's half ulp of it with the
  smallest power-of-two block scale that fits 448.
- transformers loads the dequantized reference with no missing or unexpected key.

Whether vLLM runs the layout end to end is ``test_transformers_oracle.py::
test_quantized_layout_vs_transformers`` (AMX CPUs only: vLLM 0.32's CPU build has no
other FP8 block-scaled linear or MXFP4 MoE kernel; elsewhere
``test_quantized_layout_loads_only_with_amx`` checks that it refuses).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.support import transformers_oracle as O  # noqa: E402

pytestmark = [pytest.mark.vllm]

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@pytest.fixture(scope="module")
def layouts() -> dict[str, Any]:
    mk = O.maker()
    cfg = mk.oracle_config()
    bf16 = mk.deepseek_state_dict(cfg, mk.SEED)
    return {"mk": mk, "bf16": bf16, "q": mk.quantize_flash_layout(bf16)}


def test_names_reach_vllms_parameters(layouts: dict[str, Any]) -> None:
    import torch
    from vllm.models.deepseek_v4.cpu.model import _make_deepseek_v4_weights_mapper

    mk, bf16, q = layouts["mk"], layouts["bf16"], layouts["q"]
    mapper = _make_deepseek_v4_weights_mapper("fp4")
    n_fp8 = n_fp4 = 0
    for name, t in q.items():
        if name.endswith(".scale"):
            assert t.dtype == torch.float8_e8m0fnu, (name, t.dtype)
            w = q[name.removesuffix("scale") + "weight"]
            mapped = mapper.apply_list([name])[0]
            if re.search(r"\.ffn\.experts\.\d+\.w[123]\.scale$", name):
                n_fp4 += 1
                assert w.dtype == torch.int8 and mapped.endswith(".weight_scale"), (name, mapped)
                assert tuple(t.shape) == (w.shape[0], w.shape[1] * 2 // 32)
            else:
                n_fp8 += 1
                assert w.dtype == torch.float8_e4m3fn, (name, w.dtype)
                assert mapped.endswith(".weight_scale_inv"), (name, mapped)
                assert tuple(t.shape) == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        elif t.dtype in (torch.int8, torch.float8_e4m3fn):
            assert name.removesuffix("weight") + "scale" in q, f"{name} has no scale"
        else:
            assert torch.equal(t, bf16[name]), f"{name} changed but is not quantized"
    assert set(bf16) == {k for k in q if not k.endswith(".scale")}
    # per layer 5 FP8 attention linears and 3 shared-expert ones, plus the indexer's wq_b
    # in each C4 layer; 3 MXFP4 matrices per routed expert
    cfg = mk.oracle_config()
    ratios = cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    n_layers, n_c4 = len(ratios), ratios.count(4)
    assert (n_fp8, n_fp4) == (n_layers * 8 + n_c4, n_layers * cfg["n_routed_experts"] * 3)
    # the bf16 ones Flash keeps: the compressors' and the indexer's weights_proj
    for name in bf16:
        if re.search(r"compressor\.w(kv|gate)\.weight$|indexer\.weights_proj\.weight$", name):
            assert q[name].dtype == torch.bfloat16, name
    assert mk.FP8_LINEAR.search("layers.0.attn.wo_a.weight")


def test_vllms_mxfp4_reader_gets_the_reference_values(layouts: dict[str, Any]) -> None:
    import torch
    from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import (
        _dequant_mxfp4_ue8m0_gran32,
    )

    mk, bf16, q = layouts["mk"], layouts["bf16"], layouts["q"]
    ref = mk.dequantize_flash_layout(q)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    n = 0
    for name, w in q.items():
        if w.dtype != torch.int8:
            continue
        scale = q[name.removesuffix("weight") + "scale"]
        got = _dequant_mxfp4_ue8m0_gran32(w, scale)
        assert torch.equal(got, ref[name]), f"{name}: vLLM reads other values"
        # float64: the decoded value is an e2m1 grid point nearest w / 2**e
        s = scale.float().double().repeat_interleave(32, dim=-1)
        y = bf16[name].double() / s
        assert (y.abs() <= 6).all(), f"{name}: a block scale too small (saturates)"
        nearest = (y.abs()[..., None] - grid).abs().min(-1).values
        err = (got.double() / s - y).abs()
        assert (err <= nearest + 1e-12).all(), f"{name}: not the nearest e2m1 value"
        n += 1
    assert n > 0


def test_fp8_blocks_round_to_nearest(layouts: dict[str, Any]) -> None:
    import torch

    mk, bf16, q = layouts["mk"], layouts["bf16"], layouts["q"]
    ref = mk.dequantize_flash_layout(q)
    for name, w in q.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        scale = q[name.removesuffix("weight") + "scale"].double()
        o, i = w.shape
        s = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:o, :i]
        x = bf16[name].double()
        deq = ref[name].double()
        assert torch.equal(deq, (w.double() * s)), f"{name}: reference is not w * scale"
        # e4m3: 3 mantissa bits (half ulp 2**-4 relative); subnormals below 2**-6
        tol = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)
        assert ((deq - x).abs() <= tol).all(), name
        # the smallest power-of-two scale: block max within 448, above 224
        amax = torch.zeros_like(scale)
        for bo in range(scale.shape[0]):
            for bi in range(scale.shape[1]):
                amax[bo, bi] = x[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128].abs().max()
        scaled_max = amax / scale
        fits, smallest = scaled_max <= 448, scaled_max > 224
        assert (fits & smallest).all(), (name, scaled_max.min(), scaled_max.max())


def test_dequantized_reference_loads_in_transformers(tmp_path: Path) -> None:
    mk = O.maker()
    qdir = mk.write(tmp_path / "q", layout="fp8-mxfp4")
    cfg = (qdir / "config.json").read_text()
    assert '"expert_dtype": "fp4"' in cfg and '"scale_fmt": "ue8m0"' in cfg
    mk.verify(mk.write_dequantized(qdir, tmp_path / "values"))
