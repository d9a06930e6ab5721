# SPDX-License-Identifier: Apache-2.0
"""Write a seeded DeepSeek-V4 checkpoint that both vLLM and transformers load.

The transformers oracle (issue 40, ``tests/vllm/test_transformers_oracle.py``)
needs real weights on disk: vLLM's ``--load-format dummy`` seeds weights
inside vLLM only, so transformers could never see the same model. This script
builds transformers' ``DeepseekV4ForCausalLM`` from the tiny config
(``configs/tiny-dsv4``, written by ``scripts/make_tiny_model.py``, whose shape
choices it keeps: FlashMLA-legal head_dim 512 = 448 + 64, 8 heads, indexer 64 x
128), fills every tensor with the plugin's seeded fan-in rule
(``vllm_dsv4_backend.vllm_compat.dummy_init.init_tensor_``, keyed by the DeepSeek name, so
the values do not depend on module order), and saves it under DeepSeek's own
checkpoint names (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``hc_head_fn`` ...): the names vLLM's
``DeepseekV4ForCausalLM.hf_to_vllm_mapper`` reads and transformers'
``conversion_mapping["deepseek_v4"]`` converts from. The DeepSeek -> transformers
direction is transformers' own; only the inverse (:func:`to_deepseek_name`) is
written here, and :func:`verify` proves it by loading the directory back with
``from_pretrained`` (no missing or unexpected key, every tensor equal).

Conditioning: plain seeded fan-in weights make a chaotic model. Measured in
transformers (fp32, 131 tokens): multiplying every weight by ``1 + 2^-8 N(0, 1)``
moved the logprobs by 0.089 on average (max 0.97) and changed 18 % of the top-1
tokens, mostly through near-tied MoE routing; an oracle cannot resolve a one-token
fault under that noise. :data:`CONDITION` scales three groups after the seeded
init: router weights x0.1 (selection then follows the fixed, well-spread score
bias: no near-tie flips), the hyper-connection mixers x0.1 and the experts' down
projections x0.3; the same perturbation then moves logprobs by 0.023 on average
(max 0.12). Attention is untouched.

Top-k span: ``index_topk`` stays 512 (vLLM 0.32's ``topk_transform_512_cpu``,
and the CPU layer, accept nothing else), so a C4 layer's top-k selection
starts once a token sees more than 512 compressed entries: position 2051
(prompt length 2052). ``max_position_embeddings`` 8192 and the tests' 4096
max-model-len keep that well inside.

Variants:

* ``bf16`` (default): every weight in bf16, ``expert_dtype`` "bf16" (vLLM then
  builds unquantized experts), no ``quantization_config``.
* ``fp8-mxfp4`` (``--layout fp8-mxfp4``): the layout DeepSeek-V4-Flash ships, from
  the same seeded weights. Linears of the attention (``wq_a``, ``wq_b``, ``wkv``,
  ``wo_a``, ``wo_b``, the indexer's ``wq_b``) and the shared expert: FP8 e4m3 with one
  UE8M0 scale per 128 x 128 block (``.scale``, ``float8_e8m0fnu``); routed experts:
  MXFP4 (``int8`` [out, in / 2], element ``2k`` in the low nibble, one UE8M0 ``.scale``
  per 32 inputs); the compressors' projections, the indexer's ``weights_proj``, the
  router, norms, embeddings and hyper-connections stay bf16, as in the Flash
  checkpoint. ``quantization_config`` is Flash's (``fp8``, ``ue8m0``, blocks [128, 128],
  dynamic activations), ``expert_dtype`` "fp4". transformers 5.19 reads no MXFP4
  experts, so its reference is :func:`write_dequantized`: the same values dequantized
  into a bf16 checkpoint (exact: every e4m3 x 2^k and e2m1 x 2^k value is a bf16).
  vLLM 0.32's CPU build loads this layout only on AMX CPUs (docs/correctness.md).

Usage::

    .venv/bin/python scripts/make_oracle_checkpoint.py OUT_DIR [--seed 0]
    .venv/bin/python scripts/make_oracle_checkpoint.py OUT_DIR --verify   # + round trip
    .venv/bin/python scripts/make_oracle_checkpoint.py OUT_DIR --layout fp8-mxfp4 \
        [--dequantized REF_DIR]   # + the bf16 reference transformers reads
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-dsv4"
SEED = 0

# transformers name (after "model." is dropped) -> DeepSeek name, applied in
# order: the inverse of transformers' conversion_mapping["deepseek_v4"].
_LEAF = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_RULES: list[tuple[str, str]] = [
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    # indexer: scorer and q projection sit under the indexer, its compressor
    # under indexer.compressor (transformers nests them the other way round)
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    # compressor norms are DeepSeek's ``norm``; the attention's own stays kv_norm
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.wgate\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
]


# (DeepSeek-name regex, factor) applied after the seeded init (see "Conditioning").
CONDITION: list[tuple[str, float]] = [
    (r"^layers\.\d+\.ffn\.gate\.weight$", 0.1),
    (r"(^|\.)hc_(attn|ffn|head)_fn$", 0.1),
    (r"\.ffn\.(experts\.\d+|shared_experts)\.w2\.weight$", 0.3),
]


# DeepSeek-V4-Flash's quantized layout (--layout fp8-mxfp4)
LAYOUTS = ("bf16", "fp8-mxfp4")
FP8_LINEAR = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$"
    r"|\.ffn\.shared_experts\.w[123]\.weight$")
MXFP4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FP8_BLOCK = 128
FLASH_QUANT_CONFIG: dict[str, Any] = {
    "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
    "scale_fmt": "ue8m0", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def to_deepseek_name(hf_name: str) -> str:
    """transformers' parameter name -> DeepSeek's checkpoint name (non-expert)."""
    name = hf_name.removeprefix("model.")
    if name in _LEAF:
        return _LEAF[name]
    for pat, rep in _RULES:
        name = re.sub(pat, rep, name)
    return name


def oracle_config(seed: int = SEED) -> dict[str, Any]:
    """The tiny config (configs/tiny-dsv4) for a real checkpoint: bf16 experts
    (vLLM's unquantized MoE; the shipped tiny config says fp4 for the dummy
    engine) and no dummy-init marker (weights come from the files)."""
    cfg = json.loads((TINY / "config.json").read_text())
    cfg.pop("vllm_dsv4_dummy_init", None)
    cfg["expert_dtype"] = "bf16"
    cfg["torch_dtype"] = "bfloat16"
    cfg["vllm_dsv4_oracle_checkpoint"] = {"seed": seed, "variant": "bf16"}
    return cfg


def deepseek_state_dict(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every tensor of the checkpoint under its DeepSeek name, bf16 (tid2eid int64)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from vllm_dsv4_backend.vllm_compat.dummy_init import _generator, init_tensor_

    hf_cfg = DeepseekV4Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(hf_cfg)
    out: dict[str, torch.Tensor] = {}
    for hf_name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2I, H] = cat(w1, w3) per expert
            base = to_deepseek_name(hf_name.removesuffix("gate_up_proj"))
            inter = shape[1] // 2
            for e in range(shape[0]):
                for w in ("w1", "w3"):
                    name = f"{base}{e}.{w}.weight"
                    out[name] = torch.empty(inter, shape[2])
            continue
        if hf_name.endswith("experts.down_proj"):  # [E, H, I]
            base = to_deepseek_name(hf_name.removesuffix("down_proj"))
            for e in range(shape[0]):
                out[f"{base}{e}.w2.weight"] = torch.empty(shape[1], shape[2])
            continue
        name = to_deepseek_name(hf_name)
        if name.endswith("tid2eid"):
            # the hash router's token -> experts table: seeded, distinct experts per token
            g = _generator(seed, name)
            n_exp = cfg["n_routed_experts"]
            out[name] = torch.stack([torch.randperm(n_exp, generator=g)[: shape[1]]
                                     for _ in range(shape[0])]).to(torch.int64)
            continue
        out[name] = torch.empty(shape)
    for name, t in out.items():
        if t.dtype.is_floating_point:
            init_tensor_(name, t, seed)
            for pat, factor in CONDITION:
                if re.search(pat, name):
                    t.mul_(factor)
            out[name] = t.to(torch.bfloat16)
    return out


def hf_to_deepseek(hf_state: dict[str, Any]) -> dict[str, Any]:
    """A transformers ``DeepseekV4ForCausalLM`` state dict (real values, e.g. a
    trained model: ``scripts/train_tiny_dsv4.py``) under DeepSeek's names, the
    stacked experts split per expert as :func:`deepseek_state_dict` lays them out."""
    out: dict[str, Any] = {}
    for hf_name, t in hf_state.items():
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2I, H] = cat(w1, w3) per expert
            base = to_deepseek_name(hf_name.removesuffix("gate_up_proj"))
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.w1.weight"] = t[e, :inter]
                out[f"{base}{e}.w3.weight"] = t[e, inter:]
        elif hf_name.endswith("experts.down_proj"):  # [E, H, I]
            base = to_deepseek_name(hf_name.removesuffix("down_proj"))
            for e in range(t.shape[0]):
                out[f"{base}{e}.w2.weight"] = t[e]
        else:
            out[to_deepseek_name(hf_name)] = t
    return out


def fp8_block_quantize(w: Any) -> tuple[Any, Any]:
    """``[O, I]`` float -> (``[O, I]`` e4m3 weight, ``[ceil(O/128), ceil(I/128)]`` UE8M0
    scale): each 128 x 128 block (partial at the edges) divided by the smallest power of
    two that brings its max |w| within 448 (the indexer cache's exact UE8M0 exponent),
    round to nearest."""
    import torch

    from vllm_dsv4_backend.formats.indexer_cache import fp8_exponent

    o, i = w.shape
    bo, bi = -(-o // FP8_BLOCK), -(-i // FP8_BLOCK)
    padded = torch.zeros(bo * FP8_BLOCK, bi * FP8_BLOCK, dtype=torch.float32)
    padded[:o, :i] = w.float()
    blocks = padded.view(bo, FP8_BLOCK, bi, FP8_BLOCK)
    scale = torch.ldexp(torch.ones(bo, bi), fp8_exponent(blocks.abs().amax(dim=(1, 3))))
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return (q.view(bo * FP8_BLOCK, bi * FP8_BLOCK)[:o, :i].contiguous(),
            scale.to(torch.float8_e8m0fnu))


def fp8_block_dequantize(q: Any, scale: Any) -> Any:
    """The float32 values an FP8 block-scaled weight stands for."""
    o, i = q.shape
    s = scale.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return q.float() * s[:o, :i]


def quantize_flash_layout(sd: dict[str, Any]) -> dict[str, Any]:
    """A bf16 DeepSeek-named state dict in DeepSeek-V4-Flash's quantized layout."""
    import torch

    from vllm_dsv4_backend.formats import mxfp4

    out: dict[str, Any] = {}
    for name, t in sd.items():
        stem = name.removesuffix("weight")
        if MXFP4_EXPERT.search(name):
            packed, exp = mxfp4.quantize(t.float())
            out[name] = packed.view(torch.int8)
            out[stem + "scale"] = exp.view(torch.float8_e8m0fnu)
        elif FP8_LINEAR.search(name):
            out[name], out[stem + "scale"] = fp8_block_quantize(t)
        else:
            out[name] = t
    return out


def dequantize_flash_layout(qsd: dict[str, Any]) -> dict[str, Any]:
    """The quantized layout's values as a bf16 state dict (exact) without ``.scale``."""
    import torch

    from vllm_dsv4_backend.formats import mxfp4

    out: dict[str, Any] = {}
    for name, t in qsd.items():
        if name.endswith(".scale"):
            continue
        scale = qsd.get(name.removesuffix("weight") + "scale")
        if scale is None:
            out[name] = t
        elif t.dtype == torch.int8:
            out[name] = mxfp4.dequantize(t.view(torch.uint8),
                                         scale.view(torch.uint8)).to(torch.bfloat16)
        else:
            out[name] = fp8_block_dequantize(t, scale).to(torch.bfloat16)
    return out


def save_checkpoint(out_dir: Path, sd: dict[str, Any], cfg: dict[str, Any]) -> Path:
    """``model.safetensors`` (``sd``), ``config.json`` (``cfg``) and the tiny tokenizer."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY / f, out_dir / f)
    return out_dir


def write(out_dir: Path, seed: int = SEED, layout: str = "bf16") -> Path:
    """Write config, tokenizer and ``model.safetensors`` (``layout``: :data:`LAYOUTS`)
    into ``out_dir``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    cfg = oracle_config(seed)
    sd = deepseek_state_dict(cfg, seed)
    if layout == "fp8-mxfp4":
        sd = quantize_flash_layout(sd)
        cfg["expert_dtype"] = "fp4"
        cfg["quantization_config"] = dict(FLASH_QUANT_CONFIG)
    cfg["vllm_dsv4_oracle_checkpoint"]["variant"] = layout
    return save_checkpoint(out_dir, sd, cfg)


def write_dequantized(quantized_dir: Path, out_dir: Path) -> Path:
    """The bf16 checkpoint holding exactly the values of ``quantized_dir`` (what
    transformers, which reads no MXFP4 experts, runs as the quantized model's reference)."""
    from safetensors.torch import load_file

    cfg = json.loads((quantized_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["expert_dtype"] = "bf16"
    cfg["vllm_dsv4_oracle_checkpoint"]["variant"] = "fp8-mxfp4 dequantized"
    qsd = load_file(str(quantized_dir / "model.safetensors"))
    return save_checkpoint(out_dir, dequantize_flash_layout(qsd), cfg)


def load_transformers(model_dir: Path) -> Any:
    """transformers' model from ``model_dir`` in fp32, eager attention, eval mode;
    raises if any checkpoint key is missing, unexpected or mismatched."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager",
        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
    if bad or info.get("error_msgs"):
        raise RuntimeError(f"transformers did not load {model_dir} cleanly: {info}")
    return model.eval()


def verify(model_dir: Path) -> None:
    """Round trip: transformers loads the DeepSeek names and holds exactly the
    tensors written (the inverse mapping is right, nothing left at its init)."""
    import torch
    from safetensors.torch import load_file

    model = load_transformers(model_dir)
    sd = load_file(str(model_dir / "model.safetensors"))
    hf = model.state_dict()
    n = 0
    for hf_name, t in hf.items():
        if hf_name.endswith("experts.gate_up_proj"):
            base = to_deepseek_name(hf_name.removesuffix("gate_up_proj"))
            want = torch.stack([torch.cat([sd[f"{base}{e}.w1.weight"],
                                           sd[f"{base}{e}.w3.weight"]]) for e in range(t.shape[0])])
        elif hf_name.endswith("experts.down_proj"):
            base = to_deepseek_name(hf_name.removesuffix("down_proj"))
            want = torch.stack([sd[f"{base}{e}.w2.weight"] for e in range(t.shape[0])])
        else:
            want = sd[to_deepseek_name(hf_name)]
        if not torch.equal(t.to(want.dtype) if want.dtype == torch.int64 else t,
                           want.to(t.dtype)):
            raise RuntimeError(f"{hf_name}: transformers holds other values than the file")
        n += 1
    print(f"[make_oracle_checkpoint] transformers round trip: {n} tensors equal")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--layout", choices=LAYOUTS, default="bf16")
    ap.add_argument("--dequantized", type=Path, metavar="REF_DIR",
                    help="fp8-mxfp4: also write its values as a bf16 checkpoint here")
    ap.add_argument("--verify", action="store_true", help="load it back with transformers")
    args = ap.parse_args(argv)
    if args.dequantized and args.layout == "bf16":
        ap.error("--dequantized needs --layout fp8-mxfp4")
    if args.verify and args.layout != "bf16" and not args.dequantized:
        ap.error("--verify of fp8-mxfp4 checks its bf16 reference: add --dequantized")
    write(args.out, args.seed, args.layout)
    size = (args.out / "model.safetensors").stat().st_size
    print(f"[make_oracle_checkpoint] wrote {args.out} ({args.layout}, seed {args.seed}, "
          f"{size / 2**20:.1f} MiB)")
    ref = args.out
    if args.dequantized:
        ref = write_dequantized(args.out, args.dequantized)
        print(f"[make_oracle_checkpoint] wrote {ref} (its values, bf16)")
    if args.verify:
        verify(ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
