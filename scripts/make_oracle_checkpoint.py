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
* the quantized layout DeepSeek-V4-Flash ships (FP8 128x128 block-scaled
  linears, MXFP4 experts) is not written: see docs/correctness.md
  ("transformers oracle") for why neither side's CPU path loads it.

Usage::

    .venv/bin/python scripts/make_oracle_checkpoint.py OUT_DIR [--seed 0]
    .venv/bin/python scripts/make_oracle_checkpoint.py OUT_DIR --verify   # + round trip
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


def write(out_dir: Path, seed: int = SEED) -> Path:
    """Write config, tokenizer and ``model.safetensors`` into ``out_dir``."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = oracle_config(seed)
    sd = deepseek_state_dict(cfg, seed)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY / f, out_dir / f)
    return out_dir


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
    ap.add_argument("--verify", action="store_true", help="load it back with transformers")
    args = ap.parse_args(argv)
    write(args.out, args.seed)
    size = (args.out / "model.safetensors").stat().st_size
    print(f"[make_oracle_checkpoint] wrote {args.out} (seed {args.seed}, {size / 2**20:.1f} MiB)")
    if args.verify:
        verify(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
