# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run the tiny DeepSeek-V4 through real vLLM once per requested variant and
dump greedy tokens + top logprobs as JSON (used by test_parity.py).

A variant is a set of environment variables applied before the engine starts
(the engine core is a spawned process and inherits them), e.g. vLLM's own
CPU attention (``VLLM_DSV4_ATTN_IMPL=vllm``) vs the plugin's layer with the
torch kernels forced (``VLLM_DSV4_ATTN_IMPL=plugin VLLM_DSV4_KERNEL=torch``).

Usage: python parity_worker.py SPEC.json OUT.json
SPEC: {"model": dir, "prompts": [[ids...]], "max_tokens": n, "logprobs": k,
       "one_at_a_time": bool (optional: one request per generate()),
       "engine": {...LLM kwargs...},
       "variants": {name: {env} | {"env": {...}, "engine": {...LLM kwarg overrides}}}}
"""

import gc
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.plugins import load_general_plugins

    # LLM() converts attention_config dicts before it loads plugins; load them
    # first so use_fp4_indexer_cache is understood (the CLI needs no help).
    load_general_plugins()

    results: dict = {}
    base_env = dict(os.environ)
    for name, variant in spec["variants"].items():
        # A variant is {env} or {"env": {...}, "engine": {...overrides}}.
        env = variant.get("env", variant)
        engine = {**spec["engine"], **variant.get("engine", {})}
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(env)
        t0 = time.perf_counter()
        llm = LLM(model=spec["model"], **engine)
        init_s = time.perf_counter() - t0
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=spec["max_tokens"],
            logprobs=spec["logprobs"],
            ignore_eos=True,
            seed=0,
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        t0 = time.perf_counter()
        if spec.get("one_at_a_time"):
            # The engine core runs in another process and may start a step before
            # every request of a batch has arrived, so batch composition (and with
            # it the GEMM/MoE rounding, which is not batch invariant) can change
            # from run to run. One request per generate() is the same every run.
            outs = [o for p in prompts for o in llm.generate([p], sp, use_tqdm=False)]
        else:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        gen_s = time.perf_counter() - t0
        rows = []
        for o in outs:
            c = o.outputs[0]
            rows.append(
                {
                    "tokens": list(c.token_ids),
                    "logprobs": [
                        {str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs
                    ],
                }
            )
        results[name] = {"outputs": rows, "init_s": init_s, "generate_s": gen_s}
        print(f"[parity] {name}: init {init_s:.1f}s generate {gen_s:.1f}s", flush=True)
        del llm
        gc.collect()
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
