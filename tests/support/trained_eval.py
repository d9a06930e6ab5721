# SPDX-License-Identifier: Apache-2.0
"""The trained tiny model's tasks (``configs/lm_eval/tasks/dsv4_{kv_far,kv_near,copy}``)
scored the way their YAML scores them (greedy until ``;``/``?``, exact match), on
one in-process ``vllm.LLM`` whose negative-control switch
(``VLLM_DSV4_TEST_ORACLE_FAULT``) is flipped between runs: one engine start for all
controls, where a ``vllm serve`` per control would cost a server start each.

Worker: ``python -m tests.support.trained_eval SPEC OUT``; SPEC names the model,
the engine arguments, the docs per task and the faults; OUT gets, per fault
(``off`` first), per task, every doc's generation.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support import ROOT

TASKS_DIR = ROOT / "configs" / "lm_eval" / "tasks"
MAX_TOKENS = {"dsv4_kv_far": 2, "dsv4_kv_near": 2, "dsv4_copy": 10}


def docs(limit: int | None) -> dict[str, list[dict[str, Any]]]:
    """The first ``limit`` docs of each task, from the JSONL lm_eval reads."""
    out = {}
    for task in MAX_TOKENS:
        path = TASKS_DIR / "data" / f"trained_{task.removeprefix('dsv4_')}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        out[task] = rows[:limit] if limit else rows
    return out


def results_table(gens: Mapping[str, Sequence[str]],
                  task_docs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """lm_eval's ``results`` table for exact match (stderr with n - 1, as lm_eval)."""
    table = {}
    for task, g in gens.items():
        ds = task_docs[task]
        n = len(ds)
        p = sum(a == d["answer"] for a, d in zip(g, ds)) / n
        table[task] = {"exact_match,none": p,
                       "exact_match_stderr,none": math.sqrt(p * (1 - p) / max(n - 1, 1))}
    return table


def worker(spec_path: str, out_path: str) -> None:  # pragma: no cover - subprocess
    spec = json.loads(Path(spec_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the fault switch is read in-process
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import vllm.plugins
    from vllm import LLM, SamplingParams

    vllm.plugins.load_general_plugins()
    llm = LLM(model=spec["model"], **spec["engine"])
    out: dict[str, Any] = {}
    for fault in ["off", *spec["faults"]]:
        os.environ["VLLM_DSV4_TEST_ORACLE_FAULT"] = fault
        out[fault] = {}
        for task, ds in spec["docs"].items():
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[task],
                                stop=[";", "?"], seed=0)
            # one request at a time, as lm_eval sends them (num_concurrent 1): the CPU
            # path is not batch invariant
            out[fault][task] = [llm.generate([d["prompt"]], sp, use_tqdm=False)[0]
                                .outputs[0].text for d in ds]
    os.environ["VLLM_DSV4_TEST_ORACLE_FAULT"] = "off"
    Path(out_path).write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # skip the in-process engine's teardown


if __name__ == "__main__":  # pragma: no cover
    worker(sys.argv[1], sys.argv[2])
