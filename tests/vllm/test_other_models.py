# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin leaves every other model alone, and vLLM serves with every patch failing.

Two tiny non-DeepSeek models made here with seeded random weights (no hub): a dense
Llama and a Mixtral MoE (vLLM's CPU fused-MoE experts, the class the plugin's
``moe_expert_map`` patch wraps), with the tiny DeepSeek-V4's tokenizer. Each is run
greedily, with top-5 logprobs, by an in-process ``vllm.LLM`` (one worker process per
variant, both models in it):

* ``none``: ``VLLM_PLUGINS=`` (empty): vLLM without any plugin;
* ``plugin``: vLLM's default, which loads ``dsv4_backend`` (the entry point);
* ``failing``: the plugin loaded with every registry entry's install failing after
  it changed vLLM (``tests.support.patch_failures``' ``after`` injection), except the
  architecture check, which installs and then fails each time vLLM builds an
  engine config (it runs for every model).

Tokens and logprobs must be bitwise equal across the three. The ``failing`` engines
serve at all only because each failure was caught: one ERROR line per entry, and
nothing applied but the architecture check's wrapper.

This file is also the worker script: ``python test_other_models.py VARIANT MODELS OUT``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "configs" / "tiny-dsv4"
# MoE first: vLLM creates its expert-parallel group with the first engine of a process.
MODELS = ("mixtral", "llama")
VARIANTS = ("none", "plugin", "failing")
MAX_TOKENS = 8
LOGPROBS = 5
# Entries a tiny non-DeepSeek model's engine must reach (modules every engine
# imports; Mixtral's CPU experts).
REACHED = ("attention_config_json", "attention_config_init", "moe_expert_map")


def _configs(vocab: int, bos: int, eos: int) -> dict[str, dict[str, Any]]:
    common = {
        "vocab_size": vocab, "bos_token_id": bos, "eos_token_id": eos,
        # head_dim 64: vLLM's CPU attention kernel takes 32, 64, 80, 96, 112, 128, ...
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        # Wide enough that the logits are far from uniform (distinct greedy picks).
        "initializer_range": 0.2, "torch_dtype": "bfloat16",
    }
    return {
        "llama": {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "mixtral": {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                    "num_local_experts": 8, "num_experts_per_tok": 2,
                    "sliding_window": None},
    }


def make_models(out: Path) -> dict[str, Path]:
    """Write the two models (config, seeded random safetensors, the tiny tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = json.loads((TOKENIZER / "config.json").read_text())
    paths = {}
    for name, cfg in _configs(tok["vocab_size"], tok["bos_token_id"],
                              tok["eos_token_id"]).items():
        path = out / name
        path.mkdir(parents=True, exist_ok=True)
        config = AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                         if k not in ("architectures",)})
        config.architectures = cfg["architectures"]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / f, path / f)
        paths[name] = path
    return paths


# ----------------------------------------------------------------------------
# worker
# ----------------------------------------------------------------------------
def _worker(variant: str, models_dir: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_DSV4_ATTN_IMPL"] = "auto"
    if variant == "none":
        os.environ["VLLM_PLUGINS"] = ""
    else:
        os.environ.pop("VLLM_PLUGINS", None)
    from tests.support.vllm_helpers import exit_with_report

    errors: dict[tuple[str, float], None] = {}
    if variant == "failing":
        # vLLM first, as when this worker imported the injection from the test module (which
        # imports vllm): vLLM's logging setup on import resets the "vllm" logger's handlers.
        import vllm  # noqa: F401

        from tests.support import patch_failures as pf
        from vllm_dsv4_backend.vllm_compat import guards, patches

        errors = pf.capture_errors()
        pf.inject("after", [n for n in patches.PATCHES if n != "architecture_check"], {},
                  elsewhere=False)

        def failing_check(vllm_config: Any) -> None:
            raise AttributeError("injected into architecture_check's check")

        guards.check_architecture = failing_check

    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    prompts = [[rng.randrange(16, 500) for _ in range(n)] for n in (5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS,
                            ignore_eos=True, seed=0)
    report: dict[str, Any] = {"outputs": {}}
    keep = []  # engines stay alive: tearing one down in-process is not what is tested
    for name in MODELS:
        llm = LLM(model=str(Path(models_dir) / name), tokenizer_mode="hf", dtype="bfloat16",
                  max_model_len=256, max_num_batched_tokens=256, enforce_eager=True, seed=0,
                  distributed_executor_backend="uni")
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        report["outputs"][name] = [
            {"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                          for step in o.outputs[0].logprobs]}
            for o in outs]
        keep.append(llm)
    from vllm_dsv4_backend import plugin
    from vllm_dsv4_backend.vllm_compat import patches

    report["registered"] = plugin._REGISTERED
    report["applied"] = patches.applied()
    report["failed"] = patches.failed()
    report["errors"] = [message for message, _ in errors]
    exit_with_report(out_path, report)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])


# ----------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------
pytest.importorskip("vllm")

from tests.support.vllm_helpers import run_script_report  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("other_models")
    make_models(out / "models")
    return {v: run_script_report(__file__, [v, str(out / "models")], out / f"{v}.json",
                                 timeout=900)
            for v in VARIANTS}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plugin", "failing"])
def test_other_models_bitwise_untouched(runs, variant):
    """Same tokens and logprobs, bit for bit, as vLLM without the plugin."""
    assert not runs["none"]["registered"] and runs[variant]["registered"]
    if variant == "plugin":
        # The plugin did patch what these engines run through (else equality is trivial).
        assert set(REACHED) | {"architecture_check"} <= set(runs["plugin"]["applied"]), (
            runs["plugin"]["applied"])
    for name in MODELS:
        assert runs[variant]["outputs"][name] == runs["none"]["outputs"][name], name
    # Distinct picks (the comparison is not between two constant streams).
    tokens = {t for o in runs["none"]["outputs"]["llama"] for t in o["tokens"]}
    assert len(tokens) > 3


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_serves_with_every_patch_failing(runs):
    r = runs["failing"]
    assert r["applied"] == ["architecture_check"], "a failing entry was left applied"
    assert set(REACHED) <= set(r["failed"]), sorted(r["failed"])
    for name in [*r["failed"], "architecture_check"]:
        named = [e for e in r["errors"] if f"patch {name} " in e]
        assert len(named) == 1, (name, r["errors"])
    # Two engine configs built, one line: the check failed at each.
    assert "engine config used unchecked" in next(
        e for e in r["errors"] if "patch architecture_check " in e)
    assert all("vllm_dsv4_backend: patch " in e for e in r["errors"]), r["errors"]
