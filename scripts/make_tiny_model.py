# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Regenerate ``configs/tiny-dsv4``: a DeepSeek-V4-shaped toy model for CPU tests.

Writes ``config.json``, ``generation_config.json`` and a byte-level BPE
tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a chat
template) trained with ``tokenizers`` on an inline corpus: no hub access, no
weights. vLLM serves it with ``--load-format dummy``; the
``vllm_dsv4_dummy_init`` marker in ``config.json`` makes the plugin replace
vLLM's near-zero dummy weights with seeded N(0, 1/fan_in) ones (see
``vllm_dsv4_backend.vllm_compat.dummy_init``).

Shape choices (vLLM 0.32 CPU build constraints in brackets):

* 4 decoder layers with ``compress_ratios = [0, 4, 128, 4]`` plus the trailing
  MTP entry ``0`` (vLLM indexes ``compress_ratios[layer_id]`` and drops the
  MTP layer on CPU): SWA-only, C4 (lightning indexer), C128, C4.
* head_dim 512 = 448 NoPE + 64 RoPE, 8 query heads, 1 KV head [fp8_ds_mla
  584 B cache rows], sliding_window 128.
* indexer 64 heads x 128, ``index_topk = 512`` [``topk_transform_512_cpu``
  asserts 512, so real top-k selection only happens once a C4 layer has more
  than 512 compressed entries, i.e. prompts longer than 4 * 512 = 2048 tokens;
  shorter ones take vLLM's "all entries" short-context path].
* 64 routed experts, top-6, 1 shared [the C++ router ``biased_topk_cpu`` /
  ``hash_topk_cpu`` accepts only E in {64, 128, 256, 384} and top-k in {6, 8}];
  layer 0 is a hash-routed MoE layer (``num_hash_layers = 1``).
* ``max_position_embeddings = 8192`` with DeepSeek's YaRN ratio (factor 16 over
  512 original positions, as Flash has 16 over 65536).

Usage::

    .venv/bin/python scripts/make_tiny_model.py            # (re)write the files
    .venv/bin/python scripts/make_tiny_model.py --check    # exit 1 if they differ
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "configs" / "tiny-dsv4"

VOCAB_TARGET = 512
SPECIAL_TOKENS = ["<bos>", "<eos>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]

# Plain Jinja over role tags; the generation prompt ends with the assistant tag.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}"
    "{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "DeepSeek V4 attends to a sliding window of recent tokens and to compressed memory.",
    "Every fourth token closes a window of the lightning indexer's compressor.",
    "Every hundred and twenty eighth token closes a window of the heavy compressor.",
    "The key value cache stores each token in five hundred and eighty four bytes.",
    "A sparse attention kernel reads only the slots named by its index list.",
    "Question: what is two plus three? Answer: five.",
    "Question: what is seven times six? Answer: forty two.",
    "Question: name a primary colour. Answer: red, green or blue.",
    "Once upon a time a small model learned to count: one, two, three, four, five.",
    "Hello! How are you today? I am fine, thank you, and you?",
    "The weather is sunny in the morning and rainy in the evening.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024.",
    "Symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? : ; , . ' \" # @ $",
    "The system prompt says: you are a helpful assistant.",
    "The user asks a question and the assistant answers it politely.",
]


def corpus() -> list[str]:
    """Deterministic training text: the sentences plus simple variations."""
    lines = list(_SENTENCES)
    for i in range(200):
        a, b = (i * 7) % 23, (i * 11) % 19
        lines.append(f"Sample {i}: {a} plus {b} equals {a + b}.")
        lines.append(_SENTENCES[i % len(_SENTENCES)].lower())
    return lines


def build_tokenizer():
    """Byte-level BPE over :func:`corpus`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(vocab_size: int, bos_id: int, eos_id: int) -> dict:
    """DeepSeek-V4 config.json with every field vLLM 0.32's DSv4 code reads."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "dtype": "bfloat16",
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
        "use_cache": True,
        "initializer_range": 0.02,
        # trunk
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        # mHC (hyper-connections)
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        # attention (MQA over a shared 512-d latent)
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 128,
        "o_lora_rank": 128,
        "o_groups": 2,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": 128,
        "compress_ratios": [0, 4, 128, 4, 0],
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        # lightning indexer
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        # MoE
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 1,
        "moe_intermediate_size": 128,
        "num_hash_layers": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "expert_dtype": "fp4",
        # honoured by vllm_dsv4_backend.vllm_compat.dummy_init under --load-format dummy
        "vllm_dsv4_dummy_init": {"kind": "fan_in_normal", "seed": 0},
    }


def _dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=False) + "\n"


def write(out: Path) -> list[Path]:
    """Write every file of the model directory into ``out``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        tok_json = json.loads(Path(tmp, "tokenizer.json").read_text())
        tok_cfg = json.loads(Path(tmp, "tokenizer_config.json").read_text())
    # Pin the template inside tokenizer_config.json (transformers may write a
    # separate chat_template.jinja) and drop version-dependent noise.
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    # transformers 5 writes its own backend class name; the classic name loads
    # on transformers 4.x and 5.x alike.
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.pop("backend", None)
    tok_cfg.pop("transformers_version", None)
    vocab = len(tok)
    bos, eos = tok.convert_tokens_to_ids(["<bos>", "<eos>"])
    files = {
        "tokenizer.json": json.dumps(tok_json, indent=2, ensure_ascii=False) + "\n",
        "tokenizer_config.json": _dump(tok_cfg),
        "config.json": _dump(model_config(vocab, bos, eos)),
        "generation_config.json": _dump(
            {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
        ),
    }
    paths = []
    for name, text in files.items():
        p = out / name
        p.write_text(text, encoding="utf-8")
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temp dir and fail if the files in --out differ",
    )
    args = ap.parse_args(argv)
    # Single-threaded BPE training: merge order must not depend on scheduling.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = write(Path(tmp))
            bad = [
                p.name
                for p in fresh
                if not (args.out / p.name).exists()
                or (args.out / p.name).read_bytes() != p.read_bytes()
            ]
        if bad:
            print(f"[make_tiny_model] out of date in {args.out}: {bad}", file=sys.stderr)
            return 1
        print(f"[make_tiny_model] {args.out} is up to date")
        return 0
    paths = write(args.out)
    cfg = json.loads((args.out / "config.json").read_text())
    print(
        f"[make_tiny_model] wrote {len(paths)} files to {args.out} "
        f"(vocab {cfg['vocab_size']}, layers {cfg['num_hidden_layers']}, "
        f"compress_ratios {cfg['compress_ratios']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
